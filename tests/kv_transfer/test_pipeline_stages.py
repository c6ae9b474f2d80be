"""KV from a sending group split into pipeline stages: each stage's ranks cache and ship their
layers only, and one receiver (every layer) puts each stage's into its own layers, over every
backend, whole and layer by layer. A request is complete only once every stage landed."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from duet.kv_transfer import TransferStatus, chunks, create_receiver, create_sender
from duet.kv_transfer.fanout import FanOutKVSender
from duet.kv_transfer.layout import (
    HandshakeError,
    KVLayout,
    check_compatible,
    num_senders,
)
from duet.kv_transfer.local import LocalHub
from tests.kv_transfer.paged import caches, layout
from tests.waiting import wait_for

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

BACKENDS = ["local", "torch_dist", "tcp", "nixl", "nixl-push"]
STAGES = [(0, 1), (1, 3)]  # 3 layers over 2 stages: stage 0 layer 0, stage 1 layers 1-2


def stage_layout(kv, tp_size, tp_rank, stage):
    return KVLayout.of_caches("m", kv, 4, tp_size, tp_rank, pp_size=2, pp_stage=stage, num_layers=3)


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    if request.param == "nixl-push":  # the sender writes into the receiver's blocks
        monkeypatch.setenv("DUET_KV_NIXL_MODE", "push")
        return "nixl"
    return request.param


def group(backend, full, tp_size, **options):
    """A sender per (stage, TP rank): its stage's layers and its TP rank's heads of `full`."""
    heads = 4 // tp_size
    senders = []
    for stage, (start, end) in enumerate(STAGES):
        for rank in range(tp_size):
            shard = [c[:, :, :, heads * rank : heads * (rank + 1)].clone() for c in full[start:end]]
            sender = create_sender(
                backend, kv_caches=shard, layout=stage_layout(shard, tp_size, rank, stage),
                name=f"p{stage}{rank}", timeout_s=10, **options,
            )  # fmt: skip
            senders.append((stage, shard, sender))
    return senders


def check_done(results, meta, recv, senders):
    """The receiver's one result is DONE with `meta`; every sender's is DONE; all closed."""
    [done] = results
    assert (done.status, done.meta) == (TransferStatus.DONE, meta)
    for sender in senders:
        assert [r.status for r in wait_for(sender.poll, 20, "sender.poll")] == [TransferStatus.DONE]
        sender.close()
    recv.close()


@pytest.mark.parametrize("tp_size", [1, 2])
def test_each_stage_lands_its_layers_and_the_request_waits_for_every_stage(backend, tp_size):
    hub = LocalHub() if backend == "local" else None
    options = {"hub": hub} if hub is not None else {}
    dst = caches(seed=1)
    recv_options = {"name": "d", **options} if hub is not None else {}
    recv = create_receiver(backend, kv_caches=dst, layout=layout(dst), timeout_s=10, **recv_options)
    full = caches()
    senders = group(backend, full, tp_size, **options)
    assert num_senders(senders[0][2].layout, recv.layout) == 2 * tp_size
    recv.expect("r", [4, 6], timeout_s=10)
    for stage, _, sender in senders:
        if stage == 0:
            sender.send("r", [1, 2], recv.address, meta={"first_token": 42, "stage": stage})

    def stage_zero_landed():
        recv_results.extend(recv.poll())
        return [True] if torch.equal(dst[0][:, [4, 6]], full[0][:, [1, 2]]) else []

    recv_results: list = []
    assert wait_for(stage_zero_landed, 20, "stage 0's layer") == [True]
    assert recv_results == []  # stage 1's layers are not in: the request is not done
    assert senders[0][2].poll() == []  # nor acknowledged to the first stage
    for stage, _, sender in senders:
        if stage == 1:
            sender.send("r", [1, 2], recv.address, meta={"first_token": 42, "stage": stage})
    # the first stage's lowest rank's metadata
    done = recv_results or wait_for(recv.poll, 20, "recv.poll")
    check_done(done, {"first_token": 42, "stage": 0}, recv, [s for *_, s in senders])
    for f, d in zip(full, dst, strict=True):
        assert torch.equal(d[:, [4, 6]], f[:, [1, 2]])


def test_layerwise_stages_name_the_models_layers(backend, monkeypatch):
    """The engine names the model's layer as each is computed (a stage's start at its
    first); each stage's `FanOutKVSender` ships it as its own layer, and it lands in the
    receiver's layer of that index."""
    monkeypatch.setattr(chunks, "CHUNK_MIN_BYTES", 1)  # one message per layer
    hub = LocalHub() if backend == "local" else None
    options = {"hub": hub} if hub is not None else {}
    dst = caches(seed=1)
    before = [c.clone() for c in dst]
    recv_options = {"name": "d", **options} if hub is not None else {}
    recv = create_receiver(backend, kv_caches=dst, layout=layout(dst), timeout_s=10, **recv_options)
    final = caches(seed=5)
    stages = []
    for stage, (start, end) in enumerate(STAGES):
        src = [torch.zeros_like(c) for c in final[start:end]]
        lay = stage_layout(src, 1, 0, stage)

        def make(index, src=src, lay=lay, stage=stage):
            return create_sender(backend, src, lay, None, None, name=f"s{stage}-{index}",
                                 timeout_s=10, **options)  # fmt: skip

        stages.append((start, src, FanOutKVSender(make, lay)))
    recv.expect("r", [9, 3], timeout_s=10)
    began = [fan.begin("r", [0, 5], recv.address) for _, _, fan in stages]
    for layer in range(3):  # the model's layers in order, each on its stage
        stage = next(i for i, (start, end) in enumerate(STAGES) if start <= layer < end)
        start, src, fan = stages[stage]
        src[layer - start].copy_(final[layer])
        if not began[stage]:
            continue  # a backend that sends whole requests: `send` after the pass
        fan.layer_computed(layer)

        def landed(layer=layer):
            if torch.equal(dst[layer][:, [9, 3]], final[layer][:, [0, 5]]):
                return [True]
            return recv.poll()

        assert wait_for(landed, 20, f"layer {layer}") == [True]
        for later in range(layer + 1, 3):
            assert torch.equal(dst[later], before[later])
    assert began == ([False, False] if backend == "local" else [True, True])
    for (_, _, fan), whole in zip(stages, began, strict=True):
        if whole:
            fan.finish("r", {"first_token": 7})
        else:
            fan.send("r", [0, 5], recv.address, {"first_token": 7})
    check_done(wait_for(recv.poll, 20, "recv.poll"), {"first_token": 7}, recv,
               [fan for *_, fan in stages])  # fmt: skip
    for f, d in zip(final, dst, strict=True):
        assert torch.equal(d[:, [9, 3]], f[:, [0, 5]])


