"""The embedded `SessionStore`: one SQLite file, the default on a single machine.

Schema (PRAGMA user_version = 1):

    sessions(id TEXT PRIMARY KEY, api_key_hash TEXT NULL, created_at REAL, updated_at REAL,
             version INTEGER, metadata TEXT (JSON), ttl_s REAL NULL, expires_at REAL NULL,
             num_messages INTEGER)
    messages(session_id TEXT REFERENCES sessions ON DELETE CASCADE, seq INTEGER, body TEXT,
             PRIMARY KEY (session_id, seq))
    responses(id TEXT PRIMARY KEY, api_key_hash TEXT NULL, status TEXT, doc TEXT (JSON),
              expires_at REAL NULL)

`seq` runs 0.. per session, so a turn's messages are adjacent by construction. An append is one
`BEGIN IMMEDIATE` transaction (read version, insert rows, bump version and expiry), which
serializes writers across threads and processes. Expired rows read as missing and are deleted
by a sweep that runs at most every `sweep_interval_s`, piggybacked on writes.

All SQLite calls run on one dedicated thread that owns the connection, so the event loop never
blocks on disk and the connection is never shared between threads.
"""

from __future__ import annotations

import builtins
import json
import os
import sqlite3
import time
import uuid
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, TypeVar

from duet.session_store.base import (
    DEFAULT_SESSION_TTL_S,
    Session,
    SessionConflict,
    SessionNotFound,
    SessionStore,
    StoredResponse,
    encode_messages,
    encode_metadata,
    hash_api_key,
    resolve_ttl,
    validate_expected_version,
)
from duet.session_store.sqlite_client import SqliteThread, transaction

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    api_key_hash TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    version INTEGER NOT NULL,
    metadata TEXT NOT NULL,
    ttl_s REAL,
    expires_at REAL,
    num_messages INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS sessions_by_key ON sessions (api_key_hash, created_at);
