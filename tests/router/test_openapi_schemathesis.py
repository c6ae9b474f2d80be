"""schemathesis against the served OpenAPI schema (`GET /openapi.json`): a bounded number of
generated requests per operation, every operation (the Batch API's and the Responses API's
included), valid and invalid ones, pass every check schemathesis has: no 5xx, responses as
the schema says (status, content type, headers, body), requests the schema allows accepted and
those it forbids refused, `Allow` on a 405 naming every method of the path. The server's context
is 64 tokens, so generated requests stay cheap: a large max_tokens is a 400, and omitting it
generates at most the rest of the context.

A few refusals depend on more than one request's shape, which JSON Schema cannot state, and
are the only schema-valid requests a 400 may answer (`SEMANTIC_REFUSALS`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx2
import pytest
import schemathesis
import torch
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode, checks
from schemathesis.checks import CHECKS

from duet.session_store import SqliteSessionStore, SqliteWorkQueue
from tests.router.rest_server import (
    MODEL_NAME,
    TRUSTED_TEMPLATES,
    LiveServer,
    closing,
    make_app,
    make_engine,
)


@contextmanager
def subnormal_floats() -> Iterator[None]:
    """NOTE: the engine flushes denormals to zero (engine/cpu_runtime.py), a per-thread CPU mode
    this thread has since the first engine started; hypothesis refuses to generate floats under
    it. Engine threads keep their own mode, so turning it off here changes nothing there."""
    torch.set_flush_denormal(False)
    try:
        yield
    finally:
        torch.set_flush_denormal(True)


def start_in_a_clean_mode(live: LiveServer) -> LiveServer:
    """Start `live` with flush-to-zero off. A new thread starts in its creator's floating-point
    mode (Linux copies it), and an engine built on this thread set flush-to-zero and
    denormals-are-zero here (engine/cpu_runtime.py): a server thread started under them reads a
    subnormal such as `top_p: 5e-324` as 0 and refuses it where the schema allows it (a flaky
    failure: it depended on whether this xdist worker had built an engine on its main thread
    before). `duet serve`'s event loop does not run under them: its engine is built and steps
    on a thread of its own."""
    with subnormal_floats():
        return live.start()


@pytest.fixture(scope="module")
def fuzzed_server(
    tiny_llama: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    engine = make_engine(tiny_llama, max_model_len=64)
    folder = tmp_path_factory.mktemp("fuzz")
    store = SqliteSessionStore(folder / "sessions.db")
    queue = SqliteWorkQueue(folder / "queue.db", lease_s=10.0)
    app = make_app(engine, MODEL_NAME, session_store=store, work_queue=queue,
                   chat_options=TRUSTED_TEMPLATES,  # generated templates are rendered
                   lifespan=closing(store, queue))  # fmt: skip
    live = LiveServer(app)
    torch.set_flush_denormal(True)  # as building an engine on this thread may have left it
    yield start_in_a_clean_mode(live)
    live.stop()
    engine.shutdown()


def test_schema_is_served_and_documents_400_not_422(fuzzed_server: LiveServer) -> None:
    schema = httpx2.get(f"{fuzzed_server.url}/openapi.json", timeout=10).json()
    chat = schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"200", "400", "404", "409", "429", "503"} <= set(chat) and "422" not in chat
    assert set(schema["paths"]["/v1/sessions/{session_id}"]) == {"get", "delete"}
    assert "HTTPValidationError" not in schema["components"]["schemas"]


OPERATIONS = [
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/chat/completions/{completion_id}"),
    ("GET", "/v1/chat/completions/{completion_id}/events"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/embeddings"),
    ("POST", "/v1/responses"),
    ("GET", "/v1/responses/{response_id}"),
    ("DELETE", "/v1/responses/{response_id}"),
    ("POST", "/v1/responses/{response_id}/cancel"),
    ("POST", "/v1/conversations"),
    ("GET", "/v1/conversations/{conversation_id}"),
    ("POST", "/v1/conversations/{conversation_id}"),
    ("DELETE", "/v1/conversations/{conversation_id}"),
    ("POST", "/v1/conversations/{conversation_id}/items"),
    ("GET", "/v1/conversations/{conversation_id}/items"),
    ("GET", "/v1/conversations/{conversation_id}/items/{item_id}"),
    ("DELETE", "/v1/conversations/{conversation_id}/items/{item_id}"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model}"),
    ("POST", "/v1/sessions"),
    ("GET", "/v1/sessions"),
    ("GET", "/v1/sessions/{session_id}"),
    ("DELETE", "/v1/sessions/{session_id}"),
    ("POST", "/v1/files"),
    ("GET", "/v1/files"),
    ("GET", "/v1/files/{file_id}"),
    ("DELETE", "/v1/files/{file_id}"),
    ("GET", "/v1/files/{file_id}/content"),
    ("POST", "/v1/batches"),
    ("GET", "/v1/batches"),
    ("GET", "/v1/batches/{batch_id}"),
    ("POST", "/v1/batches/{batch_id}/cancel"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/version"),
    ("GET", "/health"),
    ("GET", "/ready"),
    ("GET", "/metrics"),
]
"""Every operation the schema documents (`test_every_operation_is_fuzzed` keeps it so)."""

SEMANTIC_REFUSALS = (
    "the model's context is",  # the prompt's tokens: known only once it is tokenized
    "exceeds the context of",  # the prompt's tokens and max_tokens
    "which is not in tools",  # a named tool_choice must name one of `tools`
    "must be <= max_tokens",  # min_tokens against max_tokens
    "does not appear in the rendered chat template",  # continue_final_message, per template
    '"messages: must not be empty"',  # a request's own chat_template that renders nothing
    "'s name",  # tools with one name twice
    ": does not compile:",  # a grammar, regex or JSON schema given as text: its own language
    ": is not JSON:",
    "(the model's vocabulary)",  # logit_bias's token ids: digit strings, bounded by the model
    "best_of: other than n",  # best_of equal to n
    "in this list (an id from a previous page)",  # GET /v1/files' `after`: one of the key's ids
    "only background responses can be cancelled",  # how the response was created
    "is already an item of this conversation",  # an item id: unique in its conversation
    "embeddings have",  # /v1/embeddings' dimensions: the model's width, known by running it
    # NOTE: JSON Schema can state this one (an if/then on session_id), but with it the chat
    # body's sixth if/then rule schemathesis 4.32 refuses to generate the operation at all
    # ("does not support this part of it"), whatever the rule says.
    "must be 1 with session_id",
    "cannot be combined with previous_response_id",  # /v1/responses: one history or the other
)
"""400s a schema-valid request may get: rules between values, or on the tokenized prompt,
that JSON Schema cannot express. Anything else the schema allows must be accepted."""


def positive_data_acceptance(ctx, response, case):  # type: ignore[no-untyped-def]
    """schemathesis's check, except for `SEMANTIC_REFUSALS`."""
    if response.status_code == 400 and any(r in response.text for r in SEMANTIC_REFUSALS):
        return None
    return checks.positive_data_acceptance(ctx, response, case)


