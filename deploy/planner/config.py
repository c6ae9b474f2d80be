"""The planner's configuration: one pool config per worker pool and one policy config.

Both are frozen dataclasses validated in `__post_init__`; a bad value raises
`PlannerConfigError` naming the field and the allowed range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


class PlannerConfigError(ValueError):
    """A planner setting is out of range; the message names the field."""


def _check(ok: bool, name: str, rule: str, value: object) -> None:
    if not ok:
        raise PlannerConfigError(f"{name}: must be {rule}; got {value!r}")


@dataclass(frozen=True)
class PoolConfig:
    """Bounds and sizes of one worker pool (one Deployment)."""

    name: str = "pool"
    """Name used in messages and logs (`prefill`, `decode`)."""
    min_replicas: int = 1
    """Fewest pods the planner keeps."""
    max_replicas: int = 4
    """Most pods the planner runs."""
    gpus_per_replica: int = 1
    """GPUs one pod holds (what it costs against the GPU budget)."""
    workers_per_replica: int = 1
    """duet workers one ready pod adds (prefill groups, or decode workers)."""
    pods_per_group: int = 1
    """Pods one worker group spans (a data-parallel group larger than a pod: its
    dataParallelSize / gpusPerPod): the pool grows and shrinks by whole groups, and its
    bounds must be multiples of it."""

    def __post_init__(self) -> None:
        n = self.name
        _check(self.min_replicas >= 0, f"{n}.min_replicas", ">= 0", self.min_replicas)
        _check(
            self.max_replicas >= max(1, self.min_replicas),
            f"{n}.max_replicas",
            f">= max(1, {n}.min_replicas={self.min_replicas})",
            self.max_replicas,
        )
        _check(self.gpus_per_replica >= 1, f"{n}.gpus_per_replica", ">= 1", self.gpus_per_replica)
        _check(
            self.workers_per_replica >= 1,
            f"{n}.workers_per_replica",
            ">= 1",
            self.workers_per_replica,
        )
        k = self.pods_per_group
        _check(k >= 1, f"{n}.pods_per_group", ">= 1", k)
        for bound in ("min_replicas", "max_replicas"):
            value = getattr(self, bound)
            _check(value % k == 0, f"{n}.{bound}", f"a multiple of {n}.pods_per_group ({k})", value)

    def clamp(self, replicas: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, replicas))


@dataclass(frozen=True)
class PlannerConfig:
    """SLO targets, capacities and damping of the scaling policy."""

    prefill: PoolConfig = field(default_factory=lambda: PoolConfig(name="prefill"))
    """The prefill pool."""
    decode: PoolConfig = field(default_factory=lambda: PoolConfig(name="decode"))
    """The decode pool."""
    gpu_budget: int = 8
    """GPUs both pools may hold together."""
    ttft_p90_target_s: float = 2.0
    """Time-to-first-token p90 the prefill pool is sized for."""
    tpot_p90_target_s: float = 0.1
    """Time-per-output-token (inter-token latency) p90 the decode pool is sized for."""
    prefill_queued_tokens_per_replica: float = 16384.0
    """Queued prompt tokens one prefill pod absorbs while meeting the TTFT target."""
    decode_occupancy_target: float = 0.75
    """Decode batch occupancy (running / capacity, 0..1) the decode pool is sized for."""
    hysteresis: float = 0.2
    """Relative band around each target inside which nothing changes (0.2: +-20%)."""
    scale_up_cooldown_s: float = 60.0
    """After a pool changes size, it does not grow again for this long."""
    scale_down_cooldown_s: float = 300.0
    """After a pool changes size, it does not shrink for this long."""
    scale_down_stabilization_s: float = 600.0
    """A pool shrinks only to the largest size recommended over this window."""
    max_scale_up_factor: float = 2.0
    """One step grows a pool to at most this many times its size (and at least +1)."""
    min_samples: int = 20
    """Latency percentiles from fewer observations than this are ignored as noise."""

    def __post_init__(self) -> None:
        _check(self.gpu_budget >= 1, "gpu_budget", ">= 1", self.gpu_budget)
        need = (
            self.prefill.min_replicas * self.prefill.gpus_per_replica
            + self.decode.min_replicas * self.decode.gpus_per_replica
        )
        _check(
            self.gpu_budget >= need,
            "gpu_budget",
            f">= the {need} GPUs the pools' min_replicas need",
            self.gpu_budget,
        )
        for name in ("ttft_p90_target_s", "tpot_p90_target_s", "prefill_queued_tokens_per_replica"):
            value = getattr(self, name)
            _check(math.isfinite(value) and value > 0, name, "> 0", value)
        _check(
            0 < self.decode_occupancy_target <= 1,
            "decode_occupancy_target",
            "in (0, 1]",
            self.decode_occupancy_target,
        )
        _check(0 <= self.hysteresis < 1, "hysteresis", "in [0, 1)", self.hysteresis)
        for name in ("scale_up_cooldown_s", "scale_down_cooldown_s", "scale_down_stabilization_s"):
            value = getattr(self, name)
            _check(math.isfinite(value) and value >= 0, name, ">= 0", value)
        _check(self.max_scale_up_factor > 1, "max_scale_up_factor", "> 1", self.max_scale_up_factor)
        _check(self.min_samples >= 1, "min_samples", ">= 1", self.min_samples)
