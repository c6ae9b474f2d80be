"""The public gRPC service through generated stubs: streaming, health, reflection, errors."""

from __future__ import annotations

import asyncio
import filecmp
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from duet.engine import LLM, AsyncEngine, EngineConfig, SamplingParams
from duet.router.front_door import FrontDoor, RouterOptions
from duet.router.grpc_server import start_grpc_server
from duet.v1 import serving_pb2, serving_pb2_grpc
from tests.router.rest_server import TRUSTED_TEMPLATES
from tests.waiting import wait_for

API_KEY = "test-key-123"
AUTH = (("authorization", f"Bearer {API_KEY}"),)


class ServerThread:
    """The engine and the gRPC server on their own event loop in a background thread."""

    def __init__(self, model: str) -> None:
        self.engine = AsyncEngine.from_config(
            EngineConfig(model=model, dtype="float32", load_progress=False, max_model_len=256)
        )
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            options = RouterOptions(api_keys=[API_KEY], chat_options=TRUSTED_TEMPLATES)
            front = FrontDoor.compose(self.engine, "tiny", options)
            self.server, self.port = self.loop.run_until_complete(start_grpc_server(front, port=0))
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert started.wait(60), "gRPC server did not start"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(grace=1), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.engine.shutdown()


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = ServerThread(tiny_llama)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel):
    return serving_pb2_grpc.DuetStub(channel)


def collect(responses):
    text, ids, finish, usage = {}, {}, {}, None
    for r in responses:
        if r.HasField("usage"):
            usage = r.usage
            continue
        text[r.index] = text.get(r.index, "") + r.text
        ids.setdefault(r.index, []).extend(r.token_ids)
        if r.finish_reason:
            finish[r.index] = r.finish_reason
    return text, ids, finish, usage


def test_generate_stream_matches_offline(stub, tiny_llama):
    prompt = "The quick brown fox"
    ref = LLM(tiny_llama, dtype="float32", load_progress=False).generate(
        prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    )[0]
    opts = serving_pb2.SamplingOptions(max_tokens=12, temperature=0, ignore_eos=True)
    responses = list(
        stub.Generate(
            serving_pb2.GenerateRequest(text=prompt, sampling=opts), metadata=AUTH, timeout=60
        )
    )
    assert len(responses) > 2  # streamed in pieces, not one message
    text, ids, finish, usage = collect(responses)
    assert ids[0] == ref.token_ids and text[0] == ref.text and finish[0] == "length"
    assert usage.prompt_tokens == len(ref.prompt_token_ids) and usage.completion_tokens == 12


def test_token_id_prompt_n_and_logprobs(stub):
    opts = serving_pb2.SamplingOptions(
        max_tokens=5, temperature=1.0, seed=3, n=2, logprobs=2, ignore_eos=True
    )
    req = serving_pb2.GenerateRequest(
        token_ids=serving_pb2.TokenIds(ids=[5, 6, 7, 8]), sampling=opts
    )
    responses = list(stub.Generate(req, metadata=AUTH, timeout=60))
    _, ids, _, usage = collect(responses)
    assert sorted(ids) == [0, 1] and all(len(v) == 5 for v in ids.values())
    assert usage.completion_tokens == 10
    lps = [lp for r in responses for lp in r.logprobs if r.index == 0]
    assert [lp.sampled.token_id for lp in lps] == ids[0]
    assert all(len(lp.top) == 2 and lp.sampled.logprob <= 0 for lp in lps)


def test_prompt_logprobs(stub, tiny_llama):
    prompt = [5, 6, 7, 8, 9]
    ref = LLM(tiny_llama, dtype="float32", load_progress=False).generate(
        [prompt], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2)
    )[0]
    opts = serving_pb2.SamplingOptions(max_tokens=2, temperature=0, prompt_logprobs=2, n=2)
    req = serving_pb2.GenerateRequest(token_ids=serving_pb2.TokenIds(ids=prompt), sampling=opts)
    responses = list(stub.Generate(req, metadata=AUTH, timeout=60))
    carrying = [r for r in responses if r.prompt_logprobs]
    assert len(carrying) == 1  # once per request, whatever `n`
    entries = carrying[0].prompt_logprobs
    assert len(entries) == len(prompt) and not entries[0].HasField("sampled")
    assert ref.prompt_logprobs is not None
    for token, entry, expected in zip(
        prompt[1:], entries[1:], ref.prompt_logprobs[1:], strict=True
    ):
        assert entry.sampled.token_id == token
        assert entry.sampled.rank == expected[token].rank
        assert entry.sampled.logprob == pytest.approx(expected[token].logprob, abs=1e-5)
        assert [t.rank for t in entry.top] == [1, 2]
        assert {t.token_id for t in entry.top} == {
            t for t, lp in expected.items() if lp.rank is not None and lp.rank <= 2
        }