checks.load_all_checks()  # registered on first use otherwise
ALL_CHECKS = [
    positive_data_acceptance if check is checks.positive_data_acceptance else check
    for check in CHECKS.get_all()
]


def test_every_operation_is_fuzzed(fuzzed_server: LiveServer) -> None:
    schema = httpx2.get(f"{fuzzed_server.url}/openapi.json", timeout=10).json()
    documented = {(m.upper(), p) for p, ops in schema["paths"].items() for m in ops}
    assert documented == set(OPERATIONS)
    assert len(ALL_CHECKS) == len(CHECKS.get_all()) >= 14


# NOTE: strategies from the served schema under `@given`, rather than `schemathesis.pytest
# .from_fixture`, whose lazy loading breaks on this pytest (it reads a private attribute).
@pytest.mark.parametrize(
    ("method", "path", "mode"),
    [(method, path, GenerationMode.POSITIVE) for method, path in OPERATIONS]
    # Negative cases need something to break: a body or a query parameter (any string is a
    # valid path parameter).
    + [
        (method, path, GenerationMode.NEGATIVE)
        for method, path in OPERATIONS
        if (method == "POST" and "{" not in path) or path == "/v1/batches"
    ],
)
def test_generated_requests_get_no_5xx_and_match_the_schema(
    fuzzed_server: LiveServer, method: str, path: str, mode: GenerationMode
) -> None:
    schema = schemathesis.openapi.from_url(f"{fuzzed_server.url}/openapi.json")
    operation = schema[path][method]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=25,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    def call(case: schemathesis.Case) -> None:
        case.call_and_validate(checks=ALL_CHECKS, timeout=30)

    with subnormal_floats():
        call()


