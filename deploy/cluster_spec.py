"""`ClusterSpec`: what a `DuetCluster` (deploy/ray_cluster.py) runs: the model and engine
settings every worker shares, how many prefill groups and decode workers of which layouts
(tensor, pipeline and expert parallel), the routers, and how KV moves. Built by `duet serve
--disaggregated` from its flags (cli/serve_cluster.py); importing it starts no Ray."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from duet.cluster.config import ClusterConfig
from duet.engine.spec_decode.config import SpeculativeConfig
from duet.router.server import RouterConfig
from duet.telemetry.otel import OTLP_ENDPOINT_ENV


@dataclass(frozen=True)
class ClusterSpec:
    """What to run. Counts of None mean "auto": follow the cluster's resources."""

    model: str | None = None
    engine: dict[str, Any] = field(default_factory=dict)
    """EngineConfig fields every worker shares (dtype, block_size, max_num_seqs, ...)."""
    prefill_workers: int | None = 1
    prefill_tp: int = 1
    prefill_pp: int = 1
    """Pipeline stages per prefill group (each of `prefill_tp` ranks): the engine's
    `pipeline_parallel_size`. Decode workers run one stage."""
    decode_workers: int | None = 1
    decode_tp: int = 1
    """Ranks per decode worker (tensor parallelism)."""
    prefill_ep: int = 1
    """Ranks a prefill group shards a mixture's routed experts over, whole: 1 or `prefill_tp`
    (the engine's `expert_parallel_size`)."""
    decode_ep: int = 1
    """The same for a decode worker: 1 or `decode_tp`. Independent of `prefill_ep`: the KV a
    group hands over does not depend on how its experts are placed."""
    prefill_dp: int = 1
    """A mixture of experts: whole prefill workers per group (each its own server and
    requests, at TP 1) holding 1/D of the routed experts and exchanging them, stepping
    together (data-parallel attention: engine/peer_lockstep.py); 1: none."""
    decode_dp: int = 1
    """The same for decode workers."""
    routers: int = 1
    router: RouterConfig = field(default_factory=RouterConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    served_model_name: str | list[str] | None = None
    """The id(s) clients send (the first is the one responses carry); None: the model's."""
    gpus_per_worker: float = 0.0
    """GPUs per prefill rank and per decode worker (1 on GPU clusters)."""
    kv_backend: str = "auto"
    """How KV moves from prefill to decode workers (prefill_worker/config.py)."""
    kv_staging_bytes: int | None = None
    """The workers' staging pool (kv_transfer/worker_config.py); None: its default."""

    def __post_init__(self) -> None:
        for flag, value in (
            ("--prefill-workers", self.prefill_workers),
            ("--decode-workers", self.decode_workers),
        ):
            if value is not None and value < 0:
                raise ValueError(f"{flag}: must be >= 0 or auto; got {value}")
        if self.decode_workers == 0:
            raise ValueError("--decode-workers: at least one decode worker is needed; got 0")
        for flag, tp in (
            ("--prefill-tp", self.prefill_tp),
            ("--prefill-pp", self.prefill_pp),
            ("--decode-tp", self.decode_tp),
        ):
            if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
                raise ValueError(f"{flag}: must be an integer >= 1; got {tp!r}")
        for flag, ep, tp in (
            ("--prefill-ep", self.prefill_ep, self.prefill_tp),
            ("--decode-ep", self.decode_ep, self.decode_tp),
        ):
            if isinstance(ep, bool) or ep not in (1, tp):
                raise ValueError(
                    f"{flag}: must be 1 or the group's tensor-parallel size {tp} (the routed "
                    f"experts are sharded over its ranks, whole); got {ep!r}"
                )
        for role, dp, tp, pp in (
            ("prefill", self.prefill_dp, self.prefill_tp, self.prefill_pp),
            ("decode", self.decode_dp, self.decode_tp, 1),
        ):
            if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
                raise ValueError(f"--{role}-dp: must be an integer >= 1; got {dp!r}")
            if dp > 1 and (tp, pp) != (1, 1):
                raise ValueError(
                    f"--{role}-dp: data-parallel {role} workers run at TP and PP 1 (each a "
                    f"whole worker); got --{role}-tp {tp}"
                    + (f", --{role}-pp {pp}" if pp > 1 else "")
                )
        if self.routers < 1:
            raise ValueError(f"--router-replicas: must be >= 1; got {self.routers}")

    @property
    def prefill_ranks(self) -> int:
        """Ranks (processes, GPUs) of one prefill group: its TP x PP ranks, or its
        data-parallel workers."""
        return self.prefill_tp * self.prefill_pp * self.prefill_dp

    @property
    def decode_ranks(self) -> int:
        """Ranks (processes, GPUs) of one decode group: a decode worker's TP ranks, or its
        data-parallel workers."""
        return self.decode_tp * self.decode_dp

    def worker_config(self, role: str) -> dict[str, Any]:
        config = {
            "model": self.model,
            "load_progress": False,
            **self.engine,
            "kv_backend": self.kv_backend,
        }
        if self.kv_staging_bytes is not None:
            config["kv_staging_bytes"] = self.kv_staging_bytes
        config["tensor_parallel_size"] = self.prefill_tp if role == "prefill" else self.decode_tp
        config["expert_parallel_size"] = self.prefill_ep if role == "prefill" else self.decode_ep
        dp = self.prefill_dp if role == "prefill" else self.decode_dp
        if dp > 1:  # every worker of the group holds 1/dp of the experts
            config["data_parallel_size"] = config["expert_parallel_size"] = dp
        if role == "prefill":
            config["pipeline_parallel_size"] = self.prefill_pp
            # Only decode workers speculate: a prefill-only request never decodes. A prefill
            # worker loads the draft only to compute its prompt KV (draft_prefill prefill or
            # auto); then it needs the decode workers' config to ship what they expect.
            spec = config.get("speculative_config")
            if spec is not None and not SpeculativeConfig.from_dict(spec).drafts_on_prefill:
                del config["speculative_config"]
        return config

    def worker_runtime_env(self) -> dict[str, Any] | None:
        """The workers' environment: when the routers trace, the workers export their spans
        to the same collector (telemetry/otel.py)."""
        if not self.router.otlp_endpoint:
            return None
        return {"env_vars": {OTLP_ENDPOINT_ENV: self.router.otlp_endpoint}}
