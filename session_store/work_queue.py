"""The durable work queue: tasks that outlive the router that accepted them.

A task is a JSON payload with a caller-chosen id. Every router replica consumes from one shared
queue (a consumer group on Redis Streams; a table in the embedded SQLite file). Delivery is
at least once; the stored result is exactly once:

    enqueue ──> claim (lease) ──> complete(result): result stored once, then acknowledged
                   │    └──────> fail(reason): claimable again at once, or dead-lettered
                   └─ lease expires (the consumer died) ──> claimable by any consumer

Invariants every backend keeps:
- A task is acknowledged (removed from the pending set) only in the same atomic step that
  stores its result, or after a result is already stored. A consumer that dies before that
  leaves the task pending; once its lease (`lease_s`) expires, the next `claim` by any
  consumer takes it over.
- A task has at most one result: the first `complete` (or dead-lettering) stores it; later
  ones for the same task id (a duplicate delivery) store nothing and return False.
- A task claimed `max_deliveries` times without a result is dead-lettered on its next claim, or
  at once when `fail` is called on its last delivery: it moves to the dead-letter list with
  the reason, and its result becomes an error `{"error": {"code": "dead_letter", ...}}`, so
  whoever waits for it learns the outcome.
- Every operation is bounded in time: a down backend raises `SessionStoreUnavailable`.
- Methods are coroutines for one event loop; `close` is idempotent.

Records (small JSON documents by kind and id), blobs (file contents) and event logs (the
chunks of a background request, read from any replica by offset) live beside the queue so that
every replica shares them too.

Nothing is kept forever. A result and a dead letter live `retention_s` after they are stored; a
record or blob lives until the expiry its writer names, else `retention_s` after its last
write; an event log lives `event_ttl_s` after its last append. Once past its time a thing reads
as absent (a result as None, a record or blob as None, a dead letter not listed), and its space
is reclaimed by later writes (a few expired entries per write) or by the backend itself. Clocks:
the SQLite queue's is the process's; the Redis queue's is Redis's, except that a named expiry
(`expires_at`) is an absolute time the writer chose.
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import TracebackType
from typing import Any

DEFAULT_LEASE_S = 60.0
"""How long a claimed task stays with its consumer without a `renew`."""
DEFAULT_MAX_DELIVERIES = 3
"""Deliveries without a result before a task is dead-lettered."""
DEFAULT_EVENT_TTL_S = 24 * 3600.0
"""How long an event log lives after its last append (a background request's stream)."""
DEFAULT_RETENTION_S = 30 * 24 * 3600.0
"""How long results, dead letters, and records and blobs that name no expiry of their own are
kept after their last write (30 days, as OpenAI keeps batch files and stored responses)."""
PURGE_PER_WRITE = 16
"""Expired entries a write removes beside its own work, so that none outlives long the writes
that follow it."""


@dataclass(frozen=True)
class Task:
    """One unit of work to enqueue."""

    task_id: str
    """Caller-chosen, unique in the queue; results are keyed by it."""
    kind: str
    """What runs it (e.g. "batch.chat")."""
    payload: dict[str, Any]
    """JSON-serializable arguments."""


@dataclass(frozen=True)
class Delivery:
    """A task handed to one consumer, under a lease."""

    task_id: str
    kind: str
    payload: dict[str, Any]
    handle: str
    """The backend's id of this queue entry (a stream entry id, or a row id)."""
    consumer: str
    """Who holds the lease."""
    num_deliveries: int
    """1 on the first delivery, +1 each time the task is claimed again."""


@dataclass(frozen=True)
class DeadLetter:
    """A task given up on, with why."""

    task_id: str
    kind: str
    payload: dict[str, Any]
    reason: str
    num_deliveries: int


class WorkQueue(ABC):
    """See the module docstring for the contract."""

    name: str
    """Which queue of the backend this object consumes (tasks, pending set, dead letters);
    records, blobs, event logs and results are shared by every queue of one backend."""
    lease_s: float
    max_deliveries: int
    event_ttl_s: float
    """How long an event log lives after its last append; then it is gone (reads as empty)."""
    retention_s: float
    """How long a result or dead letter lives after it is stored, and a record or blob that
    names no expiry after its last write."""

    @abstractmethod
    def queue_named(self, name: str) -> WorkQueue:
        """Another queue in the same backend (same lease, delivery limits and event-log
        lifetime), so that work of one kind never waits behind another's. This object closes
        it with itself."""

    @abstractmethod
    async def enqueue(
        self,
        tasks: list[Task],
        results: dict[str, dict[str, Any]] | None = None,
        record: tuple[str, str, dict[str, Any]] | None = None,
    ) -> None:
        """Atomically: enqueue `tasks`, store `results` (task id -> result, for work that
        needs no run, e.g. a rejected batch line; a task that has a result keeps it) and put
        `record` (kind, id, doc; it lives `retention_s`). All or nothing."""

    @abstractmethod
    async def claim(self, consumer: str, max_tasks: int = 1) -> list[Delivery]:
        """Up to `max_tasks` deliveries for `consumer`: expired leases first, then new tasks.
        Never blocks waiting for work; returns [] when there is none."""

    @abstractmethod
    async def renew(self, delivery: Delivery) -> bool:
        """Restart the lease; False if the task is no longer this consumer's (another
        consumer took it over, or it was completed)."""

    @abstractmethod
    async def complete(self, delivery: Delivery, result: dict[str, Any]) -> bool:
        """Store `result` unless the task has one, then acknowledge the delivery. True if this
        call stored the result."""

    @abstractmethod
    async def fail(self, delivery: Delivery, reason: str) -> bool:
        """Give the task back (claimable at once), or dead-letter it when this was its last
        allowed delivery. True if it was dead-lettered."""

    @abstractmethod
    async def results(self, task_ids: list[str]) -> list[dict[str, Any] | None]:
        """The stored result of each task (None: none yet, or expired), in the order asked."""

    @abstractmethod
    async def dead_letters(self) -> list[DeadLetter]:
        """Every dead-lettered task of this queue stored in the last `retention_s`, oldest
        first."""

    @abstractmethod
    async def num_pending(self) -> int:
        """Tasks enqueued and not yet acknowledged (waiting or leased)."""

    @abstractmethod
    async def put_record(
        self, kind: str, record_id: str, doc: dict[str, Any], expires_at: float | None = None
    ) -> None:
        """Create or replace one record, living until `expires_at` (seconds since the epoch)
        or, when None, `retention_s` from now."""

    @abstractmethod
    async def get_record(self, kind: str, record_id: str) -> dict[str, Any] | None:
        """The record, or None (never put, deleted or expired)."""

    @abstractmethod
    async def list_records(self, kind: str) -> list[dict[str, Any]]:
        """Every live record of `kind`, in no particular order."""

    @abstractmethod
    async def delete_record(self, kind: str, record_id: str) -> bool:
        """Remove one record; False when there was none."""

    @abstractmethod
    async def put_blob(self, blob_id: str, data: bytes, expires_at: float | None = None) -> None:
        """Create or replace one blob (a file's bytes), living until `expires_at` or, when
        None, `retention_s` from now."""

    @abstractmethod
    async def get_blob(self, blob_id: str) -> bytes | None:
        """The blob, or None (never put, deleted or expired)."""

    @abstractmethod
    async def delete_blob(self, blob_id: str) -> None:
        """Remove one blob (nothing when there is none)."""

    @abstractmethod
    async def append_events(self, stream_id: str, offset: int, events: list[str]) -> int:
        """Append `events` to the event log `stream_id` as its entries `offset`, `offset + 1`,
        ...; entries already there are kept, not repeated (a retried or re-delivered append is
        a no-op for them). Returns the log's length. `offset` beyond the end is a ValueError:
        a log never has gaps. The log lives `event_ttl_s` from this append."""

    @abstractmethod
    async def read_events(self, stream_id: str, offset: int, max_events: int) -> list[str]:
        """Up to `max_events` entries of the log from `offset` (fewer at its end)."""

    @abstractmethod
    async def close(self) -> None:
        """Release connections and threads. Idempotent."""

    async def __aenter__(self) -> WorkQueue:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


def validate_queue_limits(
    lease_s: float,
    max_deliveries: int,
    event_ttl_s: float = DEFAULT_EVENT_TTL_S,
    retention_s: float = DEFAULT_RETENTION_S,
) -> None:
    if not (math.isfinite(lease_s) and lease_s > 0):
        raise ValueError(f"lease_s: must be > 0 seconds; got {lease_s}")
    if not (math.isfinite(event_ttl_s) and event_ttl_s > 0):
        raise ValueError(f"event_ttl_s: must be > 0 seconds; got {event_ttl_s}")
    if not (math.isfinite(retention_s) and retention_s > 0):
        raise ValueError(f"retention_s: must be > 0 seconds; got {retention_s}")
    if isinstance(max_deliveries, bool) or not isinstance(max_deliveries, int):
        raise ValueError(f"max_deliveries: must be an int; got {max_deliveries!r}")
    if max_deliveries < 1:
        raise ValueError(f"max_deliveries: must be >= 1; got {max_deliveries}")


def dead_letter_result(reason: str) -> dict[str, Any]:
    """The result a dead-lettered task gets."""
    return {"error": {"code": "dead_letter", "message": reason}}


def expired_reason(num_deliveries: int) -> str:
    return (
        f"delivered {num_deliveries} times without a result (each consumer died or let its "
        "lease expire)"
    )


def dumps(doc: Any) -> str:
    return json.dumps(doc, separators=(",", ":"))
