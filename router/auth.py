"""API-key authentication: `Authorization: Bearer KEY` on every path but the probes.

One `APIKeyChecker` serves REST (through `APIKeyMiddleware`) and gRPC (through
`router.grpc_server`'s interceptor). The middleware is pure ASGI (not Starlette's
`BaseHTTPMiddleware`), so streaming responses and client-disconnect detection pass through
untouched. Keys are compared in constant time and never logged.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from duet.router.errors import AuthenticationError

OPEN_PATHS = frozenset({"/health", "/ready"})
"""Probes that answer without a key (Kubernetes liveness and readiness checks carry none)."""


class APIKeyChecker:
    """Holds the accepted keys. With none configured, every request is accepted."""

    def __init__(self, api_keys: Iterable[str]) -> None:
        keys = list(api_keys)
        if any(not isinstance(k, str) or not k.strip() for k in keys):
            raise ValueError("api_keys: keys must be non-empty strings")
        self._keys = [k.encode() for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, authorization: str | None) -> None:
        """Raise `AuthenticationError` unless the header carries an accepted key."""
        self.authenticate(authorization)

    def authenticate(self, authorization: str | None) -> str | None:
        """The caller's key from an `Authorization` header value; None when no keys are
        configured (everyone is the same anonymous caller). Raises `AuthenticationError`."""
        if not self._keys:
            return None
        if not authorization:
            raise AuthenticationError("missing API key: send it as 'Authorization: Bearer <key>'")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthenticationError("the Authorization header must read 'Bearer <key>'")
        given = token.strip().encode()
        # Compare against every key so the time taken does not say which one matched.
        matched = False
        for key in self._keys:
            matched |= hmac.compare_digest(given, key)
        if not matched:
            raise AuthenticationError("invalid API key")
        return token.strip()


class APIKeyMiddleware:
    """Rejects HTTP requests without an accepted key (401) before any route runs."""

    def __init__(
        self, app: ASGIApp, checker: APIKeyChecker, open_paths: frozenset[str] = OPEN_PATHS
    ) -> None:
        """`open_paths`: answered without a key (the probes, and the static web pages)."""
        self.app = app
        self.checker = checker
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.checker.enabled or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        authorization = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
                break
        try:
            api_key = self.checker.authenticate(authorization)
        except AuthenticationError as e:
            await e.to_response()(scope, receive, send)
            return
        # Routes read it back with `caller_api_key` (sessions are owned by a key, rate limits
        # are per key). Starlette's `request.state` lives in this scope entry.
        scope.setdefault("state", {})["api_key"] = api_key
        await self.app(scope, receive, send)


def caller_api_key(request: Request) -> str | None:
    """The key the request authenticated with; None when the server has no keys."""
    return getattr(request.state, "api_key", None)
