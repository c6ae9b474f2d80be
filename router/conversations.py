"""OpenAI's Conversations API (`/v1/conversations`): a conversation's items (messages,
function calls and their outputs, reasoning) kept on the server, which the Responses API's
`conversation` reads before its input and appends the turn to, and which agents keep their
session memory in (the openai-agents SDK's `OpenAIConversationsSession`).

A conversation is one document in the session store beside the stored responses (its id
`conv_...`), owned by the API key that created it (any other key gets 404, as for an unknown
id), living the store's TTL from its last change. Every change is a compare-and-swap on the
document's version (`SessionStore.put_response`'s `only_from`), retried when another change
landed first, so concurrent appends never lose one another.

Items are stored in the Responses API's item shape with an id each: a message's text content
becomes `input_text` parts (`output_text` for the assistant), and an item without an id gets
one (`msg_`, `fc_`, `fco_`, `rs_`)."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Query, Request
from pydantic import Field, WithJsonSchema

from duet.router.auth import caller_api_key
from duet.router.batches import NotFoundError
from duet.router.errors import BadRequestError, OpenAIError
from duet.router.openai_protocol import OpenAIModel
from duet.router.openapi import error_responses
from duet.router.responses_protocol import (
    INPUT_ITEM_SCHEMA,
    Metadata,
    input_item_messages,
)
from duet.router.responses_render import new_id
from duet.router.responses_store import owned_document
from duet.router.sessions import SessionManager, store_errors
from duet.session_store import StoredResponse, hash_api_key

MAX_ITEMS_PER_REQUEST = 20
"""OpenAI's limit on the items one create or add request carries."""
CAS_DEADLINE_S = 10.0
"""How long one change keeps retrying its compare-and-swap (other writers winning) before it
is a 503."""
CAS_BACKOFF_S = (0.002, 0.2)
"""A lost swap waits a random time up to the first, doubling per loss up to the second, so
that the losers of a crowd of writers step aside and each gets its turn."""
_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
              "reasoning": "rs"}  # fmt: skip


ITEM_SCHEMA = {"allOf": [
    INPUT_ITEM_SCHEMA,
    {"type": "object", "properties": {"id": {"type": "string", "minLength": 1}}},
]}  # fmt: skip
"""A conversation item as `normalize_items` takes it: an input item, with its id or without."""
Items = Annotated[
    list[dict[str, Any]],
    WithJsonSchema({"type": "array", "maxItems": MAX_ITEMS_PER_REQUEST, "items": ITEM_SCHEMA}),
]


class ConversationCreate(OpenAIModel):
    items: Annotated[Items, Field(max_length=MAX_ITEMS_PER_REQUEST)] | None = None
    metadata: Metadata | None = None


class ConversationUpdate(OpenAIModel):
    metadata: Metadata


class ItemsCreate(OpenAIModel):
    items: Annotated[
        list[dict[str, Any]],
        Field(min_length=1, max_length=MAX_ITEMS_PER_REQUEST),
        WithJsonSchema({"type": "array", "minItems": 1, "maxItems": MAX_ITEMS_PER_REQUEST,
                        "items": ITEM_SCHEMA}),
    ]  # fmt: skip


class ConversationsUnavailableError(OpenAIError):
    status_code = 503
    type = "service_unavailable"
    code = "conversation_busy"


def _version(status: str) -> int:
    return int(status.removeprefix("conversation-v"))


def _status(version: int) -> str:
    return f"conversation-v{version}"


def normalize_items(
    items: list[dict[str, Any]], param: str, taken: set[str]
) -> list[dict[str, Any]]:
    """`items` as stored: each checked as a Responses input item (a 400 names `param[i]`),
    given an id when it has none and a status, a message's text as content parts. `taken`:
    the ids already in the conversation (a repeat is a 400); the new ones are added to it."""
    out = []
    for i, raw in enumerate(items):
        where = f"{param}[{i}]"
        try:
            input_item_messages([raw])
        except BadRequestError as e:
            message = str(e.message).replace("input[0]", where, 1)
            raise BadRequestError(message, param=where) from None
        item = dict(raw)
        kind = item.setdefault("type", "message")
        if kind == "message":
            role = item["role"]
            content = item["content"]
            text_type = "output_text" if role == "assistant" else "input_text"
            if isinstance(content, str):
                content = [{"type": text_type, "text": content}]
            item["content"] = [_part(dict(p)) for p in content]
        item_id = item.get("id")
        if item_id is None:
            item_id = item["id"] = new_id(_ID_PREFIX[kind])
        elif not isinstance(item_id, str) or not item_id:
            raise BadRequestError(f"{where}.id: must be a non-empty string", param=f"{where}.id")
        if item_id in taken:
            raise BadRequestError(
                f"{where}.id: {item_id[:64]!r} is already an item of this conversation",
                param=f"{where}.id",
            )
        taken.add(item_id)
        item.setdefault("status", "completed")
        out.append(item)
    return out


