"""Prefill worker -> KV transfer -> decode worker, in one process: the same tokens as the
aggregated engine, and every block back in its pool afterwards (including aborts and KV that
never arrives)."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from duet.decode_worker.config import DecodeWorkerConfig
from duet.decode_worker.worker import DecodeWorker, KVTransferError, NoCapacityError
from duet.engine import LLM, SamplingParams
from duet.kv_transfer import TransferStatus, chunks, staging
from duet.kv_transfer.local import LocalHub
from duet.prefill_worker.config import PrefillWorkerConfig
from duet.prefill_worker.worker import PrefillWorker
from tests.waiting import wait_for, wait_for_async

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

ENGINE = dict(dtype="float32", load_progress=False, block_size=8, num_kv_blocks=256)


def mixed_prompts(n: int = 16, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 180, (n,), generator=g).tolist()
    return [torch.randint(3, 512, (k,), generator=g).tolist() for k in lengths]


def start_workers(model, backend, layerwise=True, **engine):
    engine = {**ENGINE, **engine}
    hub = LocalHub()
    p_opts = {"hub": hub} if backend == "local" else {}
    d_opts = {"hub": hub, "name": "decode-0"} if backend == "local" else {}
    prefill = PrefillWorker(
        PrefillWorkerConfig(model=model, kv_backend=backend, kv_layerwise=layerwise, **engine),
        sender_options=p_opts,
    )
    decode = DecodeWorker(
        DecodeWorkerConfig(model=model, kv_backend=backend, **engine), receiver_options=d_opts
    )
    return prefill, decode


def emulate_nccl(monkeypatch):
    """torch_dist with NCCL's semantics (issue #18), a message per layer so that the transfers
    of one pass interleave on the wire."""
    monkeypatch.setenv("DUET_KV_EMULATE_NCCL", "1")
    monkeypatch.setattr(chunks, "CHUNK_MIN_BYTES", 1)


def small_pieces(monkeypatch):
    """The smallest staging pool (1 MiB) cut into 4 KiB pieces: a layer of more than two
    blocks of the tiny model goes as several pieces of its blocks."""
    monkeypatch.setattr(staging, "PIECES_PER_POOL", 256)
    return {"kv_staging_bytes": 1 << 20}


@pytest.fixture(
    params=["local", "torch_dist", "torch_dist-whole", "torch_dist-nccl", "torch_dist-pieces",
            "tcp", "tcp-whole", "tcp-pieces"]
)  # fmt: skip
def workers(request, tiny_llama, monkeypatch):
    """torch_dist and tcp send layer by layer during the last prefill pass; -whole after it;
    -nccl under NCCL's semantics; -pieces through a staging pool of 4 KiB pieces."""
    backend, _, mode = request.param.partition("-")
    if mode == "nccl":
        emulate_nccl(monkeypatch)
    engine = small_pieces(monkeypatch) if mode == "pieces" else {}
    prefill, decode = start_workers(tiny_llama, backend, layerwise=mode != "whole", **engine)
    yield prefill, decode
    prefill.shutdown()
    decode.shutdown()


def spy_begun(prefill):
    """Request ids whose KV the prefill worker's sender streamed layer by layer."""
    begun = []
    begin = prefill.sender.begin

    def spy(request_id, block_ids, dest, draft_block_ids=None):
        streamed = begin(request_id, block_ids, dest, draft_block_ids)
        if streamed:
            begun.append(request_id)
        return streamed

    prefill.sender.begin = spy
    return begun


async def disaggregated(prefill, decode, request_id, prompt, params):
    """What the router does: reserve on decode, prefill towards it, stream from decode."""
    remote = await decode.reserve(request_id, prompt, params)
    async with remote:
        result, outputs = await asyncio.gather(
            prefill.prefill(request_id, prompt, params, remote.reservation.kv_address),
            collect(remote),
        )
    assert result.status == TransferStatus.DONE, result
    return result, outputs


async def collect(remote):
    return [out async for out in remote]


def assert_pools_whole(prefill, decode):
    for engine in (prefill.engine, decode.engine):
        assert engine.kv.num_free_blocks == engine.num_blocks


