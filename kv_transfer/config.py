"""What a KV sender or receiver is built with: the settings every backend takes (a worker's
generic ones), subclassed by each backend's config with its own options. The factory builds a
backend's config from the worker's settings plus extra options by name; an option the backend
does not take is an error naming it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from duet.cluster_auth import ClusterSecret
from duet.kv_transfer.staging import DEFAULT_STAGING_BYTES, check_staging_bytes


@dataclass(frozen=True)
class SenderConfig:
    """Settings of every sender (the prefill side)."""

    name: str = "prefill"
    """Who sends: names the channels and threads (the worker and its TP rank)."""
    timeout_s: float = 30.0
    """Longest wait of one step of a transfer (a socket operation, a store wait) without progress."""
    ack_timeout_s: float = 60.0
    """The hold lease on sent blocks: FAILED (retryable) when the receiver has not acknowledged
    within this long of the sender letting go of the blocks."""
    secret: ClusterSecret | None = field(default=None, repr=False, compare=False)
    """The cluster secret a network backend proves to each receiver (and asks it to prove)
    before its first frame. None: no proof, for in-process use and tests only; every worker
    passes its cluster's."""
    measure_link: bool = False
    """Probe the link to each receiver once, in the background when the first channel to it
    opens (kv_transfer/link_probe.py), and report its rate with every transfer's result
    (`TransferResult.link_gbps`). Backends that cannot probe ignore it (docs/kv_transfer.md)."""
    staging_bytes: int = DEFAULT_STAGING_BYTES
    """The staging pool transfers stream through (kv_transfer/staging.py: torch_dist's gathers);
    backends that move blocks cache to cache ignore it."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name: must not be empty")
        _check_positive(self, "timeout_s", "ack_timeout_s")
        check_staging_bytes("staging_bytes", self.staging_bytes)


@dataclass(frozen=True)
class ReceiverConfig:
    """Settings of every receiver (the decode side)."""

    name: str = "decode"
    """Who receives: the local backend's address; threads' names elsewhere."""
    timeout_s: float = 30.0
    """Longest wait of one step of a transfer without progress; also how long data nobody
    expects is kept."""
    host: str = "127.0.0.1"
    """Where a network backend listens (the local backend has no socket)."""
    port: int = 0
    """Port to listen on; 0 picks a free one."""
    advertise_host: str | None = None
    """The host senders dial, when it differs from `host` (e.g. `host` is 0.0.0.0)."""
    secret: ClusterSecret | None = field(default=None, repr=False, compare=False)
    """The cluster secret a network backend makes each connecting sender prove (and proves
    back) before reading any frame. None: no proof, for in-process use and tests only."""
    staging_bytes: int = DEFAULT_STAGING_BYTES
    """The staging pool transfers stream through (kv_transfer/staging.py: torch_dist's
    receives, tcp's for KV nobody expects yet or a head shard); others ignore it."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name: must not be empty")
        _check_positive(self, "timeout_s")
        check_staging_bytes("staging_bytes", self.staging_bytes)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: must be in [0, 65535], got {self.port}")
        if not self.host:
            raise ValueError("host: must not be empty")


Config = TypeVar("Config", SenderConfig, ReceiverConfig)


def build_config(
    config_type: type[Config], settings: Config | None, options: Mapping[str, Any], what: str
) -> Config:
    """`config_type` (a subclass of `settings`' type) from the generic `settings` and the
    backend-specific `options` (which override a setting of the same name). `what` names the
    backend's side in the error for an option it does not take."""
    known = [f.name for f in dataclasses.fields(config_type)]
    unknown = [name for name in options if name not in known]
    if unknown:
        raise ValueError(f"{unknown[0]}: not an option of {what}; its options: {', '.join(known)}")
    values: dict[str, Any] = {}
    if settings is not None:  # shallow: an option may be an object both sides share (a hub)
        values = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}
    return config_type(**{**values, **options})


def _check_positive(config: Any, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if not value > 0:
            raise ValueError(f"{name}: must be > 0, got {value}")
