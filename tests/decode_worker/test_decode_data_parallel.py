"""Data-parallel decode workers (decode_worker/launch.py, engine/peer_lockstep.py): two decode
workers of a Qwen3-MoE, each its own process, server and KV receiver and half of the routed
experts, exchanging them as peers, behind the router's cluster engine with a prefill worker
(all experts) sending the KV over `tcp`. Every prompt's greedy tokens equal the aggregated
engine's (bf16: the exchange keeps one rank's bits), both workers decoded some of them, and
stopping one worker stops the other."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from benchmarks.gpu_check.processes import Child
from duet.engine import LLM, SamplingParams
from tests.net import free_port

PROMPTS = [[(7 * i + 3 * j) % 400 + 50 for j in range(5 + 3 * i)] for i in range(8)]
ENGINE = {"dtype": "bfloat16", "num_kv_blocks": 64, "load_progress": False, "num_threads": 1}


async def _through(model: str, prefill: str, decode: dict[str, str]) -> tuple[list, list]:
    from duet.cluster.config import ClusterConfig
    from duet.cluster.engine import ClusterEngine

    cluster = ClusterEngine(model, ClusterConfig(local_prefill_threshold=0, poll_interval_s=0.05))
    cluster.pool.set_workers({"prefill": prefill}, decode)
    await cluster.start()
    try:
        assert await cluster.pool.wait_until_ready(60)
        deadline = time.monotonic() + 60
        while not cluster.pool.healthy_prefill() or len(cluster.pool.healthy_decode()) < 2:
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


def test_two_data_parallel_decode_workers_give_the_aggregated_tokens(
    tiny_model_factory, tmp_path: Path
) -> None:
    model = tiny_model_factory("qwen3_moe")
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = [list(o.outputs[0].token_ids) for o in LLM(model, **ENGINE).generate(PROMPTS, greedy)]
    fields = {"model": model, "kv_backend": "tcp", **ENGINE}
    dp = {**fields, "data_parallel_size": 2, "expert_parallel_size": 2}
    group = f"tcp://127.0.0.1:{free_port()}"
    workers = {"prefill": Child(["-m", "duet.prefill_worker", "--config", json.dumps(fields),
                                 "--name", "prefill"], tmp_path / "prefill.log")}  # fmt: skip
    for r in range(2):
        workers[f"decode{r}"] = Child(
            ["-m", "duet.decode_worker", "--config", json.dumps(dp), "--name", f"decode{r}",
             "--dp-rank", str(r), "--dp-init-method", group],
            tmp_path / f"decode{r}.log",
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        where = {k: w.wait_for_line(r"DUET_READY (\S+)", deadline)[1] for k, w in workers.items()}
        decode = {k: v for k, v in where.items() if k != "prefill"}
        got, transfers = asyncio.run(_through(model, where["prefill"], decode))
        assert got == want
        served = {t.decode_worker for t in transfers if t.status == "done"}
        assert served == {"decode0", "decode1"}  # both decoded, each its own requests
        # one worker stopping stops its peer, whose process then exits by itself
        assert workers["decode1"].stop() == 0
        workers["decode0"].proc.wait(timeout=30)
        assert "decode0 stops with a data-parallel peer" in workers["decode0"].text()
    finally:
        codes = {k: w.stop() for k, w in workers.items()}
    assert codes["decode0"] == 0, workers["decode0"].tail()
