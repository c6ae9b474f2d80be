"""What one REST client may cost (router/http_limits.py): a body over the cap is a 413 in
OpenAI's shape, never read; a prompt provably too long for the context is a 400 before it is
tokenized; headers that drip are cut off, a body that drips is a 408, and connections past the
cap get a 503 with Retry-After."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx2
import pytest

from duet.engine import AsyncEngine
from duet.router.api_server import build_app
from duet.router.front_door import FrontDoor, RouterOptions
from duet.router.http_limits import (
    BodyLimitMiddleware,
    HttpLimits,
    bounded_h11_protocol,
    default_max_body_bytes,
)
from duet.router.server import RouterConfig
from tests.router.rest_server import MODEL_NAME, LiveServer, make_app

LIMITS = HttpLimits(
    max_body_bytes=64 * 1024, header_timeout_s=3.0, body_timeout_s=1.0, max_connections=4
)


@pytest.fixture(scope="module")
def bounded(rest_engine: AsyncEngine) -> Iterator[LiveServer]:
    app = make_app(rest_engine, MODEL_NAME, http_limits=LIMITS)
    live = LiveServer(app, http=bounded_h11_protocol(LIMITS)).start()
    yield live
    live.stop()


def _error(response: httpx2.Response) -> dict[str, Any]:
    error: dict[str, Any] = response.json()["error"]
    return error


def test_a_body_over_the_cap_is_413_and_never_read(bounded: LiveServer) -> None:
    body = {"model": MODEL_NAME, "prompt": "x" * (64 * 1024), "max_tokens": 1}
    declared = httpx2.post(f"{bounded.url}/v1/completions", json=body, timeout=30)
    assert declared.status_code == 413
    assert _error(declared) == {
        "message": "request body: larger than the limit of 65536 bytes (the server's "
        "--max-body-bytes)",
        "type": "invalid_request_error", "param": None, "code": None,
    }  # fmt: skip

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it comes
        raw = json.dumps(body).encode()
        for i in range(0, len(raw), 8192):
            yield raw[i : i + 8192]

    streamed = httpx2.post(f"{bounded.url}/v1/completions", content=chunks(), timeout=30)
    assert streamed.status_code == 413
    assert "larger than the limit of 65536 bytes" in _error(streamed)["message"]


def test_the_default_cap_follows_the_models_context(rest_engine: AsyncEngine) -> None:
    app = build_app(FrontDoor.compose(rest_engine, MODEL_NAME, RouterOptions()))
    [limit] = [m for m in app.user_middleware if m.cls is BodyLimitMiddleware]
    assert rest_engine.max_model_len == 1024
    assert limit.kwargs["max_body_bytes"] == default_max_body_bytes(1024) == (1 << 20) + 65536
    assert RouterConfig(max_body_bytes=4096).http_limits.max_body_bytes == 4096
    with pytest.raises(ValueError, match="--max-body-bytes: must be >= 1024; got 10"):
        RouterConfig(max_body_bytes=10)
    with pytest.raises(ValueError, match="--header-timeout: must be > 0 seconds; got 0"):
        RouterConfig(header_timeout_s=0)
    with pytest.raises(ValueError, match="--max-connections: must be >= 1; got 0"):
        RouterConfig(max_connections=0)


@pytest.mark.parametrize(
    ("path", "field"), [("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")]
)
def test_a_prompt_too_long_by_its_characters_is_not_tokenized(
    bounded: LiveServer, rest_engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch, path: str,
    field: str,
) -> None:  # fmt: skip
    tokenizer = rest_engine.tokenizer
    max_chars = tokenizer.max_token_chars
    assert max_chars is not None  # byte-level BPE: every character stays in some token
    text = "ab" * (1024 * max_chars // 2 + 1)  # one token more than the context, at the least
    encoded: list[int] = []
    real_encode = tokenizer.encode

    def counting_encode(text: str, add_special_tokens: bool = True) -> list[int]:
        encoded.append(len(text))
        return real_encode(text, add_special_tokens)

    monkeypatch.setattr(tokenizer, "encode", counting_encode)
    if field == "prompt":
        body: dict[str, Any] = {"model": MODEL_NAME, "prompt": text, "max_tokens": 1}
    else:
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": text}]}
    response = httpx2.post(f"{bounded.url}{path}", json=body, timeout=30)
    assert response.status_code == 400
    error = _error(response)
    assert error["param"] == field
    if field == "prompt":
        assert error["message"] == (
            f"prompt: has {len(text)} characters, so at least {-(-len(text) // max_chars)} "
            f"tokens (a token is at most {max_chars} characters); the model's context is 1024"
        )
    else:  # the rendered template: the text and the template's own
        assert error["message"].startswith("messages: has ")
        assert error["message"].endswith("characters); the model's context is 1024")
    assert [n for n in encoded if n >= len(text)] == []  # never tokenized


def _connect(server: LiveServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_headers_that_drip_are_cut_off(bounded: LiveServer) -> None:
    # NOTE: timed from before the connection: the server's header clock starts when it
    # accepts, which can precede a clock read after connect() returns (2.999 s measured)
    start = time.monotonic()
    sock = _connect(bounded)
    sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: duet\r\n")
    closed = False
    with sock:
        for i in range(60):  # one header line every 0.25 s, never the blank line
            try:
                sock.sendall(f"X-Drip-{i}: 1\r\n".encode())
            except OSError:  # reset: the server closed it
                closed = True
                break
            sock.settimeout(0.25)  # NOTE: the pace of the drip; the read also sees a close
            try:
                if sock.recv(1) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except ConnectionResetError:  # closed with our headers unread: a reset, not a FIN
                closed = True
                break
    elapsed = time.monotonic() - start
    assert closed and LIMITS.header_timeout_s <= elapsed < LIMITS.header_timeout_s + 10


def test_a_body_that_drips_is_408(bounded: LiveServer) -> None:
    with _connect(bounded) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: duet\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"prompt": '
        )
        start = time.monotonic()
        reply = _read_all(sock)
    assert reply.startswith(b"HTTP/1.1 408 ")
    assert b"request body: not received within 1s" in reply
    assert time.monotonic() - start < LIMITS.body_timeout_s + 10


def test_connections_past_the_cap_get_503(bounded: LiveServer) -> None:
    held = [_connect(bounded) for _ in range(LIMITS.max_connections)]
    try:
        for sock in held:  # each answered once: the server has taken it in
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: duet\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        with _connect(bounded) as extra:
            reply = _read_all(extra)
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 ")
        assert b"retry-after: 1" in head.lower()
        assert json.loads(body)["error"]["code"] == "too_many_connections"
    finally:
        for sock in held:
            sock.close()
