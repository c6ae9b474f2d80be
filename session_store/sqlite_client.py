"""One way to use an SQLite file for duet (the embedded session store and work queue), and one
way to bound and classify its failures: the counterpart of `redis_client.py`.

All SQLite calls of a `SqliteThread` run on one thread of its own that opens the connection on
first use and alone uses it, so the event loop never blocks on disk and the connection is never
shared between threads. A call that fails on the disk or the database, or outlasts its
deadline, raises `SessionStoreUnavailable`; a mistake in the caller's SQL propagates as is.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from duet.session_store.base import SessionStoreUnavailable

T = TypeVar("T")


class SqliteThread:
    """The connection to the SQLite file at `path` (`:memory:` too) and the thread that uses it.

    The connection is opened in WAL mode, with `foreign_keys` on when asked, and `schema` (an
    idempotent script) run on it. Errors name the operation as `f"{what} {op}"`.
    """

    def __init__(
        self,
        what: str,
        path: Path,
        schema: str,
        *,
        busy_timeout_s: float,
        op_timeout_s: float,
        thread_name_prefix: str,
        foreign_keys: bool = False,
    ) -> None:
        self.what = what
        self.path = path
        self.schema = schema
        self.busy_timeout_s = busy_timeout_s
        self.op_timeout_s = op_timeout_s
        self.foreign_keys = foreign_keys
        self._conn: sqlite3.Connection | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name_prefix)

    async def run(self, op: str, fn: Callable[[sqlite3.Connection], T]) -> T:
        """`fn(connection)` on the thread, within `op_timeout_s`."""
        future = asyncio.get_running_loop().run_in_executor(
            self._executor, lambda: fn(self._connection())
        )
        try:
            # NOTE: a timed-out call keeps running on the thread (threads cannot be cancelled);
            # its outcome is unknown to the caller, as with any lost reply.
            return await asyncio.wait_for(future, self.op_timeout_s)
        except TimeoutError as e:
            raise SessionStoreUnavailable(
                f"{self.what} {op} timed out after {self.op_timeout_s}s ({self.path})"
            ) from e
        except (sqlite3.IntegrityError, sqlite3.ProgrammingError, sqlite3.InterfaceError):
            raise
        except (sqlite3.DatabaseError, OSError) as e:
            raise SessionStoreUnavailable(f"{self.what} {op} failed ({self.path}): {e}") from e

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            if str(self.path) != ":memory:":
                self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, timeout=self.busy_timeout_s, isolation_level=None)
            try:
                conn.execute("PRAGMA journal_mode = WAL")
                # NOTE: WAL + NORMAL survives a process crash; only power loss may drop the
                # last few commits. FULL would fsync every write.
                conn.execute("PRAGMA synchronous = NORMAL")
                if self.foreign_keys:
                    conn.execute("PRAGMA foreign_keys = ON")
                conn.executescript(self.schema)
            except BaseException:
                conn.close()
                raise
            self._conn = conn
        return self._conn

    async def close(self) -> None:
        """Close the connection on its thread, and let the thread go."""

        def shutdown() -> None:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

        await asyncio.get_running_loop().run_in_executor(self._executor, shutdown)
        self._executor.shutdown(wait=False)


def transaction(conn: sqlite3.Connection, fn: Callable[[sqlite3.Connection], T]) -> T:
    """`fn(conn)` in one `BEGIN IMMEDIATE` transaction (writers serialize on SQLite's lock):
    committed when it returns, rolled back when it raises."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        result = fn(conn)
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
    return result
