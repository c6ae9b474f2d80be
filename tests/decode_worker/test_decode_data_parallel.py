"""Data-parallel workers (decode_worker/launch.py, prefill_worker/launch.py,
engine/peer_lockstep.py): two decode workers (or two prefill workers) of a Qwen3-MoE, each its
own process and server with half of the routed experts, exchanging them as peers, behind the
router's cluster engine with one worker of the other kind holding every expert, the KV over
`tcp`. Every prompt's greedy tokens equal the aggregated engine's (bf16: the exchange keeps
one rank's bits), both data-parallel workers took some of the prompts, and stopping one stops
the other, whose process then exits by itself."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from benchmarks.gpu_check.processes import Child
from duet.engine import LLM, SamplingParams
from tests.net import free_port

PROMPTS = [[(7 * i + 3 * j) % 400 + 50 for j in range(5 + 3 * i)] for i in range(8)]
ENGINE = {"dtype": "bfloat16", "num_kv_blocks": 64, "load_progress": False, "num_threads": 1}


async def _through(model: str, prefill: dict[str, str], decode: dict[str, str]) -> tuple:
    from duet.cluster.config import ClusterConfig
    from duet.cluster.engine import ClusterEngine

    cluster = ClusterEngine(model, ClusterConfig(local_prefill_threshold=0, poll_interval_s=0.05))
    cluster.pool.set_workers(prefill, decode)
    await cluster.start()
    try:
        deadline = time.monotonic() + 60
        while len(cluster.pool.healthy_prefill()) < len(prefill) or len(
            cluster.pool.healthy_decode()
        ) < len(decode):
            assert time.monotonic() < deadline, "the router saw no healthy workers"
            await asyncio.sleep(0.05)
        greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

        async def run(prompt: list[int]) -> list[int]:
            last = None
            async for out in cluster.generate(prompt, greedy):
                last = out
            assert last is not None
            return list(last.outputs[0].token_ids)

        got = await asyncio.wait_for(asyncio.gather(*(run(p) for p in PROMPTS)), 120)
        return got, list(cluster.transfers.recent)
    finally:
        await cluster.stop()


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_two_data_parallel_workers_give_the_aggregated_tokens(
    tiny_model_factory, tmp_path: Path, kind: str
) -> None:
    model = tiny_model_factory("qwen3_moe")
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = [list(o.outputs[0].token_ids) for o in LLM(model, **ENGINE).generate(PROMPTS, greedy)]
    fields = {"model": model, "kv_backend": "tcp", **ENGINE}
    dp = {**fields, "data_parallel_size": 2, "expert_parallel_size": 2}
    group = f"tcp://127.0.0.1:{free_port()}"
    other = "prefill" if kind == "decode" else "decode"
    workers = {other: Child([ "-m", f"duet.{other}_worker", "--config", json.dumps(fields),
                              "--name", other], tmp_path / f"{other}.log")}  # fmt: skip
    for r in range(2):
        workers[f"{kind}{r}"] = Child(
            ["-m", f"duet.{kind}_worker", "--config", json.dumps(dp), "--name", f"{kind}{r}",
             "--dp-rank", str(r), "--dp-init-method", group],
            tmp_path / f"{kind}{r}.log",
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        where = {k: w.wait_for_line(r"DUET_READY (\S+)", deadline)[1] for k, w in workers.items()}
        prefill = {k: v for k, v in where.items() if k.startswith("prefill")}
        decode = {k: v for k, v in where.items() if k.startswith("decode")}
        got, transfers = asyncio.run(_through(model, prefill, decode))
        assert got == want
        done = [t for t in transfers if t.status == "done"]
        side = {t.decode_worker if kind == "decode" else t.prefill_worker for t in done}
        assert side == {f"{kind}0", f"{kind}1"}  # both took some, each its own requests
        assert workers[f"{kind}1"].stop() == 0
        workers[f"{kind}0"].proc.wait(timeout=30)  # stopped with its peer, by itself
        assert f"{kind}0 stops with a data-parallel peer" in workers[f"{kind}0"].text()
    finally:
        codes = {k: w.stop() for k, w in workers.items()}
    assert codes[f"{kind}0"] == 0, workers[f"{kind}0"].tail()