# -- each disagreement schemathesis found, as a regression test (issue 47, item 9) ----------


def test_a_subnormal_top_p_is_accepted_as_the_schema_allows(fuzzed_server: LiveServer) -> None:
    """The fixture's thread had flush-to-zero on when it started the server (as after building
    an engine there): started in a clean mode, the server still reads 5e-324 as above 0."""
    # the body as text: this thread's mode would print the float 5e-324 as 0.0
    body = '{"messages": [{"role": "user", "content": "hi"}], "top_p": 5e-324, "max_tokens": 1}'
    reply = httpx2.post(
        f"{fuzzed_server.url}/v1/chat/completions", content=body, timeout=30,
        headers={"content-type": "application/json"},
    )  # fmt: skip
    assert reply.status_code == 200, reply.text


def _schema(server: LiveServer) -> dict[str, Any]:
    return dict(httpx2.get(f"{server.url}/openapi.json", timeout=10).json())


def _body_schema(schema: dict[str, Any], name: str) -> dict[str, Any]:
    return dict(schema["components"]["schemas"][name])


def _post(server: LiveServer, path: str, body: dict[str, Any]) -> httpx2.Response:
    return httpx2.post(f"{server.url}{path}", json=body, timeout=60)


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_batches_limit_is_bounded_in_the_schema_too(fuzzed_server: LiveServer) -> None:
    [limit] = _schema(fuzzed_server)["paths"]["/v1/batches"]["get"]["parameters"][:1]
    assert (limit["name"], limit["schema"]["minimum"], limit["schema"]["maximum"]) == (
        "limit",
        1,
        100,
    )
    reply = httpx2.get(f"{fuzzed_server.url}/v1/batches?limit=-4194304", timeout=10)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "limit"
    assert httpx2.get(f"{fuzzed_server.url}/v1/batches?limit=100", timeout=10).status_code == 200


def test_an_empty_prompt_is_refused_by_the_schema_and_the_server(fuzzed_server: LiveServer) -> None:
    prompt = _body_schema(_schema(fuzzed_server), "CompletionRequest")["properties"]["prompt"]
    assert {"type": "string", "minLength": 1} in prompt["anyOf"]
    assert all(branch.get("minItems") == 1 for branch in prompt["anyOf"][1:])
    for empty in ("", [], [[]]):
        assert _post(fuzzed_server, "/v1/completions", {"prompt": empty}).status_code == 400


def test_token_ids_are_bounded_by_the_vocabulary_in_the_schema(fuzzed_server: LiveServer) -> None:
    schema = _schema(fuzzed_server)
    item = _body_schema(schema, "DetokenizeRequest")["properties"]["tokens"]["items"]
    top = item["maximum"]
    assert _post(fuzzed_server, "/detokenize", {"tokens": [top, 0]}).status_code == 200
    assert _post(fuzzed_server, "/detokenize", {"tokens": [top + 1]}).status_code == 400
    ids = _body_schema(schema, "CompletionRequest")["properties"]["prompt"]["anyOf"][2]["items"]
    ok = _post(fuzzed_server, "/v1/completions", {"prompt": [ids["maximum"]], "max_tokens": 1})
    assert ok.status_code == 200
    too_big = _post(fuzzed_server, "/v1/completions", {"prompt": [ids["maximum"] + 1]})
    assert too_big.status_code == 400


