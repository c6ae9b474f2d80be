"""Is anything else using the CPU? Benchmarks on a shared machine check, because one busy core
slows a 2-thread OpenMP matmul far more than by half (its threads wait for each other)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

IDLE_MAX_CORES = 0.15
IDLE_WINDOW_S = 5.0


@dataclass(frozen=True)
class CpuSnapshot:
    """CPU seconds so far: the measured system's own, the whole machine's busy time, and time
    the hypervisor stole. Differences over the timed call tell how much else was running."""

    own_s: float
    machine_busy_s: float
    steal_s: float

    @classmethod
    def take(cls, own_s: float) -> CpuSnapshot:
        # /proc/stat "cpu" line: user nice system idle iowait irq softirq steal ... (ticks)
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        user, nice, system, _, _, irq, softirq, steal = ticks
        hz = os.sysconf("SC_CLK_TCK")
        return cls(own_s, (user + nice + system + irq + softirq) / hz, steal / hz)

    def usage_since(self, start: CpuSnapshot, wall_s: float) -> dict[str, float]:
        """Average cores used over the window: by the system, by everything else, stolen."""
        own = self.own_s - start.own_s
        other = self.machine_busy_s - start.machine_busy_s - own
        return {
            "own_cores": own / wall_s,
            "other_cores": max(other, 0.0) / wall_s,
            "stolen_cores": (self.steal_s - start.steal_s) / wall_s,
        }


def wait_for_idle(timeout_s: float) -> float | None:
    """Block until the machine used under `IDLE_MAX_CORES` cores over one window, for at most
    `timeout_s`. Returns the busy cores of the last window when it gave up, else None."""
    deadline = time.monotonic() + timeout_s
    while True:
        start = CpuSnapshot.take(0.0)
        time.sleep(IDLE_WINDOW_S)
        busy = CpuSnapshot.take(0.0).usage_since(start, IDLE_WINDOW_S)["other_cores"]
        if busy < IDLE_MAX_CORES:
            return None
        if time.monotonic() >= deadline:
            return busy
