"""The production `SessionStore`: Redis, shared by every router replica.

Key layout (`<prefix>` is `duet` unless configured; ids are 32 hex characters):

    <prefix>:session:<id>              hash   api_key_hash ("" = no key), created_at,
                                              updated_at (unix seconds, Redis clock), version,
                                              num_messages, metadata (JSON), ttl_ms ("" = never
                                              expires), last_turn_id
    <prefix>:session:<id>:messages     list   one JSON message per element, in append order
                                              (absent until the first append)
    <prefix>:sessions:by_key:<owner>   zset   member: session id; score: expiry in unix ms
                                              (+inf = never). <owner> is sha256(api_key) in
                                              hex, or "anonymous" for sessions with no key
    <prefix>:ratelimit:<sha256(key)>   hash   see `redis_rate_limiter.py`
    <prefix>:response:<id>             hash   api_key_hash ("" = no key), status, doc (JSON): a
                                              stored response, with the store's default TTL

Raw API keys are never stored. The session hash and its message list carry the same TTL,
refreshed by every append; the by-key index drops expired members when written and itself
expires with its longest-lived member. Every write is one Lua script, so it is atomic; scripts
derive the index key from the session hash, so the layout targets a single Redis primary (with
replicas), not Redis Cluster.

Durability is Redis's: run it with `appendonly yes` (and `appendfsync always` to keep every
acknowledged turn across a crash; `everysec` may lose the last second).
"""

from __future__ import annotations

import builtins
import json
import uuid
from collections.abc import Collection
from typing import Any, cast

import redis.asyncio as aioredis

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
from duet.session_store.redis_client import RedisGuard, connect_redis

# Shared by the write scripts: server time, and keeping the by-key index in step.
_LUA_PRELUDE = """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local now_s = t[1] .. '.' .. string.format('%06d', tonumber(t[2]))

local function touch_index(index, sid, ttl_ms)
  local score = '+inf'
  if ttl_ms ~= '' then score = string.format('%d', now_ms + tonumber(ttl_ms)) end
  redis.call('ZADD', index, score, sid)
  redis.call('ZREMRANGEBYSCORE', index, '-inf', '(' .. now_ms)
  local top = redis.call('ZRANGE', index, -1, -1, 'WITHSCORES')
  if top[2] == 'inf' then
    redis.call('PERSIST', index)
  else
    redis.call('PEXPIREAT', index, top[2])
  end
end

local function owner(key_hash)
  if key_hash == '' then return 'anonymous' end
  return key_hash
end
"""

# KEYS: session hash, index zset. ARGV: id, api_key_hash, metadata, ttl_ms. Returns now_s.
_CREATE = (
    _LUA_PRELUDE
    + """
redis.call('HSET', KEYS[1], 'api_key_hash', ARGV[2], 'created_at', now_s, 'updated_at', now_s,
           'version', 0, 'num_messages', 0, 'metadata', ARGV[3], 'ttl_ms', ARGV[4],
           'last_turn_id', '')
if ARGV[4] ~= '' then redis.call('PEXPIRE', KEYS[1], ARGV[4]) end
touch_index(KEYS[2], ARGV[1], ARGV[4])
return now_s
"""
)

# KEYS: session hash, message list. ARGV: expected_version ('' = any), turn_id, index prefix,
# session id, message 1, message 2, ... Returns {version, num_messages}; version -1 = not
# found, -2 = conflict (then num_messages holds the actual version).
_APPEND = (
    _LUA_PRELUDE
    + """
local version = redis.call('HGET', KEYS[1], 'version')
if not version then return {-1, 0} end
version = tonumber(version)
if redis.call('HGET', KEYS[1], 'last_turn_id') == ARGV[2] then
  -- A client retry of a turn that already landed (its reply was lost): report, do not repeat.
  return {version, tonumber(redis.call('HGET', KEYS[1], 'num_messages'))}
end
if ARGV[1] ~= '' and tonumber(ARGV[1]) ~= version then return {-2, version} end
for i = 5, #ARGV, 1000 do
  redis.call('RPUSH', KEYS[2], unpack(ARGV, i, math.min(i + 999, #ARGV)))
end
local n = redis.call('LLEN', KEYS[2])
version = version + 1
redis.call('HSET', KEYS[1], 'version', version, 'num_messages', n, 'updated_at', now_s,
           'last_turn_id', ARGV[2])
local ttl_ms = redis.call('HGET', KEYS[1], 'ttl_ms')
if ttl_ms ~= '' then
  redis.call('PEXPIRE', KEYS[1], ttl_ms)
  redis.call('PEXPIRE', KEYS[2], ttl_ms)
end
touch_index(ARGV[3] .. owner(redis.call('HGET', KEYS[1], 'api_key_hash')), ARGV[4], ttl_ms)
return {version, n}
"""
)