def test_disaggregated_equals_aggregated(workers, tiny_llama):
    prefill, decode = workers
    begun = spy_begun(prefill)
    layerwise = prefill.kv_backend in ("torch_dist", "tcp") and prefill.config.kv_layerwise
    prompts = mixed_prompts()
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    ref = LLM(tiny_llama, **ENGINE)
    want_greedy = ref.generate(prompts, greedy)
    want_seeded = ref.generate(prompts, seeded)

    async def run():
        return await asyncio.gather(
            *(disaggregated(prefill, decode, f"g{i}", p, greedy) for i, p in enumerate(prompts)),
            *(disaggregated(prefill, decode, f"s{i}", p, seeded) for i, p in enumerate(prompts)),
        )

    results = asyncio.run(run())
    got = [outs[-1] for _, outs in results]
    assert [o.token_ids for o in got[:16]] == [o.token_ids for o in want_greedy]
    assert [o.token_ids for o in got[16:]] == [o.token_ids for o in want_seeded]
    assert [o.text for o in got[:16]] == [o.text for o in want_greedy]
    for o, w in zip(got[:16], want_greedy, strict=True):
        torch.testing.assert_close(
            [lp.sampled.logprob for lp in o.logprobs],
            [lp.sampled.logprob for lp in w.logprobs],
            atol=1e-4,
            rtol=0,
        )
    # Streams carry every token exactly once, first token included.
    for _, outs in results:
        deltas = [t for out in outs for t in out.outputs[0].delta_token_ids]
        assert deltas == outs[-1].token_ids and outs[-1].finish_reason == "length"
    assert len(begun) == (32 if layerwise else 0)
    assert_pools_whole(prefill, decode)


@pytest.mark.parametrize("backend", ["torch_dist", "torch_dist-nccl", "tcp"])
def test_layerwise_transfer_of_chunked_prefills_equals_aggregated(tiny_llama, backend, monkeypatch):
    """A 48-token budget splits prompts over several passes and puts several requests in one
    pass: each is streamed during the pass that completes it, earlier chunks' layers included."""
    backend, _, mode = backend.partition("-")
    if mode == "nccl":
        emulate_nccl(monkeypatch)
    prefill, decode = start_workers(tiny_llama, backend, max_num_batched_tokens=48)
    try:
        begun = spy_begun(prefill)
        prompts = mixed_prompts(8, seed=5)
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        want = LLM(tiny_llama, **ENGINE).generate(prompts, params)

        async def run():
            return await asyncio.gather(
                *(disaggregated(prefill, decode, f"r{i}", p, params) for i, p in enumerate(prompts))
            )

        results = asyncio.run(run())
        assert [outs[-1].token_ids for _, outs in results] == [o.token_ids for o in want]
        assert sorted(begun) == sorted(f"r{i}" for i in range(8))
        assert max(len(p) for p in prompts) > 48  # some prompts took several passes
        assert_pools_whole(prefill, decode)
    finally:
        prefill.shutdown()
        decode.shutdown()


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_a_failed_staging_allocation_fails_one_request_and_the_workers_serve_the_next(
    tiny_llama, side, monkeypatch
):
    """torch_dist: the first staging allocation fails (out of memory) on one side. That
    request's transfer FAILS, retryable; the engine threads live on, the next request's
    tokens equal the aggregated engine's, and every block is back in its pool."""
    prefill, decode = start_workers(tiny_llama, "torch_dist", kv_transfer_timeout_s=2)
    sides = {"prefill": prefill.sender.sender(0), "decode": decode.receiver}  # rank 0 of one
    pool = sides[side]._staging
    allocate = pool._allocate
    calls = []

    def allocate_or_fail():
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return allocate()

    monkeypatch.setattr(pool, "_allocate", allocate_or_fail)
    prompts = mixed_prompts(2, seed=9)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = LLM(tiny_llama, **ENGINE).generate(prompts[1:], params)

    async def run():
        remote = await decode.reserve("first", prompts[0], params, kv_wait_s=30)
        result = await prefill.prefill("first", prompts[0], params, remote.reservation.kv_address)
        await remote.aclose()  # the router gives the reservation up and retries elsewhere
        return result, await disaggregated(prefill, decode, "next", prompts[1], params)

    try:
        failed, (done, outs) = asyncio.run(run())
        assert (failed.status, failed.retryable) == (TransferStatus.FAILED, True)
        assert done.status == TransferStatus.DONE and len(calls) == 2
        assert outs[-1].token_ids == want[0].token_ids
        wait_for(lambda: not decode.engine.scheduler.waiting_for_kv, 10, "the reservation released")
        assert_pools_whole(prefill, decode)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_prefix_cache_hits_on_the_prefill_side(workers, tiny_llama):
    prefill, decode = workers
    shared = torch.randint(3, 512, (160,), generator=torch.Generator().manual_seed(11)).tolist()
    prompts = [shared + tail for tail in ([9, 8, 7], [6, 5], [4, 3, 2, 1])]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = LLM(tiny_llama, **ENGINE, enable_prefix_caching=False).generate(prompts, params)

    async def run():
        return [
            await disaggregated(prefill, decode, f"r{i}", p, params) for i, p in enumerate(prompts)
        ]

    results = asyncio.run(run())
    assert [outs[-1].token_ids for _, outs in results] == [o.token_ids for o in want]
    # Blocks of the shared 160 tokens (20 full blocks of 8) were cached by the first request.
    assert [r.num_cached_tokens for r, _ in results] == [0, 160, 160]
    assert [outs[-1].num_cached_tokens for _, outs in results] == [0, 160, 160]
    assert_pools_whole(prefill, decode)


