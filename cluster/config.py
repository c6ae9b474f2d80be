"""`ClusterConfig`: how the router runs requests on the worker pools (`duet serve
--disaggregated`'s cluster flags, cli/serve_cluster.py)."""

from __future__ import annotations

from dataclasses import dataclass

from duet.engine.config import SCHEDULING_POLICIES


@dataclass(frozen=True)
class ClusterConfig:
    """How the router runs requests on the worker pools."""

    local_prefill_threshold: int = 32
    """Prompts with at most this many uncached tokens prefill on their decode worker."""
    request_timeout_s: float = 600.0
    """Longest a request may take, retries included."""
    kv_wait_s: float = 90.0
    """How long a decode worker waits for a request's KV (must exceed the prefill lease)."""
    max_attempts: int = 4
    """Failed attempts per sample before it fails (waits for room on a full decode worker
    are not failures: the request timeout bounds them)."""
    prefill_with_reservation: bool = True
    """Start the prefill call beside the decode worker's reservation (its KV address from its
    load report; KV that lands first waits in its inbox) instead of after the reservation's
    answer: TTFT 0.75-0.94x beside running decodes, level alone (docs/benchmarks.md)."""
    max_num_seqs_per_decode_worker: int = 128
    """Admission capacity per decode worker (their `max_num_seqs`)."""
    num_decode_workers: int = 1
    """Decode workers expected (admission capacity before the first load reports)."""
    poll_interval_s: float = 0.5
    """How often each worker's load and health are polled."""
    scheduling_policy: str = "fcfs"
    """The workers' (their `EngineConfig.scheduling_policy`): with `priority`, a request's
    priority reaches the prefill and decode workers' schedulers; with fcfs it is refused."""

    def __post_init__(self) -> None:
        if self.local_prefill_threshold < 0:
            raise ValueError(
                f"--local-prefill-threshold: must be >= 0; got {self.local_prefill_threshold}"
            )
        if not self.request_timeout_s > self.kv_wait_s > 0:
            raise ValueError(
                f"--request-timeout ({self.request_timeout_s}) must exceed --kv-wait "
                f"({self.kv_wait_s}), which must be > 0"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"--scheduling-policy: must be one of {', '.join(SCHEDULING_POLICIES)}; "
                f"got {self.scheduling_policy!r}"
            )
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts: must be >= 1; got {self.max_attempts}")