# KEYS: session hash, message list. ARGV: index prefix, session id. Returns 1 if it existed.
_DELETE = (
    _LUA_PRELUDE
    + """
local key_hash = redis.call('HGET', KEYS[1], 'api_key_hash')
redis.call('DEL', KEYS[1], KEYS[2])
if not key_hash then return 0 end
redis.call('ZREM', ARGV[1] .. owner(key_hash), ARGV[2])
return 1
"""
)


def _parse_session(session_id: str, fields: dict[str, str]) -> Session:
    return Session(
        id=session_id,
        api_key_hash=fields["api_key_hash"] or None,
        created_at=float(fields["created_at"]),
        updated_at=float(fields["updated_at"]),
        version=int(fields["version"]),
        metadata=json.loads(fields["metadata"]),
        num_messages=int(fields["num_messages"]),
    )


# KEYS: response hash. ARGV: api_key_hash, status, doc, ttl_ms ('' = never expires), the number
# of statuses it may replace (-1: any, or none stored), those statuses. Returns 1 if it wrote.
_PUT_RESPONSE = """
local n = tonumber(ARGV[5])
if n >= 0 then
  local current = redis.call('HGET', KEYS[1], 'status')
  if not current then return 0 end
  local allowed = false
  for i = 1, n do
    if ARGV[5 + i] == current then allowed = true end
  end
  if not allowed then return 0 end
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'api_key_hash', ARGV[1], 'status', ARGV[2], 'doc', ARGV[3])
if ARGV[4] ~= '' then redis.call('PEXPIRE', KEYS[1], ARGV[4]) end
return 1
"""


