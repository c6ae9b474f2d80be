"""REST bodies of `/v1/sessions`: create, list, read (with messages), delete.

Metadata follows OpenAI's convention for `metadata` maps: at most 16 string pairs, keys up to 64
characters, values up to 512.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from duet.router.openai_protocol import OpenAIModel
from duet.session_store import Session

MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_SESSION_TTL_S = 365 * 24 * 3600.0


class SessionCreateRequest(OpenAIModel):
    metadata: dict[str, str] | None = Field(None, max_length=MAX_METADATA_PAIRS)
    """Caller data kept with the session, fixed at creation."""
    ttl_s: float | None = Field(None, ge=1, le=MAX_SESSION_TTL_S)
    """Seconds the session lives after its last turn; default: the store's (a week)."""

    @field_validator("metadata")
    @classmethod
    def _check_metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        for key, item in (value or {}).items():
            if len(key) > MAX_METADATA_KEY_CHARS:
                raise ValueError(f"keys must be at most {MAX_METADATA_KEY_CHARS} characters")
            if len(item) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(f"values must be at most {MAX_METADATA_VALUE_CHARS} characters")
        return value


class SessionMessage(BaseModel):
    """A stored chat message (as the request sent it, or the assistant's reply)."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | None = None


class SessionObject(BaseModel):
    id: str
    object: Literal["session"] = "session"
    created_at: int
    """Unix seconds."""
    updated_at: int
    """Unix seconds of the last stored turn (or creation)."""
    version: int
    """Stored turns so far."""
    num_messages: int
    metadata: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def of(cls, session: Session) -> SessionObject:
        return cls(
            id=session.id,
            created_at=int(session.created_at),
            updated_at=int(session.updated_at),
            version=session.version,
            num_messages=session.num_messages,
            metadata=session.metadata,
        )


class SessionWithMessages(SessionObject):
    messages: list[SessionMessage]


class SessionList(BaseModel):
    object: Literal["list"] = "list"
    data: list[SessionObject]


class SessionDeleted(BaseModel):
    id: str
    object: Literal["session.deleted"] = "session.deleted"
    deleted: bool = True
