"""Stored responses for the Responses API, kept in the session store beside the sessions
(session_store/base.py): each holds the response object and the conversation it ends (the
messages of every earlier response it continues, its input, its reply; never `instructions`),
which `previous_response_id` continues.

A response belongs to the API key that created it; any other key gets 404, as for an unknown
id. Store failures become the OpenAI errors sessions use (503 store unavailable)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from duet.router.batches import NotFoundError
from duet.router.errors import OpenAIError
from duet.router.sessions import SessionManager, store_errors
from duet.session_store import SessionStore, StoredResponse, hash_api_key

RUNNING = frozenset({"queued", "in_progress"})
"""The statuses a background response can still leave (and be cancelled from)."""
ENDED = frozenset({"completed", "incomplete"})
"""The statuses of a response whose turn joins its conversation (`conversation`)."""


class ResponsesDisabledError(OpenAIError):
    status_code = 404
    type = "not_found_error"
    code = "responses_not_stored"


async def owned_document(
    store: SessionStore, doc_id: str, kind: str, owner: str | None, param: str
) -> StoredResponse:
    """The stored document `doc_id` of `kind` ("response", or "conversation": both live in the
    stored responses' keyspace, told apart by the key their document holds), if the key hashed
    as `owner` (`hash_api_key`) owns it; else a 404 naming `param`, as for an unknown id."""
    with store_errors(""):
        stored = await store.get_response(doc_id)
    if stored is None or kind not in stored.doc or stored.api_key_hash != owner:
        raise NotFoundError(
            f"{param}: {kind} {doc_id[:64]!r} not found (unknown, expired, deleted, or created "
            "with another API key)",
            param=param,
        )
    return stored


@dataclass
class StoredResponses:
    """The router's access to stored responses (the session store; None: not stored)."""

    sessions: SessionManager

    @property
    def enabled(self) -> bool:
        return self.sessions.store is not None

    async def get(self, response_id: str, api_key: str | None, param: str) -> StoredResponse:
        """The caller's stored response; 404 naming `param` otherwise."""
        store = self.sessions.store
        if store is None:
            raise ResponsesDisabledError(
                f"{param}: responses are not stored on this server (it was started without a "
                "session store)",
                param=param,
            )
        return await owned_document(store, response_id, "response", hash_api_key(api_key), param)

    async def put(
        self,
        response: dict[str, Any],
        messages: list[dict[str, Any]],
        owner: str | None,
        only_from: Collection[str] | None = None,
    ) -> bool:
        """Store `response` (and the conversation it ends) for the key hashed as `owner`;
        with `only_from`, only over a stored response in one of those statuses."""
        store = self.sessions.store
        assert store is not None, "put only with a session store"
        doc = {"response": response, "messages": messages}
        with store_errors(""):
            return await store.put_response(
                response["id"], owner, response["status"], doc, only_from
            )

    async def delete(self, response_id: str, api_key: str | None) -> None:
        await self.get(response_id, api_key, "response_id")
        store = self.sessions.store
        assert store is not None
        with store_errors(""):
            await store.delete_response(response_id)
