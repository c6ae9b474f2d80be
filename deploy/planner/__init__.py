"""duet's Kubernetes planner: sizes the prefill and decode pools to meet TTFT/TPOT SLOs
within a GPU budget, by patching the pool Deployments' scale subresources.

- `metrics`: router /metrics text -> histograms and gauges -> per-interval `LoadSignals`
- `policy`: `ScalingPolicy.decide(signals, current sizes, now)` -> `Decision`
- `kube`: the Kubernetes calls (scale get/patch, EndpointSlice list)
- `controller`: the loop, the scraper, /healthz; `cli`: `duet-planner`
"""

from __future__ import annotations

from duet.deploy.planner.config import PlannerConfig, PlannerConfigError, PoolConfig
from duet.deploy.planner.metrics import Histogram, LoadSignals, interval_signals, parse_scrape
from duet.deploy.planner.policy import Decision, PoolSizes, ScalingPolicy

__all__ = [
    "Decision",
    "Histogram",
    "LoadSignals",
    "PlannerConfig",
    "PlannerConfigError",
    "PoolConfig",
    "PoolSizes",
    "ScalingPolicy",
    "interval_signals",
    "parse_scrape",
]