def test_allowed_ids_and_truncation_are_bounded_in_the_schema(fuzzed_server: LiveServer) -> None:
    props = _body_schema(_schema(fuzzed_server), "CompletionRequest")["properties"]
    [allowed] = [b for b in props["allowed_token_ids"]["anyOf"] if b.get("type") == "array"]
    [keep] = [b for b in props["truncate_prompt_tokens"]["anyOf"] if b.get("type") == "integer"]
    top_id, context = allowed["items"]["maximum"], keep["maximum"]
    for body, status in (({"allowed_token_ids": [top_id]}, 200),
                         ({"allowed_token_ids": [top_id + 1]}, 400),
                         ({"truncate_prompt_tokens": context}, 200),
                         ({"truncate_prompt_tokens": context + 1}, 400)):  # fmt: skip
        reply = _post(fuzzed_server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, **body})
        assert reply.status_code == status, (body, reply.text)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/sessions", {"ttl_s": True}),
        ("/detokenize", {"tokens": [True]}),
        ("/v1/completions", {"prompt": [[False]], "max_tokens": 1}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "2"}),
        (
            "/v1/chat/completions",
            {
                **CHAT,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "r", "strict": 0},
                },
            },
        ),
        ("/tokenize", {"prompt": "hi", "return_token_strs": 1}),
    ],
)
def test_values_of_another_json_type_are_refused(
    fuzzed_server: LiveServer, path: str, body: dict[str, Any]
) -> None:
    """`true` is not an integer, `"2"` not a number, `0` not a boolean: the schema says so
    and so does the server now (pydantic's lax mode took them)."""
    assert _post(fuzzed_server, path, body).status_code == 400


def test_an_integral_float_is_an_integer(fuzzed_server: LiveServer) -> None:
    reply = _post(fuzzed_server, "/v1/completions",
                  {"prompt": [3.0, 7], "max_tokens": 2.0, "top_k": 5.0})  # fmt: skip
    assert reply.status_code == 200
    assert _post(fuzzed_server, "/detokenize", {"tokens": [189.0, 51]}).status_code == 200
    assert (
        _post(fuzzed_server, "/v1/completions", {"prompt": "hi", "top_k": 5.5}).status_code == 400
    )


@pytest.mark.parametrize(
    ("path", "allowed"),
    [
        ("/v1/batches", "GET, POST"),
        ("/v1/sessions", "GET, POST"),
        ("/v1/sessions/s1", "DELETE, GET"),
        ("/v1/responses/r1", "DELETE, GET"),
        ("/v1/models", "GET"),
    ],
)
def test_a_405_allows_every_method_of_the_path(
    fuzzed_server: LiveServer, path: str, allowed: str
) -> None:
    reply = httpx2.request("OPTIONS", f"{fuzzed_server.url}{path}", timeout=10)
    assert (reply.status_code, reply.headers["allow"]) == (405, allowed)


