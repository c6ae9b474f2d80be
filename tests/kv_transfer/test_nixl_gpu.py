"""On a machine with a CUDA GPU: the nixl backend on CUDA caches, the same code as on CPU. Two
processes on one GPU move KV over UCX's CUDA IPC (NCCL refuses two ranks of one communicator
on one device; NIXL does not need one), pull and push, bit-exact. The one-GPU disaggregated cluster over nixl (Ray):
tests/deploy/test_gpu_nixl.py. Skipped without CUDA."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from duet.kv_transfer import TransferStatus, create_receiver
from tests.kv_transfer.paged import layout
from tests.waiting import wait_for

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SENDER_SCRIPT = """
import sys, torch
from duet.kv_transfer import create_sender
from tests.kv_transfer.paged import layout
g = torch.Generator().manual_seed(0)
kv = [torch.randn(2, 64, 16, 4, 64, generator=g).to(torch.bfloat16).cuda() for _ in range(4)]
s = create_sender("nixl", kv, layout(kv), name="gpu-p0", timeout_s=30, mode=sys.argv[2])
s.send("r1", list(range(8, 40)), sys.argv[1], meta={"first_token": 5})
while not (out := s.poll()):
    pass
print(out[0].status.value, flush=True)
s.close()
"""


def cuda_caches(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 64, 16, 4, 64, generator=g).to(torch.bfloat16).cuda() for _ in range(4)]


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_two_processes_on_one_gpu_move_kv_cache_to_cache(mode):
    dst = cuda_caches(seed=1)
    want = [c.cpu() for c in cuda_caches(seed=0)]
    recv = create_receiver("nixl", dst, layout(dst), timeout_s=30)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        recv.expect("r1", list(range(32)), timeout_s=60)
        proc = subprocess.run(
            [sys.executable, "-c", SENDER_SCRIPT, recv.address, mode],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.stdout.strip() == "done", proc.stderr
        [result] = wait_for(recv.poll, 30, "the receiver's result")
        assert (result.status, result.meta) == (TransferStatus.DONE, {"first_token": 5})
        for w, d in zip(want, dst, strict=True):
            assert torch.equal(d[:, :32].cpu(), w[:, 8:40])
    finally:
        recv.close()
