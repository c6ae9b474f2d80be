"""The production `WorkQueue`: Redis Streams with one consumer group shared by every router.

Key layout (`<prefix>` is `duet` unless configured, `<name>` is the queue's name: `work` for
batches, `background` for background requests):

    <prefix>:queue:<name>:stream    stream  one entry per task: task_id, kind, payload (JSON);
                                            consumer group `routers`; an entry is XACKed and
                                            XDELed in the script that stores its result
    <prefix>:queue:results          hash    task_id -> result (JSON), for every queue name;
                                            written with HSETNX, so a task has one result
                                            however often it is delivered
    <prefix>:queue:results:expiry   zset    task_id scored by when its result expires (ms)
    <prefix>:queue:<name>:reasons   hash    task_id -> why its last delivery failed
    <prefix>:queue:<name>:dead      stream  dead letters: task_id, kind, payload, reason,
                                            num_deliveries; trimmed (MINID) to the last
                                            `retention_s` at each burial
    <prefix>:records:<kind>         hash    record id -> JSON document (files, batches)
    <prefix>:records:<kind>:expiry  zset    record id scored by when it expires (ms)
    <prefix>:blob:<id>              string  a file's bytes; expires by itself (PXAT)
    <prefix>:events:<id>            list    an event log (entry i is offset i); expires
                                            `event_ttl_s` after its last append

Claim, renew, complete and fail are Lua scripts, so each is atomic: a result is stored and its
entry acknowledged in one step. A claim first takes over entries idle longer than the lease
(`XAUTOCLAIM`, which also counts the delivery), dead-letters those delivered `max_deliveries`
times already, then reads new entries (`XREADGROUP ... >`). Durability is Redis's: run it
with `appendonly yes` (`appendfsync always` keeps every acknowledged write across a crash).

Expiry (Redis 7.0 has no per-field expiry in a hash) is a sorted set beside each hash: reads
leave out members whose time has passed (by Redis's clock, `TIME`), and each write deletes up
to `PURGE_PER_WRITE` expired members of its hash.
"""

from __future__ import annotations

import json
from typing import Any, cast

import redis.asyncio as aioredis
import redis.exceptions as redis_errors

from duet.session_store.redis_client import RedisGuard, connect_redis
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
    dumps,
    validate_queue_limits,
)

GROUP = "routers"

# Shared (KEYS: stream, results, reasons, dead, results' expiry).
_LUA_PRELUDE = (
    """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- Delete the expired members (at most a few) of a hash and its expiry set.
local function purge(hash, expiry, now)
  local old = redis.call('ZRANGEBYSCORE', expiry, '-inf', now, 'LIMIT', 0, """
    + str(PURGE_PER_WRITE)
    + """)
  if #old > 0 then
    redis.call('HDEL', hash, unpack(old))
    redis.call('ZREM', expiry, unpack(old))
  end
end
-- Whether the member's time has passed (a member with no expiry never expires).
local function expired(expiry, id, now)
  local at = redis.call('ZSCORE', expiry, id)
  return at and tonumber(at) <= now
end
-- Store the task's result unless it has a live one; 1 if this stored it.
local function store_result(task_id, value, now, retention_ms)
  if expired(KEYS[5], task_id, now) then
    redis.call('HDEL', KEYS[2], task_id)
    redis.call('ZREM', KEYS[5], task_id)
  end
  local stored = redis.call('HSETNX', KEYS[2], task_id, value)
  if stored == 1 then redis.call('ZADD', KEYS[5], now + retention_ms, task_id) end
  return stored
end
-- Put one record (hash, its expiry set) living until `at`, after purging a few expired ones.
local function put_record(hash, expiry, id, doc, at, now)
  purge(hash, expiry, now)
  redis.call('HSET', hash, id, doc)
  redis.call('ZADD', expiry, at, id)
end
-- Dead-letter one pending entry; dead letters older than the retention go.
local function bury(id, task_id, kind, payload, n, reason, retention_ms)
  local now = now_ms()
  redis.call('XADD', KEYS[4], '*', 'task_id', task_id, 'kind', kind, 'payload', payload,
             'reason', reason, 'num_deliveries', n)
  redis.call('XTRIM', KEYS[4], 'MINID', now - retention_ms)
  local err = cjson.encode({error = {code = 'dead_letter', message = reason}})
  store_result(task_id, err, now, retention_ms)
  redis.call('HDEL', KEYS[3], task_id)
  redis.call('XACK', KEYS[1], ARGV[1], id)
  redis.call('XDEL', KEYS[1], id)
end
local function field(fields, name)
  for i = 1, #fields, 2 do if fields[i] == name then return fields[i + 1] end end
  return ''
end
"""
)