def test_chat(stub):
    opts = serving_pb2.SamplingOptions(max_tokens=6, temperature=0, ignore_eos=True)
    req = serving_pb2.ChatRequest(
        messages=[serving_pb2.ChatMessage(role="user", content="hello")], sampling=opts
    )
    _, ids, finish, usage = collect(stub.Chat(req, metadata=AUTH, timeout=60))
    assert len(ids[0]) == 6 and finish[0] == "length" and usage.prompt_tokens > 5


def test_structured_outputs(stub):
    so = serving_pb2.StructuredOutputs
    cases = [
        (so(regex="[a-c]{3}-[0-9]{2}"), lambda t: re.fullmatch("[a-c]{3}-[0-9]{2}", t)),
        (so(choice=serving_pb2.Choices(choices=["yes", "no"])), lambda t: t in ("yes", "no")),
        (so(json='{"type": "object", "properties": {"k": {"enum": [1, 2]}}, "required": ["k"]}'),
         lambda t: json.loads(t)["k"] in (1, 2)),
    ]  # fmt: skip
    for spec, check in cases:
        opts = serving_pb2.SamplingOptions(
            max_tokens=60, temperature=1.0, seed=1, n=3, structured_outputs=spec
        )
        req = serving_pb2.GenerateRequest(text="hi", sampling=opts)
        text, _, finish, _ = collect(list(stub.Generate(req, metadata=AUTH, timeout=60)))
        assert sorted(text) == [0, 1, 2] and set(finish.values()) == {"stop"}
        assert all(check(t) for t in text.values()), text


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (serving_pb2.StructuredOutputs(regex="(ab"), "structured_outputs.regex"),
        (serving_pb2.StructuredOutputs(json='{"type": 5}'), "structured_outputs.json"),
        (serving_pb2.StructuredOutputs(), "structured_outputs"),
    ],
)
def test_invalid_structured_outputs_name_the_field(stub, spec, field):
    opts = serving_pb2.SamplingOptions(structured_outputs=spec)
    with pytest.raises(grpc.RpcError) as info:
        list(
            stub.Generate(
                serving_pb2.GenerateRequest(text="hi", sampling=opts), metadata=AUTH, timeout=10
            )
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(f"{field}:")


def test_list_models(stub):
    models = stub.ListModels(serving_pb2.ListModelsRequest(), metadata=AUTH, timeout=10).models
    assert [(m.id, m.max_model_len, m.deterministic) for m in models] == [("tiny", 256, True)]


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        (serving_pb2.SamplingOptions(temperature=-1), "temperature"),
        (serving_pb2.SamplingOptions(max_tokens=0), "max_tokens"),
        (serving_pb2.SamplingOptions(top_p=1.5), "top_p"),
        (serving_pb2.SamplingOptions(max_tokens=300), "max_tokens"),  # beyond the 256 context
        (serving_pb2.SamplingOptions(prompt_logprobs=21), "prompt_logprobs"),
    ],
)
def test_invalid_argument_names_field(stub, sampling, field):
    with pytest.raises(grpc.RpcError) as info:
        list(
            stub.Generate(
                serving_pb2.GenerateRequest(text="hi", sampling=sampling), metadata=AUTH, timeout=10
            )
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(f"{field}:")


def test_empty_prompt_and_bad_role(stub):
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(serving_pb2.GenerateRequest(text=""), metadata=AUTH, timeout=10))
    assert (
        info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in info.value.details()
    )
    bad = serving_pb2.ChatRequest(messages=[serving_pb2.ChatMessage(role="wizard", content="x")])
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Chat(bad, metadata=AUTH, timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "role" in info.value.details()


def test_auth_required(stub):
    for metadata in ((), (("authorization", "Bearer wrong"),)):
        with pytest.raises(grpc.RpcError) as info:
            list(
                stub.Generate(serving_pb2.GenerateRequest(text="hi"), metadata=metadata, timeout=10)
            )
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:
            stub.ListModels(serving_pb2.ListModelsRequest(), metadata=metadata, timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_unknown_model(stub):
    with pytest.raises(grpc.RpcError) as info:
        list(
            stub.Generate(
                serving_pb2.GenerateRequest(model="gpt-5", text="hi"), metadata=AUTH, timeout=10
            )
        )
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_health_without_key(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "duet.v1.Duet"):
        status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_service(channel):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
    )
    names = [s.name for r in responses for s in r.list_services_response.service]
    assert "duet.v1.Duet" in names and "grpc.health.v1.Health" in names


def _reflect_v1(channel, request):
    """One call of reflection v1 (`grpc.reflection.v1`), as grpcurl makes it: the messages are
    v1alpha's, field for field, so its classes encode them."""
    call = channel.stream_stream(
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    [response] = list(call(iter([request]), timeout=10))
    return response


def test_reflection_v1_beside_v1alpha(channel):
    listed = _reflect_v1(channel, reflection_pb2.ServerReflectionRequest(list_services=""))
    names = {s.name for s in listed.list_services_response.service}
    assert names == {
        "duet.v1.Duet",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    found = _reflect_v1(
        channel, reflection_pb2.ServerReflectionRequest(file_containing_symbol="duet.v1.Duet")
    )
    [first, *_] = found.file_descriptor_response.file_descriptor_proto
    assert descriptor_pb2.FileDescriptorProto.FromString(first).name == "duet/v1/serving.proto"
    missing = _reflect_v1(
        channel, reflection_pb2.ServerReflectionRequest(file_containing_symbol="duet.v1.Nope")
    )
    assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


def test_logit_bias_over_grpc(stub):
    opts = serving_pb2.SamplingOptions(
        max_tokens=5, temperature=0, ignore_eos=True, logit_bias={17: 100.0}
    )
    request = serving_pb2.GenerateRequest(text="hello", sampling=opts)
    _, ids, _, _ = collect(stub.Generate(request, metadata=AUTH, timeout=60))
    assert ids == {0: [17] * 5}
    for bias, message in (({512: 1.0}, "[0, 512)"), ({3: 150.0}, "[-100, 100]")):
        opts = serving_pb2.SamplingOptions(max_tokens=2, logit_bias=bias)
        request = serving_pb2.GenerateRequest(text="hello", sampling=opts)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request, metadata=AUTH, timeout=60))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("logit_bias: ") and message in info.value.details()


def test_allowed_token_ids_and_a_kept_stop_string_over_grpc(stub):
    opts = serving_pb2.SamplingOptions(max_tokens=6, temperature=0, ignore_eos=True,
                                       allowed_token_ids=[40, 41])  # fmt: skip
    request = serving_pb2.GenerateRequest(text="hello", sampling=opts)
    _, ids, _, _ = collect(stub.Generate(request, metadata=AUTH, timeout=60))
    assert len(ids[0]) == 6 and set(ids[0]) <= {40, 41}
    free = serving_pb2.SamplingOptions(max_tokens=12, temperature=0, ignore_eos=True)
    text, _, _, _ = collect(stub.Generate(serving_pb2.GenerateRequest(text="hello", sampling=free),
                                          metadata=AUTH, timeout=60))  # fmt: skip
    stop = text[0][3:6]
    kept = serving_pb2.SamplingOptions(max_tokens=12, temperature=0, ignore_eos=True,
                                       stop=[stop], include_stop_str_in_output=True)  # fmt: skip
    got, _, _, _ = collect(stub.Generate(serving_pb2.GenerateRequest(text="hello", sampling=kept),
                                         metadata=AUTH, timeout=60))  # fmt: skip
    assert got[0] == text[0][: text[0].find(stop) + 3]
    opts = serving_pb2.SamplingOptions(max_tokens=2, allowed_token_ids=[3, 512])
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(serving_pb2.GenerateRequest(text="hello", sampling=opts),
                           metadata=AUTH, timeout=60))  # fmt: skip
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("allowed_token_ids: ")