def test_stop_on_the_first_token_ends_on_decode(workers, tiny_llama):
    prefill, decode = workers
    prompt = mixed_prompts(1, seed=5)[0]
    ref = LLM(tiny_llama, **ENGINE).generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    first = ref[0].token_ids[0]
    params = SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[first])
    _, outs = asyncio.run(disaggregated(prefill, decode, "r", prompt, params))
    assert outs[-1].token_ids == [first]
    assert (outs[-1].finish_reason, outs[-1].outputs[0].stop_reason) == ("stop", first)
    assert_pools_whole(prefill, decode)


def test_kv_that_never_arrives_fails_retryable_and_frees(workers):
    _, decode = workers
    params = SamplingParams(max_tokens=4, temperature=0)

    async def run():
        remote = await decode.reserve("lost", list(range(3, 40)), params, kv_wait_s=0.2)
        assert decode.engine.kv.num_free_blocks < decode.engine.num_blocks
        with pytest.raises(KVTransferError, match="did not arrive"):
            await collect(remote)

    asyncio.run(run())
    assert decode.engine.kv.num_free_blocks == decode.engine.num_blocks


def test_abort_while_waiting_for_kv_frees_blocks(workers):
    _, decode = workers

    async def run():
        remote = await decode.reserve("gone", list(range(3, 60)), SamplingParams(max_tokens=4))
        assert decode.engine.scheduler.waiting_for_kv.keys() == {"gone"}
        await remote.aclose()
        await wait_for_async(
            lambda: not decode.engine.scheduler.waiting_for_kv, 10, "the abort to apply"
        )

    asyncio.run(run())
    assert decode.engine.kv.num_free_blocks == decode.engine.num_blocks


def test_no_capacity_is_refused_at_once(tiny_llama):
    decode = DecodeWorker(
        DecodeWorkerConfig(model=tiny_llama, kv_backend="local", **{**ENGINE, "num_kv_blocks": 8}),
        receiver_options={"hub": LocalHub(), "name": "d"},
    )
    params = SamplingParams(max_tokens=1)
    try:

        async def run():
            first = await decode.reserve("a", list(range(3, 43)), params)  # 5 of 8 blocks
            with pytest.raises(NoCapacityError, match="no room for 40 prompt tokens"):
                await decode.reserve("b", list(range(3, 43)), params)
            assert decode.engine.kv.num_free_blocks == 3
            await first.aclose()

        asyncio.run(run())
        wait_for(lambda: decode.engine.kv.num_free_blocks == 8, 10, "all 8 blocks free")
    finally:
        decode.shutdown()
