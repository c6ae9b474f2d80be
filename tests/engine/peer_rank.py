"""One of two data-parallel peers (engine/peer_lockstep.py), run as a script by
test_peer_lockstep.py: python peer_rank.py MODEL RANK PORT OUT SCENARIO.

Joins the two ranks' group (`init_data_parallel` over a TCPStore on PORT, rank 0 its host),
builds its own `AsyncEngine` (Qwen3-MoE, bf16, half the experts each) stepping with the other,
and per SCENARIO:
- `serve`: generates its own prompts (`PROMPTS[rank]`, all at once: rank 0 three long ones,
  rank 1 one short one, so rank 1 idles while rank 0 works), waits until the other has
  finished too, saves the token ids to OUT and shuts down;
- `stop`: rank 1 shuts its engine down while rank 0 streams a long request; rank 0 saves what
  its stream raised and whether its engine is still running;
- `kill`: the same, but rank 1's process is killed (SIGKILL: no goodbye to its peer)."""

from __future__ import annotations

import asyncio
import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from duet.engine import SamplingParams
from duet.engine.async_engine import AsyncEngine
from duet.engine.config import EngineConfig
from duet.engine.llm_engine import LLMEngine
from duet.engine.peer_lockstep import PeerLockstep
from duet.engine.tp_group import exit_rank, init_data_parallel

PROMPTS = [
    [[5, 17, 99, 200, 3], [42, 7, 7, 1, 300, 12, 9], [250, 251]],
    [[11, 12]],
]
NEW_TOKENS = [[24, 16, 20], [4]]


def config(model: str) -> EngineConfig:
    """Each peer's engine: the two ranks' layout, one thread each (two cores)."""
    return EngineConfig.from_kwargs(
        model=model, dtype="bfloat16", data_parallel_size=2, expert_parallel_size=2,
        num_threads=1, num_kv_blocks=64, load_progress=False,
    )  # fmt: skip


async def serve(engine: AsyncEngine, rank: int) -> list[list[int]]:
    async def one(prompt: list[int], n: int) -> list[int]:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        final = None
        async for out in engine.generate(prompt, params):
            final = out
        assert final is not None
        return list(final.outputs[0].token_ids)

    return list(
        await asyncio.gather(
            *(one(p, n) for p, n in zip(PROMPTS[rank], NEW_TOKENS[rank], strict=True))
        )
    )


async def stopped(engine: AsyncEngine) -> str:
    params = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)
    try:
        async for _ in engine.generate([5, 6, 7], params):
            pass
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "finished"


def main() -> int:
    model, rank, port, out, scenario = sys.argv[1:6]
    rank = int(rank)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.TCPStore("127.0.0.1", int(port), 2, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=60))  # fmt: skip
    tp, control = init_data_parallel(rank, 2, torch.device("cpu"), store, 60.0)
    assert tp.exchange is not None
    peers = PeerLockstep(rank, 2, control, tp.exchange.local)
    cfg = config(model)
    engine = AsyncEngine(lambda: LLMEngine(cfg, tp), name=f"peer{rank}", tp=tp, peers=peers)
    result: dict = {"shared memory": tp.exchange.local is not None}
    if scenario == "serve":
        result["tokens"] = asyncio.run(serve(engine, rank))
        store.set(f"done{rank}", "1")
        store.wait([f"done{1 - rank}"])  # both finished: then both stop
        engine.core.shutdown(30.0)
    elif rank == 1:
        store.wait(["streaming"])
        if scenario == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        engine.core.shutdown(30.0)
    else:

        async def run() -> str:
            task = asyncio.create_task(stopped(engine))
            await asyncio.sleep(1.0)
            store.set("streaming", "1")
            return await task

        start = time.monotonic()
        result["error"] = asyncio.run(run())
        result["seconds"] = time.monotonic() - start
        result["running"] = engine.core.is_running
    torch.save(result, out)
    return 0


if __name__ == "__main__":
    exit_rank(main())