def test_truncate_prompt_tokens_over_grpc(stub):
    ids = list(range(40, 60))

    def generate(prompt, **kw):
        opts = serving_pb2.SamplingOptions(max_tokens=4, temperature=0, ignore_eos=True, **kw)
        request = serving_pb2.GenerateRequest(token_ids=serving_pb2.TokenIds(ids=prompt),
                                              sampling=opts)  # fmt: skip
        _, out, _, usage = collect(stub.Generate(request, metadata=AUTH, timeout=60))
        return out[0], usage.prompt_tokens

    assert generate(ids, truncate_prompt_tokens=6) == (generate(ids[-6:])[0], 6)
    chat = serving_pb2.ChatRequest(
        messages=[serving_pb2.ChatMessage(role="user", content="hello there")],
        sampling=serving_pb2.SamplingOptions(max_tokens=2, truncate_prompt_tokens=3),
    )
    *_, usage = collect(stub.Chat(chat, metadata=AUTH, timeout=60))
    assert usage.prompt_tokens == 3
    for keep in (0, 5000):
        with pytest.raises(grpc.RpcError) as info:
            generate(ids, truncate_prompt_tokens=keep)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("truncate_prompt_tokens: ")
    with pytest.raises(grpc.RpcError) as info:
        generate(ids, cache_salt="")
    assert info.value.details().startswith("cache_salt: ")
    with pytest.raises(grpc.RpcError) as info:
        generate(ids, bad_words=[""])
    assert info.value.details().startswith("bad_words: ")


