"""The scaling policy: load signals and current pool sizes in, new pool sizes out.

Per pool, a raw recommendation comes from load (queued prefill tokens per pod; decode batch
occupancy against its target) and from the latency SLO (TTFT p90 for prefill, TPOT p90 for
decode). Then, in order:

- hysteresis: a signal inside `target x (1 +- hysteresis)` changes nothing;
- scale up fast: an SLO miss grows the pool in proportion to the miss (at most
  `max_scale_up_factor`, at least +1), unless pods from the last scale-up have not joined yet;
- scale down slow: one pod at a time, only when latency is comfortably under target and
  the load fits in one pod fewer, and only to the largest size recommended over the
  stabilization window (so noisy metrics never make a pool flap);
- cooldowns: after a pool changes, it does not grow again for `scale_up_cooldown_s` nor
  shrink for `scale_down_cooldown_s`;
- min/max per pool, then the shared GPU budget: shrinking is always allowed, growth is
  granted one pod at a time to the pool whose SLO is missed worst while GPUs remain;
- a pool whose worker groups span several pods (`pods_per_group` k: a data-parallel group
  larger than a pod) moves in whole groups: growth rounds up to a multiple of k, shrinking
  steps k pods, and the budget grants and takes k pods at a time.

`ScalingPolicy` keeps the state (history, last changes) and is not thread-safe: one
controller loop calls `decide`.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from duet.deploy.planner.config import PlannerConfig, PoolConfig
from duet.deploy.planner.metrics import LoadSignals

POOLS = ("prefill", "decode")


@dataclass(frozen=True)
class PoolSizes:
    prefill: int
    decode: int

    def get(self, pool: str) -> int:
        return int(getattr(self, pool))


@dataclass(frozen=True)
class Decision:
    """New sizes and, per pool, why (for the log)."""

    sizes: PoolSizes
    reasons: dict[str, str]

    def changed(self, current: PoolSizes) -> list[str]:
        return [pool for pool in POOLS if self.sizes.get(pool) != current.get(pool)]


@dataclass
class _PoolState:
    history: deque[tuple[float, int]] = field(default_factory=deque)
    last_change_s: float | None = None


@dataclass(frozen=True)
class _Recommendation:
    replicas: int
    pressure: float  # how far over target the pool runs (1.0 = on target)
    reason: str


class ScalingPolicy:
    def __init__(self, config: PlannerConfig) -> None:
        self.config = config
        self._state = {pool: _PoolState() for pool in POOLS}

    def pool(self, name: str) -> PoolConfig:
        return self.config.prefill if name == "prefill" else self.config.decode

    def decide(self, signals: LoadSignals | None, current: PoolSizes, now_s: float) -> Decision:
        """New pool sizes for `current` given this interval's `signals` (None: metrics are
        unavailable, so only min/max and the budget are enforced)."""
        recs: dict[str, _Recommendation] = {}
        for name in POOLS:
            cur = current.get(name)
            if signals is None:
                rec = _Recommendation(cur, 1.0, "no metrics: hold")
            elif name == "prefill":
                rec = self._prefill(signals, cur)
            else:
                rec = self._decode(signals, cur)
            ready = None
            if signals is not None:
                ready = (
                    signals.num_prefill_workers if name == "prefill" else signals.num_decode_workers
                )
            recs[name] = self._damp(name, rec, cur, ready, now_s)
        sizes, reasons = self._fit_budget(recs, current)
        for name in POOLS:
            if sizes[name] != current.get(name):
                self._state[name].last_change_s = now_s
        return Decision(PoolSizes(**sizes), reasons)

    # -- raw recommendations -------------------------------------------------------------

    def _slo_ratio(self, p90_s: float | None, num_samples: int, target_s: float) -> float | None:
        if p90_s is None or num_samples < self.config.min_samples:
            return None
        return p90_s / target_s

    def _grow(self, cur: int, ratio: float) -> int:
        factor = min(ratio, self.config.max_scale_up_factor)
        return max(cur + 1, math.ceil(cur * factor))

    def _prefill(self, s: LoadSignals, cur: int) -> _Recommendation:
        cfg, h = self.config, self.config.hysteresis
        per_pod = cfg.prefill_queued_tokens_per_replica
        slo = self._slo_ratio(s.ttft_p90_s, s.num_ttft_samples, cfg.ttft_p90_target_s)
        queue = s.prefill_queued_tokens / (per_pod * max(cur, 1))
        pressure = max(slo or 0.0, queue)
        ttft = f"TTFT p90 {s.ttft_p90_s:.3f}s" if slo is not None else "TTFT p90 n/a"
        if slo is not None and slo > 1 + h:
            return _Recommendation(
                self._grow(cur, slo), pressure, f"{ttft} > target {cfg.ttft_p90_target_s}s"
            )
        if s.prefill_queued_tokens > per_pod * cur * (1 + h):
            need = math.ceil(s.prefill_queued_tokens / per_pod)
            return _Recommendation(
                max(cur + 1, need), pressure, f"{s.prefill_queued_tokens:.0f} queued tokens"
            )
        if cur > 0 and (slo is None or slo < 1 - h):
            # The fewest pods whose queue share stays under the band's lower edge.
            need = math.floor(s.prefill_queued_tokens / (per_pod * (1 - h))) + 1
            if s.prefill_queued_tokens == 0:
                need = 0
            if need < cur:
                return _Recommendation(need, pressure, f"{ttft}, queue fits {need} pod(s)")
        return _Recommendation(cur, pressure, f"{ttft}, within band")

    def _decode(self, s: LoadSignals, cur: int) -> _Recommendation:
        cfg, h = self.config, self.config.hysteresis
        target = cfg.decode_occupancy_target
        slo = self._slo_ratio(s.tpot_p90_s, s.num_tpot_samples, cfg.tpot_p90_target_s)
        occupancy = s.decode_batch_occupancy
        pressure = max(slo or 0.0, occupancy / target)
        tpot = f"TPOT p90 {s.tpot_p90_s:.3f}s" if slo is not None else "TPOT p90 n/a"
        if slo is not None and slo > 1 + h:
            return _Recommendation(
                self._grow(cur, slo), pressure, f"{tpot} > target {cfg.tpot_p90_target_s}s"
            )
        if occupancy > target * (1 + h) or (cur == 0 and s.num_requests_waiting > 0):
            need = math.ceil(max(cur, 1) * occupancy / target)
            return _Recommendation(
                max(cur + 1, need), pressure, f"occupancy {occupancy:.2f} > {target}"
            )
        if cur > 0 and (slo is None or slo < 1 - h):
            # The fewest pods that keep occupancy under the band's lower edge once the running
            # sequences spread over them.
            need = math.floor(occupancy * cur / (target * (1 - h))) + 1
            if occupancy == 0 and s.num_requests_waiting == 0:
                need = 0
            if need < cur:
                return _Recommendation(
                    need, pressure, f"{tpot}, occupancy {occupancy:.2f} fits {need} pod(s)"
                )
        return _Recommendation(cur, pressure, f"{tpot}, occupancy {occupancy:.2f}, within band")

    # -- damping: pending pods, stabilization, cooldowns, bounds -------------------------

    def _damp(
        self, name: str, rec: _Recommendation, cur: int, ready: int | None, now_s: float
    ) -> _Recommendation:
        cfg, pool, state = self.config, self.pool(name), self._state[name]
        if not state.history:
            # NOTE: the current size counts as recommended at start, so a freshly started
            # planner waits a full stabilization window before it shrinks anything.
            state.history.append((now_s, cur))
        state.history.append((now_s, rec.replicas))
        window_start = now_s - cfg.scale_down_stabilization_s
        while len(state.history) > 1 and state.history[0][0] < window_start:
            state.history.popleft()
        since_change = math.inf if state.last_change_s is None else now_s - state.last_change_s
        want, reason = rec.replicas, rec.reason
        expected = cur * pool.workers_per_replica
        k = pool.pods_per_group
        if want > cur and since_change < cfg.scale_up_cooldown_s:
            want, reason = cur, f"{reason}; up held: cooldown"
        elif want > cur and ready is not None and ready < expected:
            # Pods of the last scale-up have not joined yet: they take minutes and GPUs, and
            # asking for more before they serve would overshoot.
            want, reason = cur, f"{reason}; up held: {ready} of {expected} workers joined"
        elif want < cur:
            stable = _whole_groups(max(r for _, r in state.history), k)
            if since_change < cfg.scale_down_cooldown_s:
                want, reason = cur, f"{reason}; down held: cooldown"
            elif stable >= cur:
                want, reason = cur, f"{reason}; down held: stabilizing"
            else:
                # Slow: one pod (group) per cooldown, never below what the window recommended
                # (down to whole groups from a size set by hand that is not).
                want = max(stable, (cur - 1) // k * k)
        if want > cur:
            want = _whole_groups(want, k)
        bounded = pool.clamp(want)
        if bounded != want:
            reason = f"{reason}; bounded to [{pool.min_replicas}, {pool.max_replicas}]"
        return _Recommendation(bounded, rec.pressure, reason)

    # -- the shared GPU budget ------------------------------------------------------------

    def _fit_budget(
        self, recs: dict[str, _Recommendation], current: PoolSizes
    ) -> tuple[dict[str, int], dict[str, str]]:
        step = {name: self.pool(name).pods_per_group for name in POOLS}  # pods a pool moves by
        step_gpus = {name: self.pool(name).gpus_per_replica * step[name] for name in POOLS}
        budget = self.config.gpu_budget
        want = {name: recs[name].replicas for name in POOLS}
        reasons = {name: recs[name].reason for name in POOLS}

        def total(sizes: dict[str, int]) -> int:
            return sum(sizes[n] * self.pool(n).gpus_per_replica for n in POOLS)

        if total(want) <= budget:
            return want, reasons
        sizes = {
            name: max(self.pool(name).min_replicas, min(want[name], current.get(name)))
            for name in POOLS
        }
        # Over budget even without growth (the budget was lowered, or someone scaled by
        # hand): shrink the pool under less pressure first.
        by_least_pressure = sorted(POOLS, key=lambda n: recs[n].pressure)
        shrunk: set[str] = set()
        while total(sizes) > budget:
            shrinkable = [
                n for n in by_least_pressure if sizes[n] - step[n] >= self.pool(n).min_replicas
            ]
            if not shrinkable:
                break  # unreachable: PlannerConfig checks the minimums fit the budget
            sizes[shrinkable[0]] -= step[shrinkable[0]]
            shrunk.add(shrinkable[0])
        for name in shrunk:
            reasons[name] += f"; shrunk to fit {budget} GPUs"
        while True:
            growable = [
                n for n in POOLS if sizes[n] < want[n] and total(sizes) + step_gpus[n] <= budget
            ]
            if not growable:
                break
            grown = max(growable, key=lambda n: recs[n].pressure)
            sizes[grown] += step[grown]
        for name in POOLS:
            if sizes[name] < want[name] and name not in shrunk:
                reasons[name] += f"; capped at {sizes[name]} by the {budget}-GPU budget"
        return sizes, reasons


def _whole_groups(replicas: int, pods_per_group: int) -> int:
    """`replicas` rounded up to whole worker groups of `pods_per_group` pods."""
    return math.ceil(replicas / pods_per_group) * pods_per_group