def test_replies_that_are_not_json_are_typed_as_what_they_are(fuzzed_server: LiveServer) -> None:
    paths = _schema(fuzzed_server)["paths"]
    assert set(paths["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    content = paths["/v1/files/{file_id}/content"]["get"]["responses"]["200"]["content"]
    assert content["application/octet-stream"]["schema"]["format"] == "binary"
    streamed = paths["/v1/responses"]["post"]["responses"]["200"]["content"]["text/event-stream"]
    assert streamed["schema"]["properties"]["data"] == {"type": "string"}
    upload = paths["/v1/files"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert upload["required"] == ["purpose", "file"]
    assert upload["properties"]["purpose"]["enum"] == ["batch"]


def test_no_constraint_reaches_the_schema_under_pydantics_own_name(
    fuzzed_server: LiveServer,
) -> None:
    """`{"ge": 1}` (a constraint pydantic could not translate) means nothing to a client."""

    def keys(node: Any) -> Iterator[str]:
        if isinstance(node, dict):
            for key, value in node.items():
                yield key
                if key != "properties":  # property names are free
                    yield from keys(value)
                else:
                    for child in value.values():
                        yield from keys(child)
        elif isinstance(node, list):
            for value in node:
                yield from keys(value)

    assert not {"ge", "gt", "le", "lt"} & set(keys(_schema(fuzzed_server)))


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "tool", "content": "x"}]},
            "messages[0].tool_call_id",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "continue_final_message": True},
            "continue_final_message",
        ),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {**CHAT, "background": True, "n": 2}, "n"),
        ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice"),
        (
            "/v1/chat/completions",
            {
                **CHAT,
                "response_format": {"type": "json_object"},
                "structured_outputs": {"regex": "a"},
            },
            "response_format",
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "response_format": {"type": "json_schema"}},
            "response_format.json_schema",
        ),
        ("/v1/completions", {"prompt": "hi", "session_id": "s"}, "session_id"),
        ("/v1/completions", {"prompt": "hi", "stop": [""]}, "stop"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids"),
        ("/v1/completions", {"prompt": "hi", "priority": 3}, "priority"),
        (
            "/v1/completions",
            {"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs",
        ),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {}, None),
        ("/v1/batches", {"input_file_id": "f", "endpoint": ""}, "endpoint"),
        ("/v1/responses", {"input": ""}, "input"),
        ("/v1/responses", {"input": [{"type": "reasoning", "content": []}]}, "input"),
        ("/v1/responses", {"input": "hi", "max_tool_calls": 0}, "max_tool_calls"),
        ("/v1/responses", {"input": "hi", "background": True, "store": False}, "background"),
        ("/v1/responses", {"input": [{}]}, "input[0].type"),
    ],
)
def test_rules_between_fields_are_in_the_schema(
    fuzzed_server: LiveServer, path: str, body: dict[str, Any], param: str | None
) -> None:
    """Each request breaks a rule of the server's validators that the schema now states too
    (schemathesis generated it as valid before): a 400 naming the field, and the request
    fails validation against the served schema."""
    import jsonschema

    reply = _post(fuzzed_server, path, body)
    assert reply.status_code == 400, reply.text
    if param is not None:
        assert reply.json()["error"]["param"] == param
    schema = _schema(fuzzed_server)
    ref = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    served = jsonschema.Draft202012Validator({**ref, "components": schema["components"]})
    assert not served.is_valid(body), f"{path} {body} is valid in the served schema"


def test_the_seed_bounds_in_the_schema_are_the_servers(fuzzed_server: LiveServer) -> None:
    """The schema's bounds are floats (FastAPI's OpenAPI models): an inclusive 2^63 - 1 read as
    2^63 there, so a generated seed of 2^63 was schema-valid and refused (a random-seed run)."""
    body = _body_schema(_schema(fuzzed_server), "ChatCompletionRequest")
    [seed, _] = body["properties"]["seed"]["anyOf"]
    assert (seed["minimum"], seed["exclusiveMaximum"]) == (-(2**63), 2**63)
    # as JSON integers: a generator working from float bounds sent -2^63 - 192 as within them
    assert type(seed["minimum"]) is int and type(seed["exclusiveMaximum"]) is int
    assert "maximum" not in seed
    for value, status in ((2**63 - 1, 200), (-(2**63), 200), (2**63, 400), (-(2**63) - 192, 400)):
        reply = _post(fuzzed_server, "/v1/chat/completions", {**CHAT, "seed": value})
        assert reply.status_code == status, value
    assert reply.json()["error"]["param"] == "seed"