CREATE INDEX IF NOT EXISTS sessions_by_expiry ON sessions (expires_at);
CREATE TABLE IF NOT EXISTS messages (
    session_id TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
    seq INTEGER NOT NULL,
    body TEXT NOT NULL,
    PRIMARY KEY (session_id, seq)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    api_key_hash TEXT,
    status TEXT NOT NULL,
    doc TEXT NOT NULL,
    expires_at REAL
);
CREATE INDEX IF NOT EXISTS responses_by_expiry ON responses (expires_at);
PRAGMA user_version = 1;
"""

_SESSION_COLUMNS = "id, api_key_hash, created_at, updated_at, version, metadata, num_messages"
_LIVE = "(expires_at IS NULL OR expires_at > ?)"


def default_sqlite_path() -> Path:
    """`$XDG_DATA_HOME/duet/sessions.db`, else `~/.local/share/duet/sessions.db`."""
    data_home = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data_home) / "duet" / "sessions.db"


def _row_to_session(row: tuple[Any, ...]) -> Session:
    sid, key_hash, created_at, updated_at, version, metadata, num_messages = row
    return Session(
        id=sid,
        api_key_hash=key_hash,
        created_at=created_at,
        updated_at=updated_at,
        version=version,
        metadata=json.loads(metadata),
        num_messages=num_messages,
    )


class SqliteSessionStore(SessionStore):
    """Sessions in an SQLite file; history survives restarts of the process.

    Several stores (threads or processes) may open the same file: writes serialize on SQLite's
    lock, waiting at most `busy_timeout_s`, then raise `SessionStoreUnavailable`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        default_ttl_s: float | None = DEFAULT_SESSION_TTL_S,
        busy_timeout_s: float = 2.0,
        op_timeout_s: float = 5.0,
        sweep_interval_s: float = 60.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = Path(path) if path is not None else default_sqlite_path()
        self.default_ttl_s = resolve_ttl(None, default_ttl_s)
        self.busy_timeout_s = busy_timeout_s
        self.op_timeout_s = op_timeout_s
        self.sweep_interval_s = sweep_interval_s
        self._clock = clock
        self._last_sweep = float("-inf")
        self._closed = False
        self._db = SqliteThread(
            "session store", self.path, _SCHEMA, busy_timeout_s=busy_timeout_s,
            op_timeout_s=op_timeout_s, thread_name_prefix="duet-sqlite", foreign_keys=True,
        )  # fmt: skip

    # --- plumbing: everything below `_run` executes on the store's own thread ---

    async def _run(self, op: str, fn: Callable[[sqlite3.Connection], T]) -> T:
        if self._closed:
            raise RuntimeError("SqliteSessionStore is closed")
        return await self._db.run(op, fn)

    def _write(self, conn: sqlite3.Connection, body: Callable[[sqlite3.Connection], T]) -> T:
        def swept(conn: sqlite3.Connection) -> T:
            result = body(conn)
            self._maybe_sweep(conn)
            return result

        return transaction(conn, swept)

    def _maybe_sweep(self, conn: sqlite3.Connection) -> None:
        now = self._clock()
        if now - self._last_sweep >= self.sweep_interval_s:
            self._last_sweep = now
            conn.execute("DELETE FROM sessions WHERE expires_at <= ?", (now,))
            conn.execute("DELETE FROM responses WHERE expires_at <= ?", (now,))

    # --- the SessionStore API ---

    async def create(
        self,
        api_key: str | None,
        metadata: dict[str, Any] | None = None,
        ttl_s: float | None = None,
    ) -> Session:
        ttl = resolve_ttl(ttl_s, self.default_ttl_s)
        metadata_json = encode_metadata(metadata)
        session_id = uuid.uuid4().hex
        key_hash = hash_api_key(api_key)

        def body(conn: sqlite3.Connection) -> Session:
            now = self._clock()
            expires_at = None if ttl is None else now + ttl
            conn.execute(
                "INSERT INTO sessions VALUES (?, ?, ?, ?, 0, ?, ?, ?, 0)",
                (session_id, key_hash, now, now, metadata_json, ttl, expires_at),
            )
            return Session(session_id, key_hash, now, now, 0, json.loads(metadata_json), 0)

        return await self._run("create", lambda conn: self._write(conn, body))

    async def get(self, session_id: str) -> Session:
        def body(conn: sqlite3.Connection) -> Session:
            row = conn.execute(
                f"SELECT {_SESSION_COLUMNS} FROM sessions WHERE id = ? AND {_LIVE}",
                (session_id, self._clock()),
            ).fetchone()
            if row is None:
                raise SessionNotFound(session_id)
            return _row_to_session(row)

        return await self._run("get", body)

    async def append_turn(
        self,
        session_id: str,
        messages: builtins.list[dict[str, Any]],
        expected_version: int | None = None,
    ) -> int:
        validate_expected_version(expected_version)
        bodies = encode_messages(messages)

        def body(conn: sqlite3.Connection) -> int:
            now = self._clock()
            row = conn.execute(
                f"SELECT version, num_messages, ttl_s FROM sessions WHERE id = ? AND {_LIVE}",
                (session_id, now),
            ).fetchone()
            if row is None:
                raise SessionNotFound(session_id)
            version, num_messages, ttl = row
            if expected_version is not None and expected_version != version:
                raise SessionConflict(session_id, expected_version, version)
            conn.executemany(
                "INSERT INTO messages VALUES (?, ?, ?)",
                [(session_id, num_messages + i, b) for i, b in enumerate(bodies)],
            )
            conn.execute(
                "UPDATE sessions SET version = ?, num_messages = ?, updated_at = ?, expires_at = ?"
                " WHERE id = ?",
                (
                    version + 1,
                    num_messages + len(bodies),
                    now,
                    None if ttl is None else now + ttl,
                    session_id,
                ),
            )
            return int(version) + 1

        return await self._run("append_turn", lambda conn: self._write(conn, body))

    async def history(self, session_id: str) -> builtins.list[dict[str, Any]]:
        def body(conn: sqlite3.Connection) -> builtins.list[dict[str, Any]]:
            # One read transaction, so the existence check and the rows agree.
            conn.execute("BEGIN")
            try:
                live = conn.execute(
                    f"SELECT 1 FROM sessions WHERE id = ? AND {_LIVE}", (session_id, self._clock())
                ).fetchone()
                if live is None:
                    raise SessionNotFound(session_id)
                rows = conn.execute(
                    "SELECT body FROM messages WHERE session_id = ? ORDER BY seq", (session_id,)
                ).fetchall()
            finally:
                conn.execute("COMMIT")
            return [json.loads(b) for (b,) in rows]

        return await self._run("history", body)

    async def delete(self, session_id: str) -> bool:
        def body(conn: sqlite3.Connection) -> bool:
            live = conn.execute(
                f"SELECT 1 FROM sessions WHERE id = ? AND {_LIVE}", (session_id, self._clock())
            ).fetchone()
            conn.execute("DELETE FROM sessions WHERE id = ?", (session_id,))
            return live is not None

        return await self._run("delete", lambda conn: self._write(conn, body))

    async def list(self, api_key: str | None) -> builtins.list[Session]:
        key_hash = hash_api_key(api_key)

        def body(conn: sqlite3.Connection) -> builtins.list[Session]:
            rows = conn.execute(
                f"SELECT {_SESSION_COLUMNS} FROM sessions WHERE api_key_hash IS ? AND {_LIVE}"
                " ORDER BY created_at, id",
                (key_hash, self._clock()),
            ).fetchall()
            return [_row_to_session(row) for row in rows]

        return await self._run("list", body)

    # --- stored responses ---

    async def put_response(
        self,
        response_id: str,
        api_key_hash: str | None,
        status: str,
        doc: dict[str, Any],
        only_from: Collection[str] | None = None,
    ) -> bool:
        doc_json = json.dumps(doc, separators=(",", ":"))
        key_hash = api_key_hash

        def body(conn: sqlite3.Connection) -> bool:
            now = self._clock()
            if only_from is not None:
                row = conn.execute(
                    f"SELECT status FROM responses WHERE id = ? AND {_LIVE}", (response_id, now)
                ).fetchone()
                if row is None or row[0] not in only_from:
                    return False
            expires_at = None if self.default_ttl_s is None else now + self.default_ttl_s
            conn.execute(
                "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?)",
                (response_id, key_hash, status, doc_json, expires_at),
            )
            return True

        return await self._run("put_response", lambda conn: self._write(conn, body))

    async def get_response(self, response_id: str) -> StoredResponse | None:
        def body(conn: sqlite3.Connection) -> StoredResponse | None:
            row = conn.execute(
                f"SELECT api_key_hash, status, doc FROM responses WHERE id = ? AND {_LIVE}",
                (response_id, self._clock()),
            ).fetchone()
            if row is None:
                return None
            return StoredResponse(response_id, row[0], row[1], json.loads(row[2]))

        return await self._run("get_response", body)

    async def delete_response(self, response_id: str) -> bool:
        def body(conn: sqlite3.Connection) -> bool:
            live = conn.execute(
                f"SELECT 1 FROM responses WHERE id = ? AND {_LIVE}", (response_id, self._clock())
            ).fetchone()
            conn.execute("DELETE FROM responses WHERE id = ?", (response_id,))
            return live is not None

        return await self._run("delete_response", lambda conn: self._write(conn, body))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._db.close()
