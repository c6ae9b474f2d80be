"""Sessions for the router: stored conversations that chat requests continue by `session_id`.

A turn reads the session (its version, then its history) when the request arrives and, once the
reply is complete, appends [the request's messages, the assistant's reply] in ONE `append_turn`
with `expected_version` set to the version it read. Two concurrent turns on one session thus
never interleave: the first to finish is stored, the other fails with 409 (gRPC ABORTED) and
nothing of it is stored. A reply is reported complete only after its turn is stored.

A session belongs to the API key that created it (None when the server has no keys); any other
key gets 404, as for an unknown id. Store failures become OpenAI errors here, so REST and gRPC
(which maps them by status) say the same: 404 not found, 409 conflict, 503 store unavailable.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from duet.router.errors import (
    SessionConflictError,
    SessionNotFoundError,
    SessionsDisabledError,
    SessionStoreUnavailableError,
)
from duet.session_store import (
    Session,
    SessionConflict,
    SessionNotFound,
    SessionStore,
    SessionStoreUnavailable,
)

logger = logging.getLogger(__name__)

_SESSION_ID = re.compile(r"[0-9a-f]{32}")
"""Ids the stores hand out; anything else is unknown without asking the store."""


@dataclass(frozen=True)
class SessionTurn:
    """What a chat request read from its session before generating."""

    session_id: str
    version: int
    """The version the turn's append must find (optimistic concurrency)."""
    history: list[dict[str, Any]]
    """Earlier messages, prepended to the request's own."""


class SessionManager:
    """The router's access to a `SessionStore` (None: sessions disabled). Calls run on the
    event loop that owns the store."""

    def __init__(self, store: SessionStore | None) -> None:
        self.store = store

    @property
    def enabled(self) -> bool:
        return self.store is not None

    async def create(
        self, api_key: str | None, metadata: dict[str, Any] | None, ttl_s: float | None
    ) -> Session:
        store = self._store()
        with store_errors(""):
            return await store.create(api_key, metadata, ttl_s)

    async def get(self, session_id: str, api_key: str | None) -> Session:
        """The session, if `api_key` owns it; `SessionNotFoundError` otherwise."""
        store = self._store()
        if not _SESSION_ID.fullmatch(session_id):
            raise SessionNotFoundError(session_id)
        with store_errors(session_id):
            session = await store.get(session_id)
        if not session.is_owned_by(api_key):
            raise SessionNotFoundError(session_id)
        return session

    async def read(
        self, session_id: str, api_key: str | None
    ) -> tuple[Session, list[dict[str, Any]]]:
        """The session and its messages, if `api_key` owns it."""
        # NOTE: metadata first, then history: the history is at least as new as the version.
        session = await self.get(session_id, api_key)
        with store_errors(session_id):
            return session, await self._store().history(session.id)

    async def list_owned(self, api_key: str | None) -> list[Session]:
        store = self._store()
        with store_errors(""):
            return await store.list(api_key)

    async def delete(self, session_id: str, api_key: str | None) -> None:
        session = await self.get(session_id, api_key)
        with store_errors(session_id):
            if not await self._store().delete(session.id):
                raise SessionNotFound(session.id)

    async def begin_turn(self, session_id: str, api_key: str | None) -> SessionTurn:
        # A turn stored between `read`'s two calls makes this turn's append find a newer
        # version and fail with 409, so a reply to a stale history is never stored.
        session, history = await self.read(session_id, api_key)
        return SessionTurn(session.id, session.version, history)

    async def commit_turn(
        self, turn: SessionTurn, messages: list[dict[str, Any]], reply: str | dict[str, Any]
    ) -> int:
        """Append the request's messages and the assistant's reply (its text, or its message
        with tool calls: `openai_chat.assistant_message`) as one turn; return the new version.
        `SessionConflictError` when another turn was stored since `begin_turn`."""
        store = self._store()
        if isinstance(reply, str):
            reply = {"role": "assistant", "content": reply}
        with store_errors(turn.session_id):
            return await store.append_turn(
                turn.session_id, [*messages, reply], expected_version=turn.version
            )

    async def commit_turn_once(
        self, turn: SessionTurn, messages: list[dict[str, Any]], reply: dict[str, Any]
    ) -> None:
        """`commit_turn` for a request that may run again after a failure (a background request
        taken over by another replica): a turn it already stored is not stored twice."""
        try:
            await self.commit_turn(turn, messages, reply)
        except SessionConflictError:
            with store_errors(turn.session_id):
                history = await self._store().history(turn.session_id)
            mine = [*messages, reply]
            if history[-len(mine) :] != mine:
                raise

    def _store(self) -> SessionStore:
        if self.store is None:
            raise SessionsDisabledError()
        return self.store


@contextmanager
def store_errors(session_id: str) -> Iterator[None]:
    """Store errors as the OpenAI errors clients see (details of outages stay in the log)."""
    try:
        yield
    except SessionNotFound:
        raise SessionNotFoundError(session_id) from None
    except SessionConflict as e:
        raise SessionConflictError(
            f"session_id: another turn on session {session_id!r} was stored first (the session "
            f"is now at version {e.actual_version}); this reply was not stored. Send one turn "
            "at a time per session, and retry this one if it is still wanted",
            param="session_id",
        ) from None
    except SessionStoreUnavailable as e:
        logger.warning("session store unavailable: %s", e)
        raise SessionStoreUnavailableError(
            "the session store is unavailable; retry shortly (requests without session_id are "
            "not affected)"
        ) from None
