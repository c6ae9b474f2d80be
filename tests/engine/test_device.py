"""Device handling on a faked multi-GPU host (CPU only): indexed devices, and `set_device`
(per thread in CUDA) called by every thread that touches CUDA. `torch.cuda`'s
`is_available`, `device_count`, `set_device` and `current_device` are replaced by fakes that
record each thread's calls."""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.distributed as dist

from duet.engine.config import EngineConfig
from duet.engine.core import EngineCore
from duet.engine.device import bind_thread, resolve_device
from duet.engine.llm_engine import LLMEngine
from duet.engine.parallel import TensorParallel
from duet.engine.tp_group import init_tensor_parallel
from duet.kv_transfer import create_receiver, create_sender
from duet.kv_transfer.torch_dist import receiver as td_receiver
from duet.kv_transfer.torch_dist import send_thread as td_send_thread
from duet.prefill_worker.config import PrefillWorkerConfig
from tests.kv_transfer.paged import caches, layout
from tests.waiting import wait_for

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


class FakeCuda:
    """A host with `num_gpus` GPUs: what each thread set as its current device."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, num_gpus: int = 2) -> None:
        self.calls: list[tuple[str, torch.device]] = []  # (thread name, device)
        self._current = threading.local()
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: num_gpus)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)
        monkeypatch.setattr(torch.cuda, "current_device", self.current_device)

    def set_device(self, device: torch.device | int) -> None:
        index = device if isinstance(device, int) else device.index
        assert index is not None, f"set_device({device!r}) without an index"
        self._current.index = index
        self.calls.append((threading.current_thread().name, torch.device("cuda", index)))

    def current_device(self) -> int:
        return getattr(self._current, "index", 0)  # CUDA's default in a thread that never set


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    return FakeCuda(monkeypatch)


def test_devices_are_indexed_by_rank(fake_cuda: FakeCuda) -> None:
    assert EngineConfig().resolve_device(1) == torch.device("cuda", 1)
    assert EngineConfig(device="cuda").resolve_device(0) == torch.device("cuda", 0)
    assert resolve_device("cuda", 3) == torch.device("cuda", 1)  # 4 ranks on 2 GPUs
    assert resolve_device("cpu", 1) == torch.device("cpu")


def test_bind_thread_sets_the_device_in_the_calling_thread(fake_cuda: FakeCuda) -> None:
    thread = threading.Thread(target=bind_thread, args=(torch.device("cuda", 1),), name="t1")
    thread.start()
    thread.join(10)
    assert fake_cuda.calls == [("t1", torch.device("cuda", 1))]
    assert fake_cuda.current_device() == 0  # this thread's is untouched
    bind_thread(torch.device("cpu"))
    assert len(fake_cuda.calls) == 1
    with pytest.raises(ValueError, match="no index"):
        bind_thread(torch.device("cuda"))


def test_tp_rank_1_runs_on_cuda_1_in_the_launch_and_engine_threads(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`python -m duet.prefill_worker --tp-rank 1` on a 2-GPU host: the launching thread (NCCL's
    set-up) and the engine thread that builds and runs the engine both use cuda:1."""
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: None)
    monkeypatch.setattr(dist, "new_group", lambda *a, **k: None)
    config = PrefillWorkerConfig(tensor_parallel_size=2, load_progress=False)
    tp, _ = init_tensor_parallel(1, 2, config.resolve_device(1), init_method="tcp://127.0.0.1:1")
    assert fake_cuda.calls == [(threading.current_thread().name, torch.device("cuda", 1))]

    loads: list[tuple[str, torch.device, int]] = []

    class Stop(Exception):
        pass

    def load_model(model, dtype, device, *args):  # stands in for the CUDA weights
        loads.append((threading.current_thread().name, device, torch.cuda.current_device()))
        raise Stop

    monkeypatch.setattr("duet.engine.llm_engine.load_model", load_model)
    tp = TensorParallel(1, 2, None)
    core = EngineCore(lambda: LLMEngine(config, tp), name="p0-rank1", tp=tp)
    with pytest.raises(Stop):
        core.wait_ready(30)
    assert loads == [("duet-p0-rank1", torch.device("cuda", 1), 1)]
    assert ("duet-p0-rank1", torch.device("cuda", 1)) in fake_cuda.calls


def test_kv_transfer_threads_bind_the_caches_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch_dist send thread and a receiver's channel thread bind the device of the caches
    (a no-op on these CPU caches; on CUDA it is the engine's cuda:N) before touching them."""
    bound: list[tuple[str, torch.device]] = []

    def record(device: torch.device) -> None:
        bound.append((threading.current_thread().name, device))

    monkeypatch.setattr(td_send_thread, "bind_thread", record)
    monkeypatch.setattr(td_receiver, "bind_thread", record)
    dst, src = caches(seed=1), caches()
    recv = create_receiver("torch_dist", kv_caches=dst, layout=layout(dst), timeout_s=10)
    sender = create_sender("torch_dist", kv_caches=src, layout=layout(src), name="p0", timeout_s=10)
    try:
        sender.connect(recv.address)
        wait_for(lambda: len(bound) == 2, 20, "both threads bound")
    finally:
        sender.close()
        recv.close()
    names = sorted(name.split("-")[1] for name, _ in bound)
    assert names == ["recv", "send"]
    assert {device for _, device in bound} == {torch.device("cpu")}
