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
import signal
import time
from pathlib import Path

import pytest

from benchmarks.gpu_check.processes import Child
from duet.engine import LLM, SamplingParams
from tests.net import free_port
from tests.waiting import wait_for_async

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


def _group(kind: str, config: dict, name: str, tmp_path: Path) -> dict[str, Child]:
    """A data-parallel group of two `kind` workers, `{name}0` and `{name}1`, as processes
    meeting on loopback."""
    group = f"tcp://127.0.0.1:{free_port()}"
    workers = {}
    for r in range(2):
        args = ["-m", f"duet.{kind}_worker", "--config", json.dumps(config),
                "--name", f"{name}{r}", "--dp-rank", str(r), "--dp-init-method", group]  # fmt: skip
        workers[f"{name}{r}"] = Child(args, tmp_path / f"{name}{r}.log")
    return workers


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_two_data_parallel_workers_give_the_aggregated_tokens(
    tiny_model_factory, tmp_path: Path, kind: str
) -> None:
    model = tiny_model_factory("qwen3_moe")
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = [list(o.outputs[0].token_ids) for o in LLM(model, **ENGINE).generate(PROMPTS, greedy)]
    fields = {"model": model, "kv_backend": "tcp", **ENGINE}
    dp = {**fields, "data_parallel_size": 2, "expert_parallel_size": 2}
    other = "prefill" if kind == "decode" else "decode"
    workers = {other: Child([ "-m", f"duet.{other}_worker", "--config", json.dumps(fields),
                              "--name", other], tmp_path / f"{other}.log")}  # fmt: skip
    workers.update(_group(kind, dp, kind, tmp_path))
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


def test_a_data_parallel_worker_killed_mid_stream_fails_its_group_over(
    tiny_model_factory, tmp_path
):
    """Streams on both workers of a data-parallel decode group; once each has 4 tokens a plain
    decode worker (every expert) joins and one of the group is killed (SIGKILL). Its peer's
    next exchange fails, its engine dies and its process exits by itself; the router continues
    every request of both on the plain worker from the tokens streamed so far: the aggregated
    engine's tokens (bf16), none repeated or lost. The survivor exits 1 (its engine failed),
    not 0 as after a peer's orderly stop."""
    from duet.cluster.config import ClusterConfig
    from duet.cluster.engine import ClusterEngine

    model = tiny_model_factory("qwen3_moe")
    params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    prompts = PROMPTS[:4]
    want = [list(o.outputs[0].token_ids) for o in LLM(model, **ENGINE).generate(prompts, params)]
    fields = {"model": model, "kv_backend": "tcp", **ENGINE}
    dp = {**fields, "data_parallel_size": 2, "expert_parallel_size": 2}
    workers = {
        name: Child(["-m", f"duet.{kind}_worker", "--config", json.dumps(fields), "--name", name],
                    tmp_path / f"{name}.log")
        for name, kind in (("prefill", "prefill"), ("full", "decode"))
    }  # fmt: skip
    workers.update(_group("decode", dp, "dp", tmp_path))
    try:
        deadline = time.monotonic() + 180
        where = {k: w.wait_for_line(r"DUET_READY (\S+)", deadline)[1] for k, w in workers.items()}

        async def main() -> tuple[list[list], list[int]]:
            cluster = ClusterEngine(
                model, ClusterConfig(local_prefill_threshold=0, poll_interval_s=0.05)
            )
            group_only = {k: where[k] for k in ("dp0", "dp1")}
            cluster.pool.set_workers({"prefill": where["prefill"]}, group_only)
            await cluster.start()
            await wait_for_async(
                lambda: len(cluster.pool.healthy_decode()) == 2
                and len(cluster.pool.healthy_prefill()) == 1,
                60, "the router to see the workers",
            )  # fmt: skip
            outs: list[list] = [[] for _ in prompts]
            started = asyncio.Event()
            at_kill: list[int] = []

            async def drain(i: int) -> None:
                async for out in cluster.generate(prompts[i], params):
                    outs[i].append(out)
                    if all(o and len(o[-1].outputs[0].token_ids) >= 4 for o in outs):
                        started.set()

            async def kill_one() -> None:
                await asyncio.wait_for(started.wait(), 60)
                cluster.pool.set_workers(
                    {"prefill": where["prefill"]}, {**group_only, "full": where["full"]}
                )
                await wait_for_async(
                    lambda: len(cluster.pool.healthy_decode()) == 3, 30, "the plain worker"
                )
                workers["dp1"].proc.send_signal(signal.SIGKILL)
                at_kill.extend(len(o[-1].outputs[0].token_ids) for o in outs)

            try:
                deadline_s = 150
                drains = (drain(i) for i in range(len(prompts)))
                await asyncio.wait_for(asyncio.gather(kill_one(), *drains), deadline_s)
                return outs, at_kill
            finally:
                await cluster.stop()

        outs, at_kill = asyncio.run(main())
        assert workers["dp0"].proc.wait(timeout=30) == 1  # its peer gone: failed, it exits
        assert "rank 1 (pid " in workers["dp0"].text()  # "... is gone", the shared segment says
    finally:
        codes = {k: w.stop() for k, w in workers.items()}
    assert codes["dp1"] == -signal.SIGKILL
    assert min(at_kill) < 120, at_kill  # requests were still streaming from the group
    for got, w in zip(outs, want, strict=True):
        assert list(got[-1].outputs[0].token_ids) == w
        assert [t for out in got for t in out.outputs[0].delta_token_ids] == w  # none repeated
