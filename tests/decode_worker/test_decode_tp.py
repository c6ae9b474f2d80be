"""Tensor-parallel decode workers through the disaggregated path (the router's ClusterEngine
over worker processes, gloo between each worker's ranks, KV over tcp): prefill TP -> decode TP
1->2, 2->1 and 2->4 (the tiny Llama's 2 KV heads replicated on 4 decode ranks) give the
aggregated engine's greedy tokens (fp32; argmax flips counted, none expected at this size),
every pool whole afterwards; a decode rank killed mid-stream fails its worker's requests over
to another decode worker with nothing lost or repeated."""

from __future__ import annotations

import asyncio
import signal

import pytest
import torch

from duet.cluster.config import ClusterConfig
from duet.cluster.engine import ClusterEngine
from duet.engine import LLM, SamplingParams
from tests.decode_worker.tp_groups import start_groups
from tests.waiting import wait_for_async

ENGINE = dict(dtype="float32", load_progress=False, block_size=8, num_kv_blocks=128)
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def prompts_of(lengths: list[int], seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


PROMPTS = prompts_of([3, 5, 40, 77, 120, 9, 60, 64, 2, 33, 90, 17, 100, 8, 55, 101])


@pytest.fixture(scope="module")
def want(tiny_llama):
    return [o.token_ids for o in LLM(tiny_llama, **ENGINE).generate(PROMPTS, GREEDY)]


async def cluster_engine(prefill: dict[str, str], decode: dict[str, str]) -> ClusterEngine:
    # threshold 0: every prompt is prefilled remotely, through the TP hand-off
    engine = ClusterEngine(None, ClusterConfig(local_prefill_threshold=0, poll_interval_s=0.05))
    engine.pool.set_workers(prefill, decode)
    await engine.start()
    assert await engine.pool.wait_until_ready(30)
    await wait_for_async(
        lambda: len(engine.pool.healthy_prefill()) == len(prefill), 30, "the prefill reports"
    )
    return engine


async def generate(engine: ClusterEngine, prompt: list[int], params: SamplingParams):
    outs = [out async for out in engine.generate(prompt, params)]
    return outs


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1), (2, 4)])
def test_prefill_tp_to_decode_tp_equals_aggregated(tiny_llama, want, prefill_tp, decode_tp):
    _check_tp_hand_off(tiny_llama, want, prefill_tp, decode_tp)


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "prefill_ep", "decode_ep"),
    [(1, 2, 1, 2), (2, 2, 2, 1)],
    ids=["tp1-to-tp2-ep2", "tp2-ep2-to-tp2"],
)
def test_mla_prefill_tp_to_decode_tp_equals_aggregated(
    tiny_model_factory, prefill_tp, decode_tp, prefill_ep, decode_ep
):
    """DeepSeek-V3 (multi-head latent attention): every rank of a group caches the whole latent
    entries (heads sharded), so prefill rank 0 alone ships them to each decode rank. Either
    side may shard its routed experts over its ranks (expert parallelism) or not: the KV it
    hands over is the same."""
    from tests.engine.test_deepseek import DEEPSEEK_SHAPES

    model = tiny_model_factory("deepseek_v3", **DEEPSEEK_SHAPES)
    want = [o.token_ids for o in LLM(model, **ENGINE).generate(PROMPTS, GREEDY)]
    _check_tp_hand_off(model, want, prefill_tp, decode_tp, (prefill_ep, decode_ep))