class RedisSessionStore(SessionStore):
    """Sessions in Redis; one store object survives Redis restarts (it reconnects per call).

    Build it with `from_url` (sets the timeouts and retries) or pass a client made by
    `connect_redis`. The store owns the client and closes it.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        key_prefix: str = "duet",
        default_ttl_s: float | None = DEFAULT_SESSION_TTL_S,
        op_timeout_s: float = 2.5,
    ) -> None:
        self._client = client
        self._guard = RedisGuard("session store", op_timeout_s)
        self.key_prefix = key_prefix
        self.default_ttl_s = resolve_ttl(None, default_ttl_s)
        self._index_prefix = f"{key_prefix}:sessions:by_key:"
        self._create = client.register_script(_CREATE)
        self._append = client.register_script(_APPEND)
        self._delete = client.register_script(_DELETE)
        self._put_response = client.register_script(_PUT_RESPONSE)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        key_prefix: str = "duet",
        default_ttl_s: float | None = DEFAULT_SESSION_TTL_S,
        op_timeout_s: float = 2.5,
    ) -> RedisSessionStore:
        return cls(
            connect_redis(url),
            key_prefix=key_prefix,
            default_ttl_s=default_ttl_s,
            op_timeout_s=op_timeout_s,
        )

    def _meta_key(self, session_id: str) -> str:
        return f"{self.key_prefix}:session:{session_id}"

    def _messages_key(self, session_id: str) -> str:
        return f"{self.key_prefix}:session:{session_id}:messages"

    def _index_key(self, key_hash: str | None) -> str:
        return self._index_prefix + (key_hash or "anonymous")

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
        ttl_ms = "" if ttl is None else str(max(1, round(ttl * 1000)))
        now_s = await self._guard.run(
            "create",
            self._create(
                keys=[self._meta_key(session_id), self._index_key(key_hash)],
                args=[session_id, key_hash or "", metadata_json, ttl_ms],
            ),
        )
        now = float(now_s)
        return Session(session_id, key_hash, now, now, 0, json.loads(metadata_json), 0)

    async def get(self, session_id: str) -> Session:
        # decode_responses=True: every field and value is a str.
        fields = cast(
            dict[str, str],
            await self._guard.run("get", self._client.hgetall(self._meta_key(session_id))),
        )
        if not fields:
            raise SessionNotFound(session_id)
        return _parse_session(session_id, fields)

    async def append_turn(
        self,
        session_id: str,
        messages: builtins.list[dict[str, Any]],
        expected_version: int | None = None,
    ) -> int:
        validate_expected_version(expected_version)
        bodies = encode_messages(messages)
        # NOTE: the turn id makes redis-py's retry of a lost reply idempotent (see _APPEND).
        turn_id = uuid.uuid4().hex
        expected = "" if expected_version is None else str(expected_version)
        version, detail = await self._guard.run(
            "append_turn",
            self._append(
                keys=[self._meta_key(session_id), self._messages_key(session_id)],
                args=[expected, turn_id, self._index_prefix, session_id, *bodies],
            ),
        )
        if version == -1:
            raise SessionNotFound(session_id)
        if version == -2:
            assert expected_version is not None
            raise SessionConflict(session_id, expected_version, int(detail))
        return int(version)

    async def history(self, session_id: str) -> builtins.list[dict[str, Any]]:
        async def read() -> tuple[int, builtins.list[str]]:
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.exists(self._meta_key(session_id))
                pipe.lrange(self._messages_key(session_id), 0, -1)
                exists, bodies = await pipe.execute()
            return int(exists), bodies

        exists, bodies = await self._guard.run("history", read())
        if not exists:
            raise SessionNotFound(session_id)
        return [json.loads(b) for b in bodies]

    async def delete(self, session_id: str) -> bool:
        deleted = await self._guard.run(
            "delete",
            self._delete(
                keys=[self._meta_key(session_id), self._messages_key(session_id)],
                args=[self._index_prefix, session_id],
            ),
        )
        return bool(deleted)

    async def list(self, api_key: str | None) -> builtins.list[Session]:
        index = self._index_key(hash_api_key(api_key))

        async def read() -> builtins.list[Session]:
            ids = cast(builtins.list[str], await self._client.zrange(index, 0, -1))
            if not ids:
                return []
            async with self._client.pipeline(transaction=False) as pipe:
                for session_id in ids:
                    pipe.hgetall(self._meta_key(session_id))
                metas = await pipe.execute()
            # Members whose hash is gone expired or were deleted mid-read: skip them.
            sessions = [_parse_session(sid, m) for sid, m in zip(ids, metas, strict=True) if m]
            return sorted(sessions, key=lambda s: (s.created_at, s.id))

        return await self._guard.run("list", read())

    # --- stored responses ---

    def _response_key(self, response_id: str) -> str:
        return f"{self.key_prefix}:response:{response_id}"

    async def put_response(
        self,
        response_id: str,
        api_key_hash: str | None,
        status: str,
        doc: dict[str, Any],
        only_from: Collection[str] | None = None,
    ) -> bool:
        ttl = self.default_ttl_s
        ttl_ms = "" if ttl is None else str(max(1, round(ttl * 1000)))
        allowed = [] if only_from is None else sorted(only_from)
        written = await self._guard.run(
            "put_response",
            self._put_response(
                keys=[self._response_key(response_id)],
                args=[
                    api_key_hash or "",
                    status,
                    json.dumps(doc),
                    ttl_ms,
                    -1 if only_from is None else len(allowed),
                    *allowed,
                ],
            ),
        )
        return bool(written)

    async def get_response(self, response_id: str) -> StoredResponse | None:
        fields = cast(
            dict[str, str],
            await self._guard.run(
                "get_response", self._client.hgetall(self._response_key(response_id))
            ),
        )
        if not fields:
            return None
        owner = fields["api_key_hash"] or None
        return StoredResponse(response_id, owner, fields["status"], json.loads(fields["doc"]))

    async def delete_response(self, response_id: str) -> bool:
        deleted = await self._guard.run(
            "delete_response", self._client.delete(self._response_key(response_id))
        )
        return bool(deleted)

    async def close(self) -> None:
        await self._client.aclose()