def _part(part: dict[str, Any]) -> dict[str, Any]:
    if part.get("type") == "output_text":
        part.setdefault("annotations", [])
        part.setdefault("logprobs", [])
    return part


class ConversationsHandler:
    """The routes' logic over the session store (None: the server has no store, every route
    is a 404 saying so)."""

    def __init__(self, sessions: SessionManager) -> None:
        self.sessions = sessions

    async def create(self, body: ConversationCreate, raw: Request) -> dict[str, Any]:
        store = self._store("conversation_id")
        conversation = {
            "id": new_id("conv"),
            "object": "conversation",
            "created_at": int(time.time()),
            "metadata": body.metadata or {},
        }
        items = normalize_items(body.items or [], "items", set())
        doc = {"conversation": conversation, "items": items}
        owner = _owner(raw)
        with store_errors(""):
            await store.put_response(conversation["id"], owner, _status(0), doc)
        return conversation

    async def retrieve(self, conversation_id: str, raw: Request) -> dict[str, Any]:
        stored = await self.get(conversation_id, _owner(raw))
        return dict(stored.doc["conversation"])

    async def update(
        self, conversation_id: str, body: ConversationUpdate, raw: Request
    ) -> dict[str, Any]:
        def change(doc: dict[str, Any]) -> dict[str, Any]:
            doc["conversation"]["metadata"] = body.metadata
            return dict(doc["conversation"])

        return await self.change(conversation_id, _owner(raw), change)

    async def delete(self, conversation_id: str, raw: Request) -> dict[str, Any]:
        await self.get(conversation_id, _owner(raw))
        store = self._store("conversation_id")
        with store_errors(""):
            await store.delete_response(conversation_id)
        return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}

    async def add_items(
        self, conversation_id: str, body: ItemsCreate, raw: Request
    ) -> dict[str, Any]:
        def change(doc: dict[str, Any]) -> list[dict[str, Any]]:
            taken = {item["id"] for item in doc["items"]}
            added = normalize_items(body.items, "items", taken)
            doc["items"] += added
            return added

        added = await self.change(conversation_id, _owner(raw), change)
        return _page(added, has_more=False)

    async def list_items(
        self,
        conversation_id: str,
        raw: Request,
        after: str | None,
        limit: int,
        order: Literal["asc", "desc"],
    ) -> dict[str, Any]:
        items = list((await self.get(conversation_id, _owner(raw))).doc["items"])
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise BadRequestError(
                    f"after: {after[:64]!r} is not an item of this conversation", param="after"
                )
            items = items[ids.index(after) + 1 :]
        return _page(items[:limit], has_more=len(items) > limit)

    async def get_item(self, conversation_id: str, item_id: str, raw: Request) -> dict[str, Any]:
        stored = await self.get(conversation_id, _owner(raw))
        for item in stored.doc["items"]:
            if item["id"] == item_id:
                return dict(item)
        raise _item_not_found(item_id)

    async def delete_item(self, conversation_id: str, item_id: str, raw: Request) -> dict[str, Any]:
        def change(doc: dict[str, Any]) -> dict[str, Any]:
            kept = [item for item in doc["items"] if item["id"] != item_id]
            if len(kept) == len(doc["items"]):
                raise _item_not_found(item_id)
            doc["items"] = kept
            return dict(doc["conversation"])

        return await self.change(conversation_id, _owner(raw), change)

    async def append_turn(
        self,
        conversation_id: str,
        owner: str | None,
        response_id: str,
        inputs: list[dict[str, Any]],
        outputs: list[dict[str, Any]],
    ) -> None:
        """Response `response_id`'s turn onto the conversation: its input items, then its
        output items, once (a background response's runner that died after this and ran again
        finds the response id recorded and adds nothing). An input item whose id is already
        there, or repeats, gets a new one: the reply is not lost."""

        def change(doc: dict[str, Any]) -> None:
            appended: list[str] = doc.setdefault("responses", [])
            if response_id in appended:
                return
            appended.append(response_id)
            taken = {item["id"] for item in doc["items"]}
            seen, fresh = set(taken), []
            for item in inputs:
                if item.get("id") in seen:
                    item = {k: v for k, v in item.items() if k != "id"}
                seen.add(item.get("id"))
                fresh.append(item)
            added = normalize_items(fresh, "input", taken)
            doc["items"] += added + normalize_items(outputs, "output", taken)

        await self.change(conversation_id, owner, change, "conversation")

    # -- the store ----------------------------------------------------------------------------

    def _store(self, param: str) -> Any:
        store = self.sessions.store
        if store is None:
            raise NotFoundError(
                f"{param}: conversations are not stored on this server (it was started without "
                "a session store)",
                param=param,
            )
        return store

    async def get(
        self, conversation_id: str, owner: str | None, param: str = "conversation_id"
    ) -> StoredResponse:
        """The conversation if the key hashed as `owner` (`hash_api_key`) owns it; 404 naming
        `param` otherwise."""
        return await owned_document(
            self._store(param), conversation_id, "conversation", owner, param
        )

    async def change(
        self, conversation_id: str, owner: str | None, change: Any, param: str = "conversation_id"
    ) -> Any:
        """Apply `change` (the document -> the result; it edits the document in place) to the
        conversation of the key hashed as `owner`, as a compare-and-swap on its version, again from a fresh read
        when another change landed first (after a random back-off, so that a crowd of writers
        takes turns). Returns `change`'s result."""
        store = self._store(param)
        deadline = time.monotonic() + CAS_DEADLINE_S
        first, most = CAS_BACKOFF_S
        for lost in itertools.count():
            if lost:
                if time.monotonic() >= deadline:
                    break
                await asyncio.sleep(random.uniform(0, min(most, first * 2 ** min(lost, 16))))
            stored = await self.get(conversation_id, owner, param)
            doc = stored.doc
            result = change(doc)
            version = _version(stored.status)
            with store_errors(""):
                if await store.put_response(
                    conversation_id, stored.api_key_hash, _status(version + 1), doc,
                    only_from={stored.status},
                ):  # fmt: skip
                    return result
        raise ConversationsUnavailableError(
            f"{param}: conversation {conversation_id[:64]!r} kept changing under this request; "
            "retry it"
        )


