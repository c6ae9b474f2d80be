"""The engine thread is the only thread in a serving process that runs torch's CPU kernels.

Root cause of the serving path's slow steps (issue 17): torch's CPU ops run on GNU OpenMP,
which keeps a pool of worker threads for every thread that ever ran a parallel region. An
engine loaded on the main thread and stepped on the engine thread leaves two pools; with more
pool threads than cores, libgomp throttles its spin-waiting, so the workers sleep between
parallel regions and every region pays for futex wake-ups: the engine thread switches out
dozens of times per step (~100 for SmolLM2 on 2 cores) instead of almost never, and decode
steps took 28 -> 37 ms (fp32) and 19.6 -> 29 ms (bf16) on a 2-core EPYC. Each case runs in a
fresh process: pytest's own thread has run parallel regions already.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = Path(__file__).with_name("openmp_probe.py")
ROOT = Path(__file__).resolve().parents[2]


def _probe(mode: str) -> dict:
    proc = subprocess.run(
        [sys.executable, str(PROBE), mode],
        cwd=ROOT,
        # a pool of a thread per core, as in a server (the suite's workers get fewer)
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(os.cpu_count() or 1)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_engine_built_on_its_thread_steps_without_sleeping():
    # The mechanism is real here: an engine built on another thread makes its thread sleep
    # within steps (this is what a server did before the fix).
    two = _probe("built-on-main-thread")
    # Built where it runs (AsyncEngine.from_config, the workers): the only pool spins.
    one = _probe("built-on-engine-thread")
    # The structure, exactly: a second pool is (pool size - 1) more worker threads.
    assert two["threads"] == one["threads"] + one["pool"] - 1, (two, one)
    # The symptom. The one-pool count is not zero: a step hands its outputs to the event loop,
    # and the GIL handoff with the loop's thread is a voluntary switch or two, more on a busy
    # machine. Seen: 0 against 91 here, 4 against 109 and 4 against 35 in loaded runs.
    two_pools, one_pool = two["median_switches_per_step"], one["median_switches_per_step"]
    assert two_pools >= 10 and one_pool * 4 <= two_pools, (two_pools, one_pool)
