"""The session store and rate limiter interfaces, their records and their errors.

A session is one conversation: an ordered list of chat messages plus a little metadata, owned by
one API key (stored only as a hash). Every change to a session bumps its `version`; writers that
pass `expected_version` get optimistic concurrency. Rate limits are per-key token buckets for
requests per minute and tokens per minute, kept in the same backend so that several router
replicas share them.
"""

from __future__ import annotations

import builtins
import hashlib
import json
import math
from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

# NOTE: sessions live a week after their last turn unless the caller asks otherwise; a store
# built with `default_ttl_s=None` keeps sessions that were created without a TTL forever.
DEFAULT_SESSION_TTL_S = 7 * 24 * 3600.0


class SessionStoreError(Exception):
    """Base class of everything a `SessionStore` or `RateLimiter` raises on purpose."""


class SessionNotFound(SessionStoreError, KeyError):
    """The session does not exist: never created, deleted, or expired."""

    def __init__(self, session_id: str) -> None:
        super().__init__(f"session {session_id!r} not found (unknown, deleted or expired)")
        self.session_id = session_id

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0])


class SessionConflict(SessionStoreError):
    """`expected_version` did not match: someone else appended first. Reload and retry."""

    def __init__(self, session_id: str, expected_version: int, actual_version: int) -> None:
        super().__init__(
            f"session {session_id!r} is at version {actual_version}, "
            f"not the expected_version {expected_version}"
        )
        self.session_id = session_id
        self.expected_version = expected_version
        self.actual_version = actual_version


class SessionStoreUnavailable(SessionStoreError):
    """The backend is down, slow past its timeout, or locked. Retryable; HTTP 503 at the edge.

    The operation may or may not have been applied when this is raised (a reply lost in
    flight): appends are deduplicated on retry inside one call, not across calls.
    """