def test_a_stage_layout_names_its_layers_and_a_staged_receiver_is_refused():
    kv = caches()[:2]
    lay = KVLayout.of_caches("m", kv, 4, pp_size=2, pp_stage=1, num_layers=3)
    assert (lay.layer_range, lay.num_local_layers, lay.num_layers) == ((1, 3), 2, 3)
    with pytest.raises(ValueError, match="kv_caches: 2 layers; stage 0 of 2 caches 1 of the"):
        KVLayout.of_caches("m", kv, 4, pp_size=2, pp_stage=0, num_layers=3)
    whole = layout(caches())
    check_compatible(lay, whole)
    with pytest.raises(HandshakeError, match="receiver pp_size: a receiving side caches every"):
        check_compatible(lay, dataclasses.replace(whole, pp_size=3, pp_stage=0))
    with pytest.raises(HandshakeError, match=r"sender pp_stage: must be in \[0, pp_size=2\)"):
        check_compatible(dataclasses.replace(lay, pp_stage=2), whole)
    with pytest.raises(ValueError, match="a draft's KV travels from unsharded caches only"):
        lay.with_draft("d", caches()[:1])


def test_each_stage_fans_out_to_a_tensor_parallel_receivers_ranks(backend):
    """Stages of one TP rank each (all 4 heads) to a receiver of TP 2: each stage's
    `FanOutKVSender` ships each decode rank its 2 heads of the stage's layers (the address
    names both ranks' receivers), and each decode rank is complete once both stages landed."""
    hub = LocalHub() if backend == "local" else None
    options = {"hub": hub} if hub is not None else {}
    full = caches()
    dst = [caches(heads=2, seed=7 + k) for k in range(2)]
    receivers = []
    for k in range(2):
        named = {"name": f"d{k}", **options} if hub is not None else {}
        lay = layout(dst[k], 4, 2, k)
        receivers.append(create_receiver(backend, kv_caches=dst[k], layout=lay, timeout_s=10,
                                         **named))  # fmt: skip
    address = ",".join(r.address for r in receivers)
    fans = []
    for stage, (start, end) in enumerate(STAGES):
        src = [c.clone() for c in full[start:end]]
        lay = stage_layout(src, 1, 0, stage)

        def make(index, src=src, lay=lay, stage=stage):
            return create_sender(backend, src, lay, None, None, name=f"s{stage}-{index}",
                                 timeout_s=10, **options)  # fmt: skip

        fans.append(FanOutKVSender(make, lay))
    for recv in receivers:
        recv.expect("r", [3, 8], timeout_s=10)
    for fan in fans:
        assert [k for k, _ in fan.targets(address)] == [0, 1]
        fan.send("r", [5, 1], address, {"first_token": 9})
    for k, recv in enumerate(receivers):
        [done] = wait_for(recv.poll, 20, f"decode rank {k}")
        assert (done.status, done.meta) == (TransferStatus.DONE, {"first_token": 9})
        for f, d in zip(full, dst[k], strict=True):  # its heads of every layer, from each stage
            assert torch.equal(d[:, [3, 8]], f[:, [5, 1], :, 2 * k : 2 * k + 2])
    for fan in fans:
        assert [r.status for r in wait_for(fan.poll, 20, "fan.poll")] == [TransferStatus.DONE]
        fan.close()
    for recv in receivers:
        recv.close()
