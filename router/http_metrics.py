"""`HTTPStatusMiddleware`: responses by route and status class (`2xx`, `3xx`, `4xx`, `429`,
`5xx`) in `duet:http_responses_total`, so errors and rate limiting show per route. The route
is the matched path template (`/v1/sessions/{session_id}`), never the raw path (which would
make a series per id); a path no route matches is `unmatched`. Pure ASGI, like the key check,
so streaming passes through untouched; it sits outside the key check and counts its 401s."""

from __future__ import annotations

from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from duet.router.metrics import ServingMetrics


class HTTPStatusMiddleware:
    def __init__(self, app: ASGIApp, metrics: ServingMetrics, routes: list[BaseRoute]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # an exception before any response is a 500 to the client

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            self.metrics.count_response(self._route(scope), _status_class(status))

    def _route(self, scope: Scope) -> str:
        route = scope.get("route")
        if route is None:  # answered before routing (the key check): match it here
            route = next((r for r in self.routes if r.matches(scope)[0] == Match.FULL), None)
        return getattr(route, "path", None) or "unmatched"


def _status_class(status: int) -> str:
    return "429" if status == 429 else f"{status // 100}xx"
