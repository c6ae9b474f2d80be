"""A chat template sent with a request runs on the server: by default it is refused with a 400
(gRPC INVALID_ARGUMENT) naming `chat_template`, on every route that renders chats; a server
started with `--trust-request-chat-template` renders it. Without the gate one line of a
template took the event loop for seconds or its memory whole (`{{ 'x' * 10**10 }}`)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import httpx2
import pytest

from duet.engine import AsyncEngine
from duet.router.openai_chat import UNTRUSTED_CHAT_TEMPLATE
from duet.v1 import serving_pb2
from tests.router.live_grpc import LiveGrpcServer
from tests.router.rest_server import API_KEY, MODEL_NAME, TRUSTED_TEMPLATES, LiveServer, make_app

BOMB = "{{ 'x' * 10**10 }}"
"""Ten billion characters: 10 GB, rendered."""
PLAIN = "{% for m in messages %}<{{ m.content }}>{% endfor %}"

MESSAGES = [{"role": "user", "content": "hi"}]
AUTH = {"authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def default_server(rest_engine: AsyncEngine) -> Iterator[LiveServer]:
    live = LiveServer(make_app(rest_engine, MODEL_NAME, api_keys=[API_KEY])).start()
    yield live
    live.stop()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2}),
        ("/tokenize", {"model": MODEL_NAME, "messages": MESSAGES}),
    ],
)
def test_a_default_server_refuses_a_request_template(
    default_server: LiveServer, path: str, body: dict
) -> None:
    with httpx2.Client(base_url=default_server.url, headers=AUTH, timeout=30) as http:
        for template in (BOMB, PLAIN):
            started = time.monotonic()
            reply = http.post(path, json={**body, "chat_template": template})
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert (error["param"], error["message"]) == (
                "chat_template",
                f"chat_template: {UNTRUSTED_CHAT_TEMPLATE}",
            )
            assert time.monotonic() - started < 5  # refused, not rendered
        assert http.post(path, json=body).status_code == 200  # the model's own template


def test_a_default_grpc_server_refuses_a_request_template(rest_engine: AsyncEngine) -> None:
    server = LiveGrpcServer(rest_engine)
    try:
        request = serving_pb2.ChatRequest(
            model=MODEL_NAME, chat_template=BOMB,
            sampling=serving_pb2.SamplingOptions(max_tokens=2),
        )  # fmt: skip
        request.messages.add(role="user", content="hi")
        with pytest.raises(grpc.RpcError) as e:
            list(server.stub.Chat(request, timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details() == f"chat_template: {UNTRUSTED_CHAT_TEMPLATE}"
        request.ClearField("chat_template")
        assert list(server.stub.Chat(request, timeout=30))  # the model's own template
    finally:
        server.stop()


def test_a_trusting_server_renders_the_request_template(rest_engine: AsyncEngine) -> None:
    app = make_app(rest_engine, MODEL_NAME, api_keys=[API_KEY], chat_options=TRUSTED_TEMPLATES)
    live = LiveServer(app).start()
    try:
        with httpx2.Client(base_url=live.url, headers=AUTH, timeout=30) as http:
            body = {"model": MODEL_NAME, "messages": MESSAGES, "add_special_tokens": False}
            own = http.post("/tokenize", json={**body, "chat_template": PLAIN}).json()
            text = http.post("/detokenize", json={"model": MODEL_NAME, "tokens": own["tokens"]})
            assert text.json()["prompt"] == "<hi>"
    finally:
        live.stop()