# ARGV: group, consumer, lease_ms, max_tasks, max_deliveries, XAUTOCLAIM cursor, retention_ms.
# Returns a flat list: next cursor, then id, task_id, kind, payload, num_deliveries, ...
_CLAIM = (
    _LUA_PRELUDE
    + """
local out = {}
local max_tasks = tonumber(ARGV[4])
local function take(id, fields, n)
  local task_id = field(fields, 'task_id')
  if redis.call('HEXISTS', KEYS[2], task_id) == 1 then
    -- Enqueued twice, or completed under another delivery: nothing left to run.
    redis.call('XACK', KEYS[1], ARGV[1], id)
    redis.call('XDEL', KEYS[1], id)
  elseif n > tonumber(ARGV[5]) then
    local reason = redis.call('HGET', KEYS[3], task_id)
    if not reason then
      reason = 'delivered ' .. (n - 1) .. ' times without a result (each consumer died or ' ..
               'let its lease expire)'
    end
    bury(id, task_id, field(fields, 'kind'), field(fields, 'payload'), n - 1, reason,
         tonumber(ARGV[7]))
  else
    for _, v in ipairs({id, task_id, field(fields, 'kind'), field(fields, 'payload'), n}) do
      table.insert(out, v)
    end
    return true
  end
  return false
end
local claimed = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[6],
                           'COUNT', max_tasks)
local num_taken = 0
for _, e in ipairs(claimed[2]) do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], e[1], e[1], 1)
  if take(e[1], e[2], tonumber(p[1][4])) then num_taken = num_taken + 1 end
end
if num_taken < max_tasks then
  local fresh = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT',
                           max_tasks - num_taken, 'STREAMS', KEYS[1], '>')
  if fresh then
    for _, e in ipairs(fresh[1][2]) do take(e[1], e[2], 1) end
  end
end
table.insert(out, 1, claimed[1])
return out
"""
)

# ARGV: group, id, consumer. Returns 1 if the lease was restarted.
_RENEW = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if #p == 0 or p[1][2] ~= ARGV[3] then return 0 end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0, ARGV[2], 'JUSTID')
return 1
"""

# ARGV: group, id, task_id, result, retention_ms. Returns 1 if this stored the result.
_COMPLETE = (
    _LUA_PRELUDE
    + """
local now = now_ms()
purge(KEYS[2], KEYS[5], now)
local stored = store_result(ARGV[3], ARGV[4], now, tonumber(ARGV[5]))
redis.call('HDEL', KEYS[3], ARGV[3])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
return stored
"""
)

# ARGV: group, id, task_id, kind, payload, num_deliveries, max_deliveries, reason, consumer,
# lease_ms, retention_ms. Returns 1 if dead-lettered.
_FAIL = (
    _LUA_PRELUDE
    + """
if tonumber(ARGV[6]) >= tonumber(ARGV[7]) then
  bury(ARGV[2], ARGV[3], ARGV[4], ARGV[5], tonumber(ARGV[6]), ARGV[8], tonumber(ARGV[11]))
  return 1
end
redis.call('HSET', KEYS[3], ARGV[3], ARGV[8])
-- Idle as long as a lease: the next claim by anyone takes it over at once.
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if #p == 1 then
  redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[9], 0, ARGV[2], 'IDLE', ARGV[10], 'JUSTID')
