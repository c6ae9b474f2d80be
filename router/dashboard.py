"""`GET /v1/dashboard`: what the cluster dashboard (`/dashboard`, router/static/) shows, as
JSON from this router's own state, behind the API key like every data route.

In disaggregated mode: each prefill group and decode worker as the router's `WorkerPool` sees
it (health, load, KV-cache occupancy, the prefill workers' prefix-cache hit rate on the
prompts this router sent them), the queues, the recent KV transfers with their achieved
bandwidth and, once probed, their link's rate (`link_gbps`, None before). In aggregated mode: the one engine. Both: the live plots' series (router/live_window.py),
the expert load of a mixture of experts (`experts`: None for a dense model, and in
disaggregated mode until a worker reported one), and the planner's last decisions (`planner`: None while no planner reported any; a planner
reports them with `POST /v1/planner/decisions`, router/planner_log.py).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI

from duet.cluster.transfer_log import TransferLog
from duet.cluster.worker_pool import WorkerPool
from duet.router.planner_log import PlannerDecision, PlannerLog
from duet.router.serving_context import ServingContext
from duet.router.worker_metrics import sum_expert_load

NUM_RECENT_TRANSFERS = 25


def install_dashboard_routes(app: FastAPI, ctx: ServingContext) -> None:
    planner = PlannerLog()
    app.state.planner_log = planner

    @app.get("/v1/dashboard", include_in_schema=False)
    async def dashboard() -> dict[str, Any]:
        out = snapshot(ctx)
        out["planner"] = planner.snapshot()
        return out

    @app.post("/v1/planner/decisions", include_in_schema=False, status_code=204)
    async def planner_decision(decision: PlannerDecision) -> None:
        planner.add(decision)


def snapshot(ctx: ServingContext) -> dict[str, Any]:
    engine = ctx.engine
    pool: WorkerPool | None = getattr(engine, "pool", None)
    transfers: TransferLog | None = getattr(engine, "transfers", None)
    admission = ctx.admission
    stats = engine.stats
    out: dict[str, Any] = {
        "model": ctx.model_name,
        "mode": "disaggregated" if pool is not None else "aggregated",
        "time": time.time(),
        "queues": {
            "admitted": admission.num_in_flight,
            "admission_queued": admission.num_queued,
            "admission_capacity": admission.max_running,
            "engine_running": stats.num_running,
            "engine_waiting": stats.num_waiting,
        },
        "prefill": [],
        "decode": [],
        "transfers": [],
    }
    if pool is None or transfers is None:
        queries = stats.prefix_cache_queries
        out["decode"].append({
            "name": "engine", "state": "healthy" if engine.is_ready else "down",
            "num_running": stats.num_running, "num_waiting": stats.num_waiting,
            "num_waiting_for_kv": 0, "load": stats.num_running / max(1, engine.max_num_seqs),
            "kv_usage": stats.kv_usage,
            "prefix_hit_rate": stats.prefix_cache_hits / queries if queries else None,
        })  # fmt: skip
        out["experts"] = _experts(stats.moe_expert_tokens, stats.moe_expert_imbalance)
        out["series"] = ctx.metrics.window.series()
        return out
    for p in sorted(pool.prefill.values(), key=lambda s: s.name):
        out["prefill"].append({
            "name": p.name, "state": _state(p.healthy, p.failures),
            "queued_tokens": p.queued_tokens,
            "kv_usage": 1 - p.num_free_blocks / p.num_blocks if p.num_blocks else 0.0,
            "prefix_hit_rate": transfers.prefix_hit_rate(p.name),
            "num_cached_blocks": len(p.cached),
        })  # fmt: skip
    for d in sorted(pool.decode.values(), key=lambda s: s.name):
        out["decode"].append({
            "name": d.name, "state": _state(d.healthy, d.failures),
            "num_running": d.num_running, "num_waiting": d.num_waiting,
            "num_waiting_for_kv": d.num_waiting_for_kv, "load": d.load,
            "num_streams": d.client.num_streams,
            "kv_usage": 1 - d.num_free_blocks / d.num_blocks if d.num_blocks else 0.0,
            "prefix_hit_rate": None,
        })  # fmt: skip
    cluster = pool.stats()
    out["queues"]["prefill_queued_tokens"] = cluster.prefill_queued_tokens
    out["queues"]["decode_waiting_for_kv"] = sum(d.num_waiting_for_kv for d in pool.decode.values())
    out["queues"]["transfers_in_flight"] = transfers.num_in_flight
    recent = list(transfers.recent)
    out["transfers"] = [
        {
            "request_id": r.request_id, "prefill": r.prefill_worker, "decode": r.decode_worker,
            "status": r.status, "reason": r.reason, "bytes": r.num_bytes,
            "duration_ms": r.duration_s * 1000, "gbps": r.gbps, "finished_at": r.finished_at,
            "link_gbps": r.link_gbps or None,
        }
        for r in reversed(recent[-NUM_RECENT_TRANSFERS:])
    ]  # fmt: skip
    experts = sum_expert_load(pool.worker_stats.values())
    out["experts"] = _experts(*experts) if experts is not None else None
    out["series"] = ctx.metrics.window.series(transfers.history)
    return out


def _experts(tokens: list[int] | None, imbalance: float) -> dict[str, Any] | None:
    """A mixture of experts' load (None for a dense model): tokens routed to each expert since
    start, summed over MoE layers, and the last step's max/mean imbalance."""
    return None if tokens is None else {"tokens": tokens, "imbalance": imbalance}


def _state(healthy: bool, failures: int) -> str:
    if healthy:
        return "healthy"
    return "unhealthy" if failures else "starting"