def _check_tp_hand_off(
    model: str,
    want: list[list[int]],
    prefill_tp: int,
    decode_tp: int,
    expert_parallel: tuple[int, int] = (1, 1),
) -> None:
    """PROMPTS through a prefill group of `prefill_tp` ranks and a decode worker of `decode_tp`
    (KV over tcp), their `expert_parallel_size`s `expert_parallel`: `want`'s tokens, streamed
    once each, every pool whole, every rank clean."""
    config = {"model": model, **ENGINE, "kv_backend": "tcp"}
    prefill_ep, decode_ep = expert_parallel
    groups = start_groups(
        ("prefill", {**config, "expert_parallel_size": prefill_ep}, prefill_tp, "p0"),
        ("decode", {**config, "expert_parallel_size": decode_ep}, decode_tp, "d0"),
    )
    try:

        async def main():
            engine = await cluster_engine({"p0": groups[0].address}, {"d0": groups[1].address})
            try:
                outs = await asyncio.gather(*(generate(engine, p, GREEDY) for p in PROMPTS))
                state = engine.pool.decode["d0"]
                await wait_for_async(
                    lambda: (
                        state.num_free_blocks == state.num_blocks > 0 and state.num_running == 0
                    ),
                    30,
                    "the decode pool whole",
                )
                return outs
            finally:
                await engine.stop()

        outs = asyncio.run(main())
    finally:
        for group in groups:
            group.stop()
    got = [o[-1].token_ids for o in outs]
    flips = sum(g != w for g, w in zip(got, want, strict=True))
    assert flips == 0, f"{flips} of {len(want)} prompts differ: {got} != {want}"
    for o, w in zip(outs, want, strict=True):
        assert [t for out in o for t in out.outputs[0].delta_token_ids] == w
    # every rank left cleanly: rank 0 on SIGTERM, the others on its Stop
    assert [[p.returncode for p in g.procs] for g in groups] == [[0] * prefill_tp, [0] * decode_tp]


def test_a_decode_rank_killed_mid_stream_fails_over_with_nothing_lost(tiny_llama):
    """Every request streams from a TP=2 decode worker; once each has 4 tokens a second decode
    worker joins and rank 1 of the first is killed (SIGKILL): rank 0's next collective breaks,
    its streams end retryable, and the router continues each request on the second worker
    from the tokens streamed so far: the aggregated engine's tokens, none repeated or lost.
    Rank 0's process then exits 1 by itself."""
    config = {"model": tiny_llama, **ENGINE, "kv_backend": "tcp"}
    prompts = prompts_of([40, 70, 12, 90], seed=8)
    params = SamplingParams(max_tokens=150, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in LLM(tiny_llama, **ENGINE).generate(prompts, params)]
    groups = start_groups(
        ("prefill", config, 1, "p0"), ("decode", config, 2, "d0"), ("decode", config, 1, "d1")
    )
    try:
        victim = groups[1].procs[1]

        async def main():
            engine = await cluster_engine({"p0": groups[0].address}, {"d0": groups[1].address})
            outs: list[list] = [[] for _ in prompts]
            started = asyncio.Event()
            at_kill: list[int] = []

            async def drain(i):
                async for out in engine.generate(prompts[i], params):
                    outs[i].append(out)
                    if all(o and len(o[-1].token_ids) >= 4 for o in outs):
                        started.set()

            async def kill_rank_1():
                await asyncio.wait_for(started.wait(), 60)
                engine.pool.set_workers(
                    {"p0": groups[0].address}, {"d0": groups[1].address, "d1": groups[2].address}
                )
                await wait_for_async(
                    lambda: len(engine.pool.healthy_decode()) == 2, 30, "the second decode worker"
                )
                victim.send_signal(signal.SIGKILL)
                at_kill.extend(len(o[-1].token_ids) for o in outs)

            try:
                await asyncio.gather(kill_rank_1(), *(drain(i) for i in range(len(prompts))))
                return outs, at_kill
            finally:
                await engine.stop()

        outs, at_kill = asyncio.run(main())
        # rank 0 of the broken worker stops serving by itself and exits 1 (its engine failed)
        assert groups[1].procs[0].wait(30) == 1
    finally:
        for group in groups:
            group.stop()
    assert victim.returncode == -signal.SIGKILL
    assert min(at_kill) < 150, at_kill  # a request was still streaming from the lost worker
    for got, w in zip(outs, want, strict=True):
        assert got[-1].token_ids == w
        assert [t for out in got for t in out.outputs[0].delta_token_ids] == w  # none repeated
