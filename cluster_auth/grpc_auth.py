"""Credentials on the internal gRPC plane (the prefill and decode workers' services).

Every call carries `x-duet-auth: v1.<unix ms>.<nonce>.<hmac>`, the HMAC (keyed by the cluster
secret) over the method, the time and a fresh 128-bit nonce. The server (`AuthInterceptor`)
accepts a call whose time is within `MAX_SKEW_S` of its own clock, whose nonce it has not seen
in that window, and whose HMAC matches (constant-time comparison); anything else ends with
UNAUTHENTICATED before the servicer runs. Health checks (`grpc.health.v1.Health`) stay open:
they reveal nothing but "serving".

NOTE: per call, not a fixed token per channel: a token derived once from the secret would be
a bearer credential on the wire in the clear (without mTLS), good forever to whoever reads one
packet. A signed time and nonce is good once, for one method, for at most `MAX_SKEW_S`."""

from __future__ import annotations

import heapq
import hmac
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

from duet.cluster_auth.refusals import RefusalLog
from duet.cluster_auth.secret import ClusterSecret

METADATA_KEY = "x-duet-auth"
VERSION = "v1"
MAX_SKEW_S = 30.0
"""How far a call's signed time may be from the server's clock (either way); also how long
the server remembers a nonce (a replay after that is refused as expired)."""
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


class CallSigner:
    """The client's side: fresh credentials for each call."""

    def __init__(self, secret: ClusterSecret, clock: Callable[[], float] = time.time) -> None:
        self._secret = secret
        self._clock = clock

    def metadata(self, method: str) -> tuple[tuple[str, str]]:
        """The call's metadata for `method` ("/duet.v1.DecodeWorker/Generate")."""
        ms = str(int(self._clock() * 1000))
        nonce = secrets.token_hex(16)
        mac = self._secret.mac("grpc", method.encode(), ms.encode(), nonce.encode()).hex()
        return ((METADATA_KEY, f"{VERSION}.{ms}.{nonce}.{mac}"),)


class CallVerifier:
    """The server's side: `check` returns None for valid credentials, else why not."""

    def __init__(
        self,
        secret: ClusterSecret,
        max_skew_s: float = MAX_SKEW_S,
        clock: Callable[[], float] = time.time,
        max_nonces: int = 1 << 20,
    ) -> None:
        self._secret = secret
        self._max_skew_s = max_skew_s
        self._clock = clock
        self._max_nonces = max_nonces
        self._seen: set[str] = set()
        self._expiry: list[tuple[float, str]] = []  # heap of (forget after, nonce)
        self._lock = threading.Lock()

    def check(self, method: str, credentials: str | None) -> str | None:
        if not credentials:
            return "no credentials"
        parts = credentials.split(".")
        if len(parts) != 4 or parts[0] != VERSION or not parts[1].isdigit() or len(parts[2]) != 32:
            return "malformed credentials"
        _, ms, nonce, mac = parts
        signed_at = int(ms) / 1000
        now = self._clock()
        if abs(now - signed_at) > self._max_skew_s:
            return f"expired credentials (or clocks more than {self._max_skew_s:g} s apart)"
        want = self._secret.mac("grpc", method.encode(), ms.encode(), nonce.encode()).hex()
        if not hmac.compare_digest(want, mac):
            return "bad signature (a different cluster secret)"
        with self._lock:
            while self._expiry and self._expiry[0][0] < now:
                self._seen.discard(heapq.heappop(self._expiry)[1])
            if nonce in self._seen:
                return "replayed credentials"
            if len(self._seen) >= self._max_nonces:
                return "too many calls in the replay window"
            self._seen.add(nonce)
            heapq.heappush(self._expiry, (signed_at + self._max_skew_s, nonce))
        return None


def peer_host(peer: str) -> str:
    """`ipv4:10.0.0.7:51234` -> `10.0.0.7` (the port changes with every connection)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return peer
    return rest.rsplit(":", 1)[0].strip("[]")


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED, every call but health checks without valid credentials."""

    def __init__(self, secret: ClusterSecret, what: str, max_skew_s: float = MAX_SKEW_S) -> None:
        self.verifier = CallVerifier(secret, max_skew_s)
        self.refusals = RefusalLog(what)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method: str = details.method
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        reason = self.verifier.check(method, _credentials(details.invocation_metadata))
        if reason is None:
            return handler
        return self._refusal(handler, reason)

    def _refusal(self, handler: grpc.RpcMethodHandler, reason: str) -> grpc.RpcMethodHandler:
        refusals = self.refusals

        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
            refusals.refused(peer_host(context.peer()), reason)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"duet internal plane: {reason}")

        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(refuse)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(refuse)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(refuse)
        return grpc.unary_unary_rpc_method_handler(refuse)


def _credentials(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    for key, value in metadata or ():
        if key == METADATA_KEY:
            return value if isinstance(value, str) else None
    return None
