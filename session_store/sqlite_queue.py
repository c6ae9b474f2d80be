"""The embedded `WorkQueue`: tables in an SQLite file (by default the session store's), so one
machine needs no Redis. Same contract as the Redis queue (session_store/work_queue.py).

Schema:

    queue_tasks(seq INTEGER PRIMARY KEY AUTOINCREMENT, queue, task_id, kind, payload (JSON),
                consumer NULL (NULL: claimable), lease_until REAL NULL, num_deliveries,
                reason NULL (why the last delivery failed))
    queue_results(task_id PRIMARY KEY, result (JSON))      -- INSERT OR IGNORE: one result
    queue_dead(seq INTEGER PRIMARY KEY AUTOINCREMENT, queue, task_id, kind, payload, reason,
               num_deliveries)
    queue_records(kind, id, doc (JSON), PRIMARY KEY (kind, id))
    queue_blobs(id PRIMARY KEY, data BLOB)
    queue_events(stream_id, offset, event, PRIMARY KEY (stream_id, offset))
    queue_event_logs(stream_id PRIMARY KEY, expires_at REAL)  -- `event_ttl_s` after the last
                                                              -- append; an expired log reads
                                                              -- as empty, and goes at an append
    queue_expiry(what, id, expires_at REAL, PRIMARY KEY (what, id))
        -- when a result ('result', task id), blob ('blob', id), dead letter ('dead', seq) or
        -- record ('record:<kind>', id) expires: past it, it reads as absent; writes delete a
        -- few expired ones each (rows written before this table existed never expire)

Each operation is one `BEGIN IMMEDIATE` transaction, so several router processes on one
machine may share the file: a result is stored and its task row deleted (acknowledged)
together. A task whose `lease_until` has passed is claimable by anyone.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from duet.session_store.sqlite_client import SqliteThread, transaction
from duet.session_store.sqlite_store import default_sqlite_path
from duet.session_store.work_queue import (
    DEFAULT_EVENT_TTL_S,
    DEFAULT_LEASE_S,
    DEFAULT_MAX_DELIVERIES,
    DEFAULT_RETENTION_S,
    PURGE_PER_WRITE,
    DeadLetter,
    Delivery,
    Task,
    WorkQueue,
    dead_letter_result,
    dumps,
    expired_reason,
    validate_queue_limits,
)

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS queue_tasks (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    queue TEXT NOT NULL,
    task_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    payload TEXT NOT NULL,
    consumer TEXT,
    lease_until REAL,
    num_deliveries INTEGER NOT NULL DEFAULT 0,
    reason TEXT
);
CREATE INDEX IF NOT EXISTS queue_tasks_by_lease ON queue_tasks (queue, consumer, lease_until);
CREATE TABLE IF NOT EXISTS queue_results (task_id TEXT PRIMARY KEY, result TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS queue_dead (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    queue TEXT NOT NULL,
    task_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    payload TEXT NOT NULL,
    reason TEXT NOT NULL,
    num_deliveries INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS queue_records (
    kind TEXT NOT NULL, id TEXT NOT NULL, doc TEXT NOT NULL, PRIMARY KEY (kind, id)
);
CREATE TABLE IF NOT EXISTS queue_blobs (id TEXT PRIMARY KEY, data BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS queue_events (
    stream_id TEXT NOT NULL, offset INTEGER NOT NULL, event TEXT NOT NULL,
    PRIMARY KEY (stream_id, offset)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS queue_event_logs (
    stream_id TEXT PRIMARY KEY, expires_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS queue_event_logs_by_expiry ON queue_event_logs (expires_at);
CREATE TABLE IF NOT EXISTS queue_expiry (
    what TEXT NOT NULL, id TEXT NOT NULL, expires_at REAL NOT NULL, PRIMARY KEY (what, id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS queue_expiry_by_time ON queue_expiry (expires_at);
"""

_EXPIRED = (
    "EXISTS (SELECT 1 FROM queue_expiry e WHERE e.what = ? AND e.id = {id} AND e.expires_at <= ?)"
)
"""SQL true when the thing (`what`, the column or `?` in {id}) has expired by the time `?`."""


