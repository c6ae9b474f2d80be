"""The browser pages: the chat at `/` and the cluster dashboard at `/dashboard` (docs/web_ui.md).

Both are static files from `router/static/` (no build step, nothing loaded from elsewhere, so
they work offline) served without an API key; every piece of data they show comes from the
API behind the key, which the page asks for and keeps in the tab's session storage. A strict
Content-Security-Policy allows only this origin's scripts, so even a rendering bug could not
run a script from model output.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, Response

STATIC_DIR = Path(__file__).parent / "static"

PAGES = {"/": "index.html", "/dashboard": "dashboard.html"}
"""Page path -> its file."""

FAVICON = "/favicon.ico"
"""Where browsers look for the tab's icon (an SVG, which they take under any name)."""

ASSETS = {
    "markdown.js": "text/javascript",
    "api.js": "text/javascript",
    "chat.js": "text/javascript",
    "dashboard.js": "text/javascript",
    "plot.js": "text/javascript",
    "style.css": "text/css",
}
"""What `/ui/<name>` serves; nothing else under `router/static/` is reachable."""

ASSET_PREFIX = "/ui/"

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)

_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def open_paths() -> frozenset[str]:
    """The paths the API-key middleware lets through without a key when the pages are on."""
    return frozenset(PAGES) | {ASSET_PREFIX + name for name in ASSETS} | {FAVICON}


def install_web_ui(app: FastAPI) -> None:
    """Serve the pages and their assets on `app`."""
    for path, filename in PAGES.items():
        _add_file_route(app, path, filename, "text/html; charset=utf-8")
    for name, media_type in ASSETS.items():
        _add_file_route(app, ASSET_PREFIX + name, name, media_type)
    _add_file_route(app, FAVICON, "favicon.svg", "image/svg+xml")


def _add_file_route(app: FastAPI, path: str, filename: str, media_type: str) -> None:
    file = STATIC_DIR / filename

    async def serve() -> Response:
        return FileResponse(file, media_type=media_type, headers=_HEADERS)

    app.add_api_route(path, serve, methods=["GET"], include_in_schema=False)
