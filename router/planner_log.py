"""`PlannerLog`: the scaling decisions a planner (deploy/planner) reported to this router, for
the dashboard. The planner runs beside the cluster, not in the router: after each control
step it POSTs its decision to every router it scraped (`/v1/planner/decisions`, behind the
API key like /metrics). Bounded: the newest `num_decisions` only."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

POOLS = ("prefill", "decode")


class PlannerDecision(BaseModel):
    """One control step of the planner (deploy/planner/controller.py `DecisionRecord`)."""

    model_config = ConfigDict(extra="forbid")

    time: float = Field(description="When the planner decided (seconds since the epoch).")
    current: dict[str, int] = Field(description="Replicas per pool before the step.")
    sizes: dict[str, int] = Field(description="Replicas per pool it decided on.")
    reasons: dict[str, str] = Field(default_factory=dict, description="Why, per pool.")
    dry_run: bool = Field(default=False, description="Logged only, not applied.")

    @field_validator("current", "sizes")
    @classmethod
    def _pools(cls, value: dict[str, int]) -> dict[str, int]:
        for pool, n in value.items():
            if pool not in POOLS:
                raise ValueError(f"unknown pool {pool!r}; pools are {', '.join(POOLS)}")
            if n < 0:
                raise ValueError(f"{pool}: replicas must be >= 0; got {n}")
        return value


class PlannerLog:
    """Event-loop thread only."""

    def __init__(self, num_decisions: int = 20) -> None:
        self.decisions: deque[PlannerDecision] = deque(maxlen=num_decisions)
        self.last_report_s: float | None = None  # wall clock

    def add(self, decision: PlannerDecision) -> None:
        self.decisions.append(decision)
        self.last_report_s = time.time()

    def snapshot(self) -> dict[str, Any] | None:
        """The dashboard's view, newest first; None while no planner has reported."""
        if self.last_report_s is None:
            return None
        return {
            "last_report": self.last_report_s,
            "decisions": [
                {
                    **d.model_dump(),
                    "changed": [p for p in POOLS if d.sizes.get(p) != d.current.get(p)],
                }
                for d in reversed(self.decisions)
            ],
        }
