"""Run in a fresh process by test_engine_thread.py: build an AsyncEngine on the default model
one way or the other, stream one request, and print the engine thread's voluntary context
switches per step (JSON)."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import statistics
import sys

import torch

from duet.engine import SamplingParams
from duet.engine.async_engine import AsyncEngine
from duet.engine.config import EngineConfig
from duet.engine.core import EngineRole
from duet.engine.llm_engine import LLMEngine
from duet.engine.outputs import RequestOutput


class SwitchProbe(EngineRole):
    """Counts the engine thread's voluntary context switches inside each step."""

    def __init__(self) -> None:
        self.per_step: list[int] = []
        self._before = 0

    def before_step(self) -> None:
        self._before = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw

    def after_step(self, outputs: list[RequestOutput]) -> None:
        if outputs:  # a step that ran the model
            self.per_step.append(resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw - self._before)
        super().after_step(outputs)


async def stream(engine: AsyncEngine) -> None:
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    async for _ in engine.generate(list(range(200, 264)), params):
        pass


def main() -> None:
    mode = sys.argv[1]
    config = EngineConfig(dtype="float32", load_progress=False)
    probe = SwitchProbe()
    if mode == "built-on-engine-thread":
        engine = AsyncEngine(lambda: LLMEngine(config), probe)
    else:  # built here, on the main thread, then stepped on the engine thread
        engine = AsyncEngine(LLMEngine(config), probe)
    asyncio.run(stream(engine))
    threads = len(os.listdir("/proc/self/task"))  # OpenMP pools' workers included
    engine.shutdown()
    median = statistics.median(probe.per_step[5:])
    pool = torch.get_num_threads()
    print(json.dumps({"median_switches_per_step": median, "threads": threads, "pool": pool}))


if __name__ == "__main__":
    main()