end
return 0
"""
)


# KEYS: the log. ARGV: offset, event 1, event 2, ... Returns the new length, or -1 for a gap.
_APPEND_EVENTS = """
local n = redis.call('LLEN', KEYS[1])
local offset = tonumber(ARGV[1])
if offset > n then return -1 end
local first = 3 + (n - offset)
for i = first, #ARGV, 1000 do
  redis.call('RPUSH', KEYS[1], unpack(ARGV, i, math.min(i + 999, #ARGV)))
end
local length = redis.call('LLEN', KEYS[1])
if length > 0 then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return length
"""


# KEYS: stream, results, reasons, dead, results' expiry[, record hash, record expiry].
# ARGV: group, retention_ms, number of tasks, (task_id, kind, payload) per task, number of
# results, (task_id, result) per result[, record id, record doc].
_ENQUEUE = (
    _LUA_PRELUDE
    + """
local now = now_ms()
local retention_ms = tonumber(ARGV[2])
purge(KEYS[2], KEYS[5], now)
local i = 4
for _ = 1, tonumber(ARGV[3]) do
  redis.call('XADD', KEYS[1], '*', 'task_id', ARGV[i], 'kind', ARGV[i + 1],
             'payload', ARGV[i + 2])
  i = i + 3
end
local num_results = tonumber(ARGV[i])
i = i + 1
for _ = 1, num_results do
  store_result(ARGV[i], ARGV[i + 1], now, retention_ms)  -- a task that has a result keeps it
  i = i + 2
end
if #KEYS == 7 then put_record(KEYS[6], KEYS[7], ARGV[i], ARGV[i + 1], now + retention_ms, now) end
return 0
"""
)

# KEYS: results, results' expiry. ARGV: task ids. Returns each live result or false.
_RESULTS = (
    _LUA_PRELUDE
    + """
local now = now_ms()
local out = {}
for i, task_id in ipairs(ARGV) do
  if expired(KEYS[2], task_id, now) then out[i] = false
  else out[i] = redis.call('HGET', KEYS[1], task_id) end
end
return out
"""
)

# KEYS: record hash, its expiry. ARGV: id, doc, expires at (ms; '' = retention_ms from now),
# retention_ms.
_PUT_RECORD = (
    _LUA_PRELUDE
    + """
local now = now_ms()
local at = now + tonumber(ARGV[4])
if ARGV[3] ~= '' then at = tonumber(ARGV[3]) end
put_record(KEYS[1], KEYS[2], ARGV[1], ARGV[2], at, now)
return 0
"""
)

# KEYS: record hash, its expiry. ARGV: id. The live record, or false.
_GET_RECORD = (
    _LUA_PRELUDE
    + """
if expired(KEYS[2], ARGV[1], now_ms()) then return false end
return redis.call('HGET', KEYS[1], ARGV[1])
"""
)

# KEYS: record hash, its expiry. Every live record.
_LIST_RECORDS = (
    _LUA_PRELUDE
    + """
local now = now_ms()
local all = redis.call('HGETALL', KEYS[1])
local out = {}
for i = 1, #all, 2 do
  if not expired(KEYS[2], all[i], now) then table.insert(out, all[i + 1]) end
end
return out
"""
)

# KEYS: record hash, its expiry. ARGV: id. 1 if a live record was deleted.
_DELETE_RECORD = (
    _LUA_PRELUDE
    + """
local gone = expired(KEYS[2], ARGV[1], now_ms())
local removed = redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
if gone then return 0 end
return removed
"""
)

# KEYS: dead letters. ARGV: retention_ms. Those stored in the last retention_ms, oldest first.
_DEAD_LETTERS = (
    _LUA_PRELUDE
    + """
return redis.call('XRANGE', KEYS[1], now_ms() - tonumber(ARGV[1]) + 1, '+')
"""
)


class RedisWorkQueue(WorkQueue):
    """A work queue on Redis Streams; survives Redis restarts (it reconnects per call).

    Build it with `from_url` or pass a client made by `connect_redis`; the queue owns the
    client and closes it.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        key_prefix: str = "duet",
        name: str = "work",
        lease_s: float = DEFAULT_LEASE_S,
        max_deliveries: int = DEFAULT_MAX_DELIVERIES,
        event_ttl_s: float = DEFAULT_EVENT_TTL_S,
        retention_s: float = DEFAULT_RETENTION_S,
        op_timeout_s: float = 2.5,
        owns_client: bool = True,
    ) -> None:
        validate_queue_limits(lease_s, max_deliveries, event_ttl_s, retention_s)
        self._client = client
        self._owns_client = owns_client
        self.name = name
        self._op_timeout_s = op_timeout_s
        self._guard = RedisGuard("work queue", op_timeout_s)
        self.key_prefix = key_prefix
        self.lease_s = lease_s
        self.max_deliveries = max_deliveries
        self.event_ttl_s = event_ttl_s
        self.retention_s = retention_s
        base = f"{key_prefix}:queue:{name}"
        self._stream = f"{base}:stream"
        self._results = f"{key_prefix}:queue:results"  # shared by every queue name
        self._reasons = f"{base}:reasons"
        self._dead = f"{base}:dead"
        self._results_expiry = f"{key_prefix}:queue:results:expiry"
        self._keys = [
            self._stream, self._results, self._reasons, self._dead, self._results_expiry,
        ]  # fmt: skip
        self._claim = client.register_script(_CLAIM)
        self._renew = client.register_script(_RENEW)
        self._complete = client.register_script(_COMPLETE)
        self._fail = client.register_script(_FAIL)
        self._append_events = client.register_script(_APPEND_EVENTS)
        self._enqueue = client.register_script(_ENQUEUE)
        self._results_script = client.register_script(_RESULTS)
        self._put_record = client.register_script(_PUT_RECORD)
        self._get_record = client.register_script(_GET_RECORD)
        self._list_records = client.register_script(_LIST_RECORDS)
        self._delete_record = client.register_script(_DELETE_RECORD)
        self._dead_letters = client.register_script(_DEAD_LETTERS)
        self._has_group = False
        self._cursor = "0-0"
        """Where the next XAUTOCLAIM scan of the pending entries starts (it wraps to 0-0)."""

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> RedisWorkQueue:
        return cls(connect_redis(url), **kwargs)

    def queue_named(self, name: str) -> RedisWorkQueue:
        return RedisWorkQueue(
            self._client,
            key_prefix=self.key_prefix,
            name=name,
            lease_s=self.lease_s,
            max_deliveries=self.max_deliveries,
            event_ttl_s=self.event_ttl_s,
            retention_s=self.retention_s,
            op_timeout_s=self._op_timeout_s,
            owns_client=False,  # a view on this queue's connection pool
        )

    @property
    def _lease_ms(self) -> int:
        return max(1, round(self.lease_s * 1000))

    @property
    def _retention_ms(self) -> int:
        return max(1, round(self.retention_s * 1000))

    async def _ensure_group(self) -> None:
        # NOTE: checked once per queue object, and again after NOGROUP (a Redis that lost its
        # data); the group starts at 0 so entries added before it existed are consumed too.
        if self._has_group:
            return
        try:
            await self._client.xgroup_create(self._stream, GROUP, id="0", mkstream=True)
        except redis_errors.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        self._has_group = True

    async def enqueue(
        self,
        tasks: list[Task],
        results: dict[str, dict[str, Any]] | None = None,
        record: tuple[str, str, dict[str, Any]] | None = None,
    ) -> None:
        args: list[str | int] = [GROUP, self._retention_ms, len(tasks)]
        for task in tasks:
            args += [task.task_id, task.kind, dumps(task.payload)]
        args.append(len(results or {}))
        for task_id, result in (results or {}).items():
            args += [task_id, dumps(result)]
        keys = list(self._keys)
        if record is not None:
            kind, record_id, doc = record
            keys += self._record_keys(kind)
            args += [record_id, dumps(doc)]

        async def write() -> None:
            await self._ensure_group()
            await self._enqueue(keys=keys, args=args)

        await self._guard.run("enqueue", write())

    async def claim(self, consumer: str, max_tasks: int = 1) -> list[Delivery]:
        if max_tasks < 1:
            raise ValueError(f"max_tasks: must be >= 1; got {max_tasks}")
        args: list[str | int] = [
            GROUP, consumer, self._lease_ms, max_tasks, self.max_deliveries, self._cursor,
            self._retention_ms,
        ]  # fmt: skip

        async def run() -> list[Any]:
            await self._ensure_group()
            try:
                return cast(list[Any], await self._claim(keys=self._keys, args=args))
            except redis_errors.ResponseError as e:
                if "NOGROUP" not in str(e):
                    raise
                self._has_group = False
                await self._ensure_group()
                return cast(list[Any], await self._claim(keys=self._keys, args=args))

        flat = await self._guard.run("claim", run())
        # NOTE: XAUTOCLAIM scans a bounded part of the pending entries per call; carrying its
        # cursor lets expired entries far down a long pending list be reached, not just the head.
        self._cursor, flat = flat[0], flat[1:]
        return [
            Delivery(
                task_id=flat[i + 1],
                kind=flat[i + 2],
                payload=json.loads(flat[i + 3]),
                handle=flat[i],
                consumer=consumer,
                num_deliveries=int(flat[i + 4]),
            )
            for i in range(0, len(flat), 5)
        ]

    async def renew(self, delivery: Delivery) -> bool:
        renewed = await self._guard.run(
            "renew",
            self._renew(keys=[self._stream], args=[GROUP, delivery.handle, delivery.consumer]),
        )
        return bool(renewed)

    async def complete(self, delivery: Delivery, result: dict[str, Any]) -> bool:
        stored = await self._guard.run(
            "complete",
            self._complete(
                keys=self._keys,
                args=[GROUP, delivery.handle, delivery.task_id, dumps(result), self._retention_ms],
            ),
        )
        return bool(stored)

    async def fail(self, delivery: Delivery, reason: str) -> bool:
        args: list[str | int] = [
            GROUP, delivery.handle, delivery.task_id, delivery.kind, dumps(delivery.payload),
            delivery.num_deliveries, self.max_deliveries, reason, delivery.consumer,
            self._lease_ms, self._retention_ms,
        ]  # fmt: skip
        buried = await self._guard.run("fail", self._fail(keys=self._keys, args=args))
        return bool(buried)

    async def results(self, task_ids: list[str]) -> list[dict[str, Any] | None]:
        if not task_ids:
            return []
        raw = await self._guard.run(
            "results",
            self._results_script(keys=[self._results, self._results_expiry], args=task_ids),
        )
        return [None if r is None else json.loads(r) for r in raw]

    async def dead_letters(self) -> list[DeadLetter]:
        raw = await self._guard.run(
            "dead_letters", self._dead_letters(keys=[self._dead], args=[self._retention_ms])
        )
        # decode_responses=True: every field and value is a str; a script's XRANGE reply is
        # each entry as [id, [field, value, field, value, ...]].
        entries = cast(list[tuple[str, list[str]]], raw)
        letters = []
        for _, flat in entries:
            f = dict(zip(flat[::2], flat[1::2], strict=True))
            letters.append(
                DeadLetter(
                    task_id=f["task_id"],
                    kind=f["kind"],
                    payload=json.loads(f["payload"]),
                    reason=f["reason"],
                    num_deliveries=int(f["num_deliveries"]),
                )
            )
        return letters

    async def num_pending(self) -> int:
        return int(await self._guard.run("num_pending", self._client.xlen(self._stream)))

    def _record_keys(self, kind: str) -> list[str]:
        """The hash of `kind`'s records and the sorted set of their expiries."""
        key = f"{self.key_prefix}:records:{kind}"
        return [key, f"{key}:expiry"]

    async def put_record(
        self, kind: str, record_id: str, doc: dict[str, Any], expires_at: float | None = None
    ) -> None:
        at = "" if expires_at is None else round(expires_at * 1000)
        args = [record_id, dumps(doc), at, self._retention_ms]
        await self._guard.run(
            "put_record", self._put_record(keys=self._record_keys(kind), args=args)
        )

    async def get_record(self, kind: str, record_id: str) -> dict[str, Any] | None:
        raw = await self._guard.run(
            "get_record", self._get_record(keys=self._record_keys(kind), args=[record_id])
        )
        return None if raw is None else cast(dict[str, Any], json.loads(raw))

    async def list_records(self, kind: str) -> list[dict[str, Any]]:
        raw = await self._guard.run(
            "list_records", self._list_records(keys=self._record_keys(kind))
        )
        return [json.loads(r) for r in raw]

    async def delete_record(self, kind: str, record_id: str) -> bool:
        removed = await self._guard.run(
            "delete_record", self._delete_record(keys=self._record_keys(kind), args=[record_id])
        )
        return int(removed) > 0

    async def put_blob(self, blob_id: str, data: bytes, expires_at: float | None = None) -> None:
        # NOTE: the client decodes replies as str, so blobs are stored as latin-1 text, which
        # maps every byte to one code point and back.
        key = f"{self.key_prefix}:blob:{blob_id}"
        text = data.decode("latin-1")
        if expires_at is None:
            write = self._client.set(key, text, px=self._retention_ms)
        else:
            write = self._client.set(key, text, pxat=max(1, round(expires_at * 1000)))
        await self._guard.run("put_blob", write)

    async def get_blob(self, blob_id: str) -> bytes | None:
        key = f"{self.key_prefix}:blob:{blob_id}"
        raw = await self._guard.run("get_blob", self._client.get(key))
        return None if raw is None else cast(str, raw).encode("latin-1")

    async def delete_blob(self, blob_id: str) -> None:
        await self._guard.run(
            "delete_blob", self._client.delete(f"{self.key_prefix}:blob:{blob_id}")
        )

    async def append_events(self, stream_id: str, offset: int, events: list[str]) -> int:
        key = f"{self.key_prefix}:events:{stream_id}"
        length = await self._guard.run(
            "append_events",
            self._append_events(
                keys=[key], args=[offset, max(1, round(self.event_ttl_s * 1000)), *events]
            ),
        )
        if int(length) < 0:
            raise ValueError(f"offset: {offset} is past the end of event log {stream_id!r}")
        return int(length)

    async def read_events(self, stream_id: str, offset: int, max_events: int) -> list[str]:
        key = f"{self.key_prefix}:events:{stream_id}"
        end = offset + max_events - 1
        raw = await self._guard.run("read_events", self._client.lrange(key, offset, end))
        return cast(list[str], raw)

    async def close(self) -> None:
        if self._owns_client:
            await self._client.aclose()