def test_tokenize_refuses_continue_final_message_with_a_generation_prompt(
    fuzzed_server: LiveServer,
) -> None:
    """The schema's rule holds for a text prompt too (a seeded negative case was accepted)."""
    body = {"prompt": "hi", "continue_final_message": True, "add_generation_prompt": True}
    reply = _post(fuzzed_server, "/tokenize", body)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "continue_final_message"
    ok = _post(fuzzed_server, "/tokenize", {**body, "add_generation_prompt": False})
    assert ok.status_code == 200 and ok.json()["count"] > 0


def test_two_rules_of_chat_bodies(fuzzed_server: LiveServer) -> None:
    """Found by random-seed runs: `n` other than 1 with a session (a semantic refusal, named
    above), and an empty `choice` list beside another structured-output kind, which the schema
    now refuses too."""
    reply = _post(fuzzed_server, "/v1/chat/completions", {**CHAT, "session_id": "s", "n": 2})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "n"
    choice = _body_schema(_schema(fuzzed_server), "StructuredOutputsBody")["properties"]["choice"]
    assert choice["anyOf"][0]["minItems"] == 1
    assert choice["anyOf"][0]["items"]["minLength"] == 1
    both = {**CHAT, "structured_outputs": {"json_object": True, "choice": []}}
    reply = _post(fuzzed_server, "/v1/chat/completions", both)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "structured_outputs.choice"
    schema = _body_schema(_schema(fuzzed_server), "StructuredOutputsBody")
    for kind in ("regex", "grammar"):
        assert schema["properties"][kind]["anyOf"][0]["minLength"] == 1
        reply = _post(fuzzed_server, "/v1/completions",
                      {"prompt": "hi", "max_tokens": 2, "structured_outputs": {kind: ""}})  # fmt: skip
        assert reply.status_code == 400
        assert reply.json()["error"]["param"] == f"structured_outputs.{kind}"


def test_what_a_background_chat_refuses_is_in_the_schema(fuzzed_server: LiveServer) -> None:
    body = _body_schema(_schema(fuzzed_server), "ChatCompletionRequest")
    [rule] = [r for r in body["allOf"] if r.get("if", {}).get("properties") == {
        "background": {"const": True}}]  # fmt: skip
    then = rule["then"]["properties"]
    assert then["chat_template"] == then["chat_template_kwargs"] == {"type": "null"}
    assert (then["priority"], then["continue_final_message"], then["add_generation_prompt"]) == (
        {"const": 0}, {"const": False}, {"const": True})  # fmt: skip
    for field, value in (("chat_template", "{{ 1 }}"), ("chat_template_kwargs", {})):
        reply = _post(fuzzed_server, "/v1/chat/completions",
                      {**CHAT, "background": True, field: value})  # fmt: skip
        assert reply.status_code == 400 and reply.json()["error"]["param"] == field


def test_background_replies_and_rules_are_in_the_schema(fuzzed_server: LiveServer) -> None:
    """A background chat's first answer (queued, no usage) is one of the 200s the schema
    documents, and a background response needs `store` (random-seed runs found both)."""
    schema = _schema(fuzzed_server)
    ok = schema["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]
    refs = {s["$ref"] for s in ok["content"]["application/json"]["schema"]["anyOf"]}
    assert refs == {"#/components/schemas/ChatCompletionResponse",
                    "#/components/schemas/BackgroundChatCompletion"}  # fmt: skip
    reply = _post(fuzzed_server, "/v1/chat/completions", {**CHAT, "background": True})
    assert reply.status_code == 200
    assert (reply.json()["status"], reply.json()["choices"]) == ("queued", [])
    assert "usage" not in reply.json()
    rules = _body_schema(schema, "ResponsesRequest")["allOf"]
    background = next(r for r in rules if r["if"]["properties"] == {"background": {"const": True}})
    assert background["then"]["properties"]["store"] == {"const": True}
    refused = _post(fuzzed_server, "/v1/responses",
                    {"input": "hi", "max_output_tokens": 2, "background": True, "store": False})  # fmt: skip
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "background"