def hash_api_key(api_key: str | None) -> str | None:
    """The only form in which an API key is stored: hex SHA-256, or None for no key."""
    if api_key is None:
        return None
    return hashlib.sha256(api_key.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Session:
    """A snapshot of one session's metadata (not its messages; see `SessionStore.history`)."""

    id: str
    """Opaque, unguessable id (32 hex characters)."""
    api_key_hash: str | None
    """`hash_api_key` of the owner's key; None when created without a key. Never the raw key."""
    created_at: float
    """Unix time (seconds) of creation, by the backend's clock."""
    updated_at: float
    """Unix time (seconds) of the last append (or creation)."""
    version: int
    """0 at creation; +1 per appended turn (not per message)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """JSON-serializable caller data, fixed at creation."""
    num_messages: int = 0
    """Length of the history."""

    def is_owned_by(self, api_key: str | None) -> bool:
        """Whether `api_key` is the key this session was created with."""
        return self.api_key_hash == hash_api_key(api_key)


@dataclass(frozen=True)
class StoredResponse:
    """One stored response of the Responses API (router/serving_responses.py)."""

    id: str
    api_key_hash: str | None
    """`hash_api_key` of the owner's key; None when stored without a key."""
    status: str
    """The response's status (queued, in_progress, completed, incomplete, failed, cancelled)."""
    doc: dict[str, Any]
    """What the router stored: the response object and the conversation it continues."""

    def is_owned_by(self, api_key: str | None) -> bool:
        return self.api_key_hash == hash_api_key(api_key)


class SessionStore(ABC):
    """Conversation state shared by every router replica.

    Invariants every backend keeps:
    - `append_turn` is atomic: all of a turn's messages land together, adjacent, in order, or
      none do; concurrent turns never interleave and none is lost.
    - `version` rises by exactly one per successful `append_turn`.
    - A session's TTL restarts at every append; an expired session behaves as deleted.
    - Every operation is bounded in time: a down or stuck backend raises
      `SessionStoreUnavailable` within the store's operation timeout, never hangs.
    - Methods are coroutines for one event loop (the one that first used the store); `close`
      is idempotent and no method may be called after it.

    Stored responses (`put_response`, ...) live beside the sessions, by id, with the store's
    default TTL from their last write; an expired one behaves as deleted.
    """

    @abstractmethod
    async def create(
        self,
        api_key: str | None,
        metadata: dict[str, Any] | None = None,
        ttl_s: float | None = None,
    ) -> Session:
        """Start an empty session (version 0). `ttl_s=None` takes the store's default TTL."""

    @abstractmethod
    async def get(self, session_id: str) -> Session:
        """The session's metadata; `SessionNotFound` if it does not exist."""

    @abstractmethod
    async def append_turn(
        self,
        session_id: str,
        messages: builtins.list[dict[str, Any]],
        expected_version: int | None = None,
    ) -> int:
        """Append one or more messages atomically; return the new version.

        Raises `SessionConflict` when `expected_version` is given and differs from the current
        version (nothing is appended), and `SessionNotFound` for a missing session.
        """

    @abstractmethod
    async def history(self, session_id: str) -> builtins.list[dict[str, Any]]:
        """Every message in append order; `SessionNotFound` if the session does not exist."""

    @abstractmethod
    async def delete(self, session_id: str) -> bool:
        """Remove the session and its messages; False if it did not exist."""

    @abstractmethod
    async def list(self, api_key: str | None) -> builtins.list[Session]:
        """Live sessions created with `api_key`, oldest first."""

    # --- stored responses (the Responses API's `store` and `previous_response_id`) ---

    @abstractmethod
    async def put_response(
        self,
        response_id: str,
        api_key_hash: str | None,
        status: str,
        doc: dict[str, Any],
        only_from: Collection[str] | None = None,
    ) -> bool:
        """Create or replace one stored response (`doc`, JSON) with its `status`, owned by
        the key whose `hash_api_key` is `api_key_hash` (a background runner has only that), living the store's default TTL from now. With `only_from`, atomically: only
        when a response is stored under that id with a status in it (so a cancelled background
        response is never overwritten as completed); returns whether it wrote."""

    @abstractmethod
    async def get_response(self, response_id: str) -> StoredResponse | None:
        """The stored response, or None (never stored, deleted or expired)."""

    @abstractmethod
    async def delete_response(self, response_id: str) -> bool:
        """Remove one stored response; False if there was none."""

    @abstractmethod
    async def close(self) -> None:
        """Release connections and threads. Idempotent."""

    async def __aenter__(self) -> SessionStore:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


@dataclass(frozen=True)
class RateLimits:
    """Per-key limits; None means unlimited. A bucket holds one minute's worth (the burst)."""

    requests_per_min: float | None = None
    """Requests admitted per minute, refilled continuously."""
    tokens_per_min: float | None = None
    """Prompt + completion tokens admitted per minute, refilled continuously."""

    def __post_init__(self) -> None:
        for name in ("requests_per_min", "tokens_per_min"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"RateLimits.{name} must be > 0 or None (unlimited), got {value}")

    @property
    def is_unlimited(self) -> bool:
        return self.requests_per_min is None and self.tokens_per_min is None


@dataclass(frozen=True)
class RateDecision:
    """The answer to one `RateLimiter.acquire`."""

    allowed: bool
    """True when the cost was taken from the buckets; False when nothing was taken."""
    retry_after_s: float = 0.0
    """When refused: seconds until the same acquire would succeed (> 0). 0 when allowed."""


class RateLimiter(ABC):
    """Per-key token buckets for requests/min and tokens/min.

    Invariants:
    - `acquire` is all-or-nothing across both buckets: refused means nothing was taken.
    - A bucket holds at most one minute's worth and refills continuously at limit/60 per
      second. A cost above the bucket size is admitted only from a full bucket, which it
      leaves in debt, so the long-run rate still holds and such a request is not refused
      forever.
    - Keys are hashed before they reach the backend, so raw API keys are never stored.
    - Backends shared by several processes (Redis) keep one set of buckets for all of them.
    - Bounded in time like `SessionStore`; a down backend raises `SessionStoreUnavailable`
      (the caller chooses to fail open or closed).
    """

    @abstractmethod
    async def acquire(
        self, key: str, requests: int, tokens: int, limits: RateLimits
    ) -> RateDecision:
        """Take `requests` and `tokens` from `key`'s buckets if both have room."""

    @abstractmethod
    async def close(self) -> None:
        """Release connections. Idempotent."""


def validate_acquire(requests: int, tokens: int) -> None:
    """Reject negative costs with a message that names the argument."""
    if requests < 0:
        raise ValueError(f"requests must be >= 0, got {requests}")
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")


def resolve_ttl(ttl_s: float | None, default_ttl_s: float | None) -> float | None:
    """The TTL a new session gets; None means it never expires."""
    ttl = default_ttl_s if ttl_s is None else ttl_s
    if ttl is not None and not (math.isfinite(ttl) and ttl > 0):
        raise ValueError(f"ttl_s must be > 0 seconds or None (store default), got {ttl}")
    return ttl


def encode_metadata(metadata: dict[str, Any] | None) -> str:
    """Metadata as JSON; a clear ValueError for anything that is not a JSON object."""
    if metadata is None:
        return "{}"
    if not isinstance(metadata, dict):
        raise ValueError(f"metadata must be a dict, got {type(metadata).__name__}")
    try:
        return json.dumps(metadata, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise ValueError(f"metadata must be JSON-serializable: {e}") from e


def encode_messages(messages: builtins.list[dict[str, Any]]) -> builtins.list[str]:
    """Each message as JSON; a turn must hold at least one message, each a dict."""
    if not isinstance(messages, builtins.list) or not messages:
        raise ValueError("messages must be a non-empty list of dicts")
    encoded = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        try:
            encoded.append(json.dumps(message, separators=(",", ":")))
        except (TypeError, ValueError) as e:
            raise ValueError(f"messages[{i}] must be JSON-serializable: {e}") from e
    return encoded


def validate_expected_version(expected_version: int | None) -> None:
    if expected_version is not None and (
        isinstance(expected_version, bool) or not isinstance(expected_version, int)
    ):
        raise ValueError(f"expected_version must be an int or None, got {expected_version!r}")