def test_a_request_without_an_id_gets_a_unique_one(stub):
    opts = serving_pb2.SamplingOptions(max_tokens=2, temperature=0)
    ids = set()
    for _ in range(2):
        request = serving_pb2.GenerateRequest(text="hello", sampling=opts)
        ids |= {r.request_id for r in stub.Generate(request, metadata=AUTH, timeout=60)}
    assert len(ids) == 2
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)


def test_cancelled_stream_frees_blocks(server, stub):
    opts = serving_pb2.SamplingOptions(max_tokens=200, ignore_eos=True)
    call = stub.Generate(
        serving_pb2.GenerateRequest(text="The quick brown fox", sampling=opts),
        metadata=AUTH,
        timeout=60,
    )
    next(call)
    call.cancel()
    engine = server.engine.engine
    wait_for(
        lambda: (
            engine.kv.num_free_blocks == engine.num_blocks and not engine.has_unfinished_requests()
        ),
        5,
        "the cancelled request to free its blocks",
    )


def test_generated_modules_are_fresh(tmp_path):
    # NOTE: protoc runs in a process of its own, as `make proto` runs it. In-process, the
    # pytest-xdist worker running this test ended without a word, twice in full runs.
    generate = subprocess.run(
        [sys.executable, os.path.join("proto", "generate.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert generate.returncode == 0, generate.stderr
    protos = sorted(str(p.relative_to("proto")) for p in Path("proto/duet/v1").glob("*.proto"))
    assert protos  # the committed .proto files, each regenerated above
    for proto in protos:
        stem = proto.removesuffix(".proto")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            fresh, committed = (
                tmp_path / f"{stem}{suffix}",
                os.path.join("proto", f"{stem}{suffix}"),
            )
            assert filecmp.cmp(fresh, committed, shallow=False), (
                f"{committed} is stale: run make proto"
            )


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [serving_pb2.Tool(name="get_weather", parameters_json=json.dumps(WEATHER))]


def _calls(responses):
    """(tool calls as [id, name, arguments], finish reason per index, usage)."""
    calls, finish, usage = [], {}, None
    for r in responses:
        if r.HasField("usage"):
            usage = r.usage
            continue
        assert r.text == ""  # a tool-call reply has no content
        for d in r.tool_calls:
            if d.id:
                assert d.index == len(calls)
                calls.append([d.id, d.name, ""])
            calls[d.index][2] += d.arguments
        finish[r.index] = r.finish_reason or finish.get(r.index)
    return calls, finish, usage


def test_chat_tool_calls_and_a_tool_round_trip(server, stub):
    import jsonschema

    user = serving_pb2.ChatMessage(role="user", content="weather?")
    opts = serving_pb2.SamplingOptions(max_tokens=100, temperature=1.0, seed=3)
    for choice in (dict(tool_choice="required"), dict(tool_choice_function="get_weather")):
        req = serving_pb2.ChatRequest(messages=[user], sampling=opts, tools=TOOLS, **choice)
        calls, finish, _ = _calls(stub.Chat(req, metadata=AUTH, timeout=60))
        assert finish[0] == ("tool_calls" if "tool_choice" in choice else "stop")
        assert calls and all(name == "get_weather" for _, name, _ in calls)
        for _, _, arguments in calls:
            jsonschema.validate(json.loads(arguments), WEATHER)
    # The call and its result reach the template: the prompt is what the template renders.
    template = (
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}[{{ c.id }} {{ c.function.arguments | tojson }}]"
        "{% endfor %}{% if m.tool_call_id %}<{{ m.tool_call_id }}>{% endif %}|{% endfor %}"
    )
    call = serving_pb2.ToolCall(id="call_1", name="get_weather", arguments='{"city": "x"}')
    messages = [
        user,
        serving_pb2.ChatMessage(role="assistant", tool_calls=[call]),
        serving_pb2.ChatMessage(role="tool", tool_call_id="call_1", content="rain"),
    ]
    req = serving_pb2.ChatRequest(
        messages=messages, tools=TOOLS, chat_template=template,
        sampling=serving_pb2.SamplingOptions(max_tokens=3, temperature=0),
    )  # fmt: skip
    text, _, finish, usage = collect(stub.Chat(req, metadata=AUTH, timeout=60))
    assert finish[0] == "length" and text[0]
    prompt = 'user:weather?|assistant:[call_1 {"city": "x"}]|tool:rain<call_1>|'
    assert usage.prompt_tokens == len(
        server.engine.tokenizer.encode(prompt, add_special_tokens=False)
    )


@pytest.mark.parametrize(
    "request_kwargs, field",
    [
        (dict(tool_choice_function="nope"), "tool_choice"),
        (dict(tool_choice="sometimes"), "tool_choice"),
        (dict(tools=[serving_pb2.Tool(name="f", parameters_json="{oops")]),
         "tools[0].parameters_json"),
        (dict(priority=2), "priority"),
        (dict(chat_template_kwargs_json="[1]"), "chat_template_kwargs"),
    ],
)  # fmt: skip
def test_bad_tool_and_template_fields_name_the_field(stub, request_kwargs, field):
    kwargs = {"tools": TOOLS, **request_kwargs}
    req = serving_pb2.ChatRequest(
        messages=[serving_pb2.ChatMessage(role="user", content="x")], **kwargs
    )
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Chat(req, metadata=AUTH, timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(f"{field}:"), info.value.details()


def test_embed_gives_the_engines_vectors_and_names_bad_input(stub, tiny_llama):
    """`Embed` as REST's /v1/embeddings: one vector per input (text or token ids), in order,
    the offline engine's; bad input is INVALID_ARGUMENT naming `input`."""
    texts = ["The quick brown fox", "hello"]
    params = SamplingParams(temperature=0, max_tokens=1, pooling="last")
    ref = LLM(tiny_llama, dtype="float32", load_progress=False).generate(texts, params)
    inputs = [serving_pb2.EmbedInput(text=t) for t in texts]
    inputs.append(
        serving_pb2.EmbedInput(token_ids=serving_pb2.TokenIds(ids=ref[0].prompt_token_ids))
    )
    reply = stub.Embed(serving_pb2.EmbedRequest(inputs=inputs), metadata=AUTH, timeout=60)
    # float32 on the wire, as the engine's vectors are
    assert [list(e.values) for e in reply.embeddings] == [
        ref[0].embedding, ref[1].embedding, ref[0].embedding,
    ]  # fmt: skip
    assert reply.usage.prompt_tokens == 2 * len(ref[0].prompt_token_ids) + len(
        ref[1].prompt_token_ids
    )
    assert reply.request_id  # a fresh one when the client sends none
    for bad in (
        [],
        [serving_pb2.EmbedInput(text="")],
        [serving_pb2.EmbedInput()],
        [serving_pb2.EmbedInput(token_ids=serving_pb2.TokenIds(ids=[10**9]))],
        [serving_pb2.EmbedInput(text="x " * 400)],  # past the 256-token context
    ):
        with pytest.raises(grpc.RpcError) as info:
            stub.Embed(serving_pb2.EmbedRequest(inputs=bad), metadata=AUTH, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
        assert info.value.details().startswith("input:"), info.value.details()
    ids = ref[0].prompt_token_ids
    cut = stub.Embed(
        serving_pb2.EmbedRequest(inputs=inputs[:1], truncate_prompt_tokens=3),
        metadata=AUTH, timeout=60,
    )  # fmt: skip
    last3 = serving_pb2.EmbedInput(token_ids=serving_pb2.TokenIds(ids=ids[-3:]))
    want = stub.Embed(serving_pb2.EmbedRequest(inputs=[last3]), metadata=AUTH, timeout=60)
    assert list(cut.embeddings[0].values) == list(want.embeddings[0].values)
    assert cut.usage.prompt_tokens == 3
    with pytest.raises(grpc.RpcError) as info:
        stub.Embed(
            serving_pb2.EmbedRequest(inputs=inputs[:1], truncate_prompt_tokens=0),
            metadata=AUTH, timeout=10,
        )  # fmt: skip
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("truncate_prompt_tokens:")
    one = [serving_pb2.EmbedInput(text="hi")]
    with pytest.raises(grpc.RpcError) as info:
        stub.Embed(serving_pb2.EmbedRequest(inputs=one), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as info:
        stub.Embed(serving_pb2.EmbedRequest(model="gpt-5", inputs=one), metadata=AUTH, timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