class SqliteWorkQueue(WorkQueue):
    """A work queue in an SQLite file. All SQLite calls run on one thread of the queue's own."""

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        name: str = "work",
        lease_s: float = DEFAULT_LEASE_S,
        max_deliveries: int = DEFAULT_MAX_DELIVERIES,
        event_ttl_s: float = DEFAULT_EVENT_TTL_S,
        retention_s: float = DEFAULT_RETENTION_S,
        busy_timeout_s: float = 2.0,
        op_timeout_s: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        validate_queue_limits(lease_s, max_deliveries, event_ttl_s, retention_s)
        self.path = Path(path) if path is not None else default_sqlite_path()
        self.name = name
        self.lease_s = lease_s
        self.max_deliveries = max_deliveries
        self.event_ttl_s = event_ttl_s
        self.retention_s = retention_s
        self.busy_timeout_s = busy_timeout_s
        self.op_timeout_s = op_timeout_s
        self._clock = clock
        self._closed = False
        self._db = SqliteThread(
            "work queue", self.path, _SCHEMA, busy_timeout_s=busy_timeout_s,
            op_timeout_s=op_timeout_s, thread_name_prefix="duet-queue",
        )  # fmt: skip
        self._views: list[SqliteWorkQueue] = []

    def queue_named(self, name: str) -> SqliteWorkQueue:
        view = SqliteWorkQueue(
            self.path,
            name=name,
            lease_s=self.lease_s,
            max_deliveries=self.max_deliveries,
            event_ttl_s=self.event_ttl_s,
            retention_s=self.retention_s,
            busy_timeout_s=self.busy_timeout_s,
            op_timeout_s=self.op_timeout_s,
            clock=self._clock,
        )
        self._views.append(view)
        return view

    async def _run(self, op: str, fn: Callable[[sqlite3.Connection], T], write: bool) -> T:
        if self._closed:
            raise RuntimeError("SqliteWorkQueue is closed")
        body = (lambda conn: transaction(conn, fn)) if write else fn
        return await self._db.run(op, body)

    def _bury(self, conn: sqlite3.Connection, seq: int, reason: str) -> None:
        """Dead-letter the task in row `seq`; its result becomes the dead-letter error."""
        task_id, kind, payload, n = conn.execute(
            "SELECT task_id, kind, payload, num_deliveries FROM queue_tasks WHERE seq = ?", (seq,)
        ).fetchone()
        cur = conn.execute(
            "INSERT INTO queue_dead (queue, task_id, kind, payload, reason, num_deliveries)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            (self.name, task_id, kind, payload, reason, n),
        )
        now = self._clock()
        self._expire_at(conn, "dead", str(cur.lastrowid), now + self.retention_s)
        self._store_result(conn, task_id, dumps(dead_letter_result(reason)), now)
        conn.execute("DELETE FROM queue_tasks WHERE seq = ?", (seq,))

    # --- expiry (the queue_expiry table) ---

    @staticmethod
    def _expire_at(conn: sqlite3.Connection, what: str, thing_id: str, at: float) -> None:
        conn.execute(
            "INSERT INTO queue_expiry VALUES (?, ?, ?) ON CONFLICT (what, id) "
            "DO UPDATE SET expires_at = excluded.expires_at",
            (what, thing_id, at),
        )

    @staticmethod
    def _drop(conn: sqlite3.Connection, what: str, thing_id: str) -> bool:
        """Delete the thing and its expiry; True if the thing was there."""
        if what == "result":
            cur = conn.execute("DELETE FROM queue_results WHERE task_id = ?", (thing_id,))
        elif what == "blob":
            cur = conn.execute("DELETE FROM queue_blobs WHERE id = ?", (thing_id,))
        elif what == "dead":
            cur = conn.execute("DELETE FROM queue_dead WHERE seq = ?", (int(thing_id),))
        else:
            kind = what.removeprefix("record:")
            cur = conn.execute(
                "DELETE FROM queue_records WHERE kind = ? AND id = ?", (kind, thing_id)
            )
        conn.execute("DELETE FROM queue_expiry WHERE what = ? AND id = ?", (what, thing_id))
        return cur.rowcount > 0

    def _purge(self, conn: sqlite3.Connection, now: float) -> None:
        """Delete up to PURGE_PER_WRITE expired things, oldest expiry first."""
        rows = conn.execute(
            "SELECT what, id FROM queue_expiry WHERE expires_at <= ? ORDER BY expires_at LIMIT ?",
            (now, PURGE_PER_WRITE),
        ).fetchall()
        for what, thing_id in rows:
            self._drop(conn, what, thing_id)

    @staticmethod
    def _expired(conn: sqlite3.Connection, what: str, thing_id: str, now: float) -> bool:
        row = conn.execute(
            "SELECT 1 FROM queue_expiry WHERE what = ? AND id = ? AND expires_at <= ?",
            (what, thing_id, now),
        ).fetchone()
        return row is not None

    def _store_result(
        self, conn: sqlite3.Connection, task_id: str, result: str, now: float
    ) -> bool:
        """Store the task's result unless it has a live one; True if this stored it."""
        if self._expired(conn, "result", task_id, now):
            self._drop(conn, "result", task_id)
        cur = conn.execute("INSERT OR IGNORE INTO queue_results VALUES (?, ?)", (task_id, result))
        if cur.rowcount != 1:
            return False
        self._expire_at(conn, "result", task_id, now + self.retention_s)
        return True

    def _expiry(self, expires_at: float | None, now: float) -> float:
        return now + self.retention_s if expires_at is None else expires_at

    async def enqueue(
        self,
        tasks: list[Task],
        results: dict[str, dict[str, Any]] | None = None,
        record: tuple[str, str, dict[str, Any]] | None = None,
    ) -> None:
        rows = [(self.name, t.task_id, t.kind, dumps(t.payload)) for t in tasks]
        done = [(k, dumps(v)) for k, v in (results or {}).items()]

        def body(conn: sqlite3.Connection) -> None:
            now = self._clock()
            self._purge(conn, now)
            conn.executemany(
                "INSERT INTO queue_tasks (queue, task_id, kind, payload) VALUES (?, ?, ?, ?)",
                rows,
            )
            for task_id, result in done:
                self._store_result(conn, task_id, result, now)
            if record is not None:
                kind, record_id, doc = record
                self._put_record(conn, kind, record_id, dumps(doc), now + self.retention_s)

        await self._run("enqueue", body, write=True)

    async def claim(self, consumer: str, max_tasks: int = 1) -> list[Delivery]:
        if max_tasks < 1:
            raise ValueError(f"max_tasks: must be >= 1; got {max_tasks}")

        def body(conn: sqlite3.Connection) -> list[Delivery]:
            now = self._clock()
            taken: list[Delivery] = []
            # Expired leases first (their consumer died), then claimable rows, oldest first.
            rows = conn.execute(
                "SELECT seq, task_id, kind, payload, num_deliveries, reason FROM queue_tasks"
                " WHERE queue = ? AND (consumer IS NULL OR lease_until <= ?)"
                " ORDER BY consumer IS NULL, seq LIMIT ?",
                # Rows skipped below (already done, dead) are deleted: the next claim goes on.
                (self.name, now, 2 * max_tasks + 8),
            )
            for seq, task_id, kind, payload, n, reason in rows.fetchall():
                if len(taken) == max_tasks:
                    break
                has_result = conn.execute(
                    "SELECT 1 FROM queue_results WHERE task_id = ?", (task_id,)
                ).fetchone()
                if has_result:
                    conn.execute("DELETE FROM queue_tasks WHERE seq = ?", (seq,))
                elif n >= self.max_deliveries:
                    self._bury(conn, seq, reason or expired_reason(n))
                else:
                    conn.execute(
                        "UPDATE queue_tasks SET consumer = ?, lease_until = ?,"
                        " num_deliveries = ? WHERE seq = ?",
                        (consumer, now + self.lease_s, n + 1, seq),
                    )
                    payload_doc = json.loads(payload)
                    taken.append(Delivery(task_id, kind, payload_doc, str(seq), consumer, n + 1))
            return taken

        return await self._run("claim", body, write=True)

    async def renew(self, delivery: Delivery) -> bool:
        def body(conn: sqlite3.Connection) -> bool:
            cur = conn.execute(
                "UPDATE queue_tasks SET lease_until = ? WHERE seq = ? AND consumer = ?",
                (self._clock() + self.lease_s, int(delivery.handle), delivery.consumer),
            )
            return cur.rowcount == 1

        return await self._run("renew", body, write=True)

    async def complete(self, delivery: Delivery, result: dict[str, Any]) -> bool:
        def body(conn: sqlite3.Connection) -> bool:
            now = self._clock()
            self._purge(conn, now)
            stored = self._store_result(conn, delivery.task_id, dumps(result), now)
            conn.execute("DELETE FROM queue_tasks WHERE seq = ?", (int(delivery.handle),))
            return stored

        return await self._run("complete", body, write=True)

    async def fail(self, delivery: Delivery, reason: str) -> bool:
        def body(conn: sqlite3.Connection) -> bool:
            seq = int(delivery.handle)
            row = conn.execute("SELECT 1 FROM queue_tasks WHERE seq = ?", (seq,)).fetchone()
            if row is None:
                return False  # completed or dead-lettered meanwhile
            if delivery.num_deliveries >= self.max_deliveries:
                conn.execute("UPDATE queue_tasks SET reason = ? WHERE seq = ?", (reason, seq))
                self._bury(conn, seq, reason)
                return True
            conn.execute(
                "UPDATE queue_tasks SET consumer = NULL, lease_until = NULL, reason = ?"
                " WHERE seq = ?",
                (reason, seq),
            )
            return False

        return await self._run("fail", body, write=True)

    async def results(self, task_ids: list[str]) -> list[dict[str, Any] | None]:
        def body(conn: sqlite3.Connection) -> list[dict[str, Any] | None]:
            now = self._clock()
            found: dict[str, str] = {}
            for start in range(0, len(task_ids), 500):
                chunk = task_ids[start : start + 500]
                marks = ",".join("?" * len(chunk))
                expired = _EXPIRED.format(id="r.task_id")
                found.update(
                    conn.execute(
                        f"SELECT task_id, result FROM queue_results r WHERE task_id IN ({marks})"
                        f" AND NOT {expired}",
                        [*chunk, "result", now],
                    ).fetchall()
                )
            return [json.loads(found[t]) if t in found else None for t in task_ids]

        return await self._run("results", body, write=False)

    async def dead_letters(self) -> list[DeadLetter]:
        def body(conn: sqlite3.Connection) -> list[DeadLetter]:
            expired = _EXPIRED.format(id="CAST(d.seq AS TEXT)")
            rows = conn.execute(
                "SELECT task_id, kind, payload, reason, num_deliveries FROM queue_dead d"
                f" WHERE queue = ? AND NOT {expired} ORDER BY seq",
                (self.name, "dead", self._clock()),
            ).fetchall()
            return [DeadLetter(t, k, json.loads(p), r, n) for t, k, p, r, n in rows]

        return await self._run("dead_letters", body, write=False)

    async def num_pending(self) -> int:
        def body(conn: sqlite3.Connection) -> int:
            row = conn.execute("SELECT COUNT(*) FROM queue_tasks WHERE queue = ?", (self.name,))
            return int(row.fetchone()[0])

        return await self._run("num_pending", body, write=False)

    def _put_record(
        self, conn: sqlite3.Connection, kind: str, record_id: str, doc: str, at: float
    ) -> None:
        conn.execute(
            "INSERT OR REPLACE INTO queue_records VALUES (?, ?, ?)", (kind, record_id, doc)
        )
        self._expire_at(conn, f"record:{kind}", record_id, at)

    async def put_record(
        self, kind: str, record_id: str, doc: dict[str, Any], expires_at: float | None = None
    ) -> None:
        def body(conn: sqlite3.Connection) -> None:
            now = self._clock()
            self._purge(conn, now)
            self._put_record(conn, kind, record_id, dumps(doc), self._expiry(expires_at, now))

        await self._run("put_record", body, write=True)

    async def get_record(self, kind: str, record_id: str) -> dict[str, Any] | None:
        def body(conn: sqlite3.Connection) -> dict[str, Any] | None:
            row = conn.execute(
                "SELECT doc FROM queue_records r WHERE kind = ? AND id = ?"
                f" AND NOT {_EXPIRED.format(id='r.id')}",
                (kind, record_id, f"record:{kind}", self._clock()),
            ).fetchone()
            return None if row is None else dict(json.loads(row[0]))

        return await self._run("get_record", body, write=False)

    async def list_records(self, kind: str) -> list[dict[str, Any]]:
        def body(conn: sqlite3.Connection) -> list[dict[str, Any]]:
            rows = conn.execute(
                f"SELECT doc FROM queue_records r WHERE kind = ? AND NOT {_EXPIRED.format(id='r.id')}",
                (kind, f"record:{kind}", self._clock()),
            )
            return [json.loads(doc) for (doc,) in rows.fetchall()]

        return await self._run("list_records", body, write=False)

    async def delete_record(self, kind: str, record_id: str) -> bool:
        def body(conn: sqlite3.Connection) -> bool:
            what = f"record:{kind}"
            live = not self._expired(conn, what, record_id, self._clock())
            return self._drop(conn, what, record_id) and live

        return await self._run("delete_record", body, write=True)

    async def put_blob(self, blob_id: str, data: bytes, expires_at: float | None = None) -> None:
        def body(conn: sqlite3.Connection) -> None:
            now = self._clock()
            self._purge(conn, now)
            conn.execute("INSERT OR REPLACE INTO queue_blobs VALUES (?, ?)", (blob_id, data))
            self._expire_at(conn, "blob", blob_id, self._expiry(expires_at, now))

        await self._run("put_blob", body, write=True)

    async def get_blob(self, blob_id: str) -> bytes | None:
        def body(conn: sqlite3.Connection) -> bytes | None:
            row = conn.execute(
                f"SELECT data FROM queue_blobs b WHERE id = ? AND NOT {_EXPIRED.format(id='b.id')}",
                (blob_id, "blob", self._clock()),
            ).fetchone()
            return None if row is None else bytes(row[0])

        return await self._run("get_blob", body, write=False)

    async def delete_blob(self, blob_id: str) -> None:
        def body(conn: sqlite3.Connection) -> None:
            self._drop(conn, "blob", blob_id)

        await self._run("delete_blob", body, write=True)

    async def append_events(self, stream_id: str, offset: int, events: list[str]) -> int:
        def body(conn: sqlite3.Connection) -> int:
            now = self._clock()
            expired = {sid for (sid,) in conn.execute(
                "SELECT stream_id FROM queue_event_logs WHERE expires_at <= ? LIMIT ?",
                (now, PURGE_PER_WRITE),
            ).fetchall()}  # fmt: skip
            expired.update(sid for (sid,) in conn.execute(  # this log, if it is gone
                "SELECT stream_id FROM queue_event_logs WHERE stream_id = ? AND expires_at <= ?",
                (stream_id, now),
            ).fetchall())  # fmt: skip
            for sid in expired:
                conn.execute("DELETE FROM queue_events WHERE stream_id = ?", (sid,))
                conn.execute("DELETE FROM queue_event_logs WHERE stream_id = ?", (sid,))
            (n,) = conn.execute(
                "SELECT COUNT(*) FROM queue_events WHERE stream_id = ?", (stream_id,)
            ).fetchone()
            if offset > n:
                raise ValueError(f"offset: {offset} is past the end of event log {stream_id!r}")
            new = [(stream_id, offset + i, e) for i, e in enumerate(events) if offset + i >= n]
            conn.executemany("INSERT INTO queue_events VALUES (?, ?, ?)", new)
            if n or new:
                conn.execute(
                    "INSERT INTO queue_event_logs VALUES (?, ?) ON CONFLICT (stream_id) "
                    "DO UPDATE SET expires_at = excluded.expires_at",
                    (stream_id, now + self.event_ttl_s),
                )
            return int(n) + len(new)

        return await self._run("append_events", body, write=True)

    async def read_events(self, stream_id: str, offset: int, max_events: int) -> list[str]:
        def body(conn: sqlite3.Connection) -> list[str]:
            rows = conn.execute(
                "SELECT event FROM queue_events WHERE stream_id = ? AND offset >= ?"
                " AND NOT EXISTS (SELECT 1 FROM queue_event_logs l WHERE l.stream_id = ?"
                " AND l.expires_at <= ?) ORDER BY offset LIMIT ?",
                (stream_id, offset, stream_id, self._clock(), max_events),
            )
            return [e for (e,) in rows.fetchall()]

        return await self._run("read_events", body, write=False)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for view in self._views:
            await view.close()
        await self._db.close()