def _owner(raw: Request) -> str | None:
    """The caller's key, hashed as documents record their owner."""
    return hash_api_key(caller_api_key(raw))


def _item_not_found(item_id: str) -> NotFoundError:
    return NotFoundError(
        f"item_id: item {item_id[:64]!r} not found in this conversation", param="item_id"
    )


def _page(items: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": has_more,
    }


_ERRORS = error_responses(400, 401, 404, 503)


def install_conversation_routes(app: FastAPI, handler: ConversationsHandler) -> None:
    """The Conversations API's eight routes."""

    @app.post("/v1/conversations", responses=_ERRORS)
    async def create_conversation(body: ConversationCreate, raw: Request) -> dict[str, Any]:
        return await handler.create(body, raw)

    @app.get("/v1/conversations/{conversation_id}", responses=_ERRORS)
    async def get_conversation(conversation_id: str, raw: Request) -> dict[str, Any]:
        return await handler.retrieve(conversation_id, raw)

    @app.post("/v1/conversations/{conversation_id}", responses=_ERRORS)
    async def update_conversation(
        conversation_id: str, body: ConversationUpdate, raw: Request
    ) -> dict[str, Any]:
        return await handler.update(conversation_id, body, raw)

    @app.delete("/v1/conversations/{conversation_id}", responses=_ERRORS)
    async def delete_conversation(conversation_id: str, raw: Request) -> dict[str, Any]:
        return await handler.delete(conversation_id, raw)

    @app.post("/v1/conversations/{conversation_id}/items", responses=_ERRORS)
    async def add_items(conversation_id: str, body: ItemsCreate, raw: Request) -> dict[str, Any]:
        return await handler.add_items(conversation_id, body, raw)

    @app.get("/v1/conversations/{conversation_id}/items", responses=_ERRORS)
    async def list_items(
        conversation_id: str,
        raw: Request,
        after: str | None = None,
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
        order: Literal["asc", "desc"] = "desc",
    ) -> dict[str, Any]:
        return await handler.list_items(conversation_id, raw, after, limit, order)

    @app.get("/v1/conversations/{conversation_id}/items/{item_id}", responses=_ERRORS)
    async def get_item(conversation_id: str, item_id: str, raw: Request) -> dict[str, Any]:
        return await handler.get_item(conversation_id, item_id, raw)

    @app.delete("/v1/conversations/{conversation_id}/items/{item_id}", responses=_ERRORS)
    async def delete_item(conversation_id: str, item_id: str, raw: Request) -> dict[str, Any]:
        return await handler.delete_item(conversation_id, item_id, raw)
