"""Tool calling through REST with the official openai client, on the random tiny model: a
`required` or named tool choice is the grammar's work (the model knows nothing of tools), so
every call's arguments validating is the grammar at work; `auto` is the parser's, checked on
replies a regex forces into the Hermes format."""

from __future__ import annotations

import json
from typing import Any

import httpx2
import jsonschema
import openai
import pytest

from duet.engine import AsyncEngine
from duet.router.openai_chat import ChatPlan
from duet.router.openai_protocol import ChatCompletionRequest
from tests.router.rest_server import API_KEY, MODEL_NAME, TRUSTED_TEMPLATES

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["zone"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": name, "description": f"{name} tool",
                                      "parameters": schema}}
    for name, schema in SCHEMAS.items()
]  # fmt: skip
MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
# A Hermes-style template (as Qwen2.5's) that renders tools, tool calls and tool results.
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}"
    "</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n'
    "</tool_call>{% endfor %}"
    "{% elif m.role == 'tool' %}<tool_response>{{ m.tool_call_id }}: {{ m.content }}"
    "</tool_response>{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HERMES_CALL = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,6}", '
    r'"unit": "c", "days": [1-7]\}\}\n</tool_call>'
)


def _validate(calls: list[Any], parallel: bool = True) -> None:
    assert calls, "no tool calls"
    if not parallel:
        assert len(calls) == 1
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({c.id for c in calls}) == len(calls)


def _streamed_calls(chunks: list[Any]) -> tuple[str, list[dict[str, str]], str | None]:
    """(content, calls as {id, name, arguments}, last finish_reason) from streamed chunks, as
    an OpenAI client assembles them: by index, arguments appended."""
    content, calls, finish = "", [], None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            if delta.id is not None:
                assert delta.index == len(calls) and delta.type == "function"
                calls.append({"id": delta.id, "name": delta.function.name, "arguments": ""})
            calls[delta.index]["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, calls, finish


def test_required_tool_choice_returns_calls_that_validate(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required", n=4,
        temperature=1.0, seed=1, max_tokens=300,
    )  # fmt: skip
    assert len(resp.choices) == 4
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls", choice.message
        assert choice.message.content is None
        _validate(choice.message.tool_calls or [])


def test_named_tool_choice_and_one_call_without_parallel_calls(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=named,  # type: ignore[arg-type]
        n=3, temperature=1.0, seed=2, max_tokens=100,
    )  # fmt: skip
    for choice in resp.choices:
        assert choice.finish_reason == "stop"  # as OpenAI reports a forced function
        [call] = choice.message.tool_calls or []
        assert call.function.name == "get_time"
        _validate([call])
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, n=4, temperature=1.0, seed=3, max_tokens=300,
    )  # fmt: skip
    for choice in resp.choices:
        _validate(choice.message.tool_calls or [], parallel=False)


def test_100_constrained_samples_at_temperature_1_all_validate(client: openai.OpenAI) -> None:
    num_valid = 0
    for seed, choice in enumerate(["required", "required", "named", "named"]):
        tool_choice: Any = choice
        if choice == "named":
            tool_choice = {"type": "function", "function": {"name": "get_weather"}}
        resp = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, n=25,
            parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=200,
        )  # fmt: skip
        for c in resp.choices:
            assert c.finish_reason in ("stop", "tool_calls"), c.message
            _validate(c.message.tool_calls or [], parallel=False)
            num_valid += 1
    assert num_valid == 100


def test_streamed_calls_equal_the_unstreamed_ones(client: openai.OpenAI) -> None:
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        kwargs: Any = dict(
            model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
            temperature=1.0, seed=7, max_tokens=300,
        )  # fmt: skip
        whole = client.chat.completions.create(**kwargs).choices[0]
        content, calls, finish = _streamed_calls(
            list(client.chat.completions.create(**kwargs, stream=True))
        )
        assert (content, finish) == ("", whole.finish_reason)
        expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
        assert [(c["name"], c["arguments"]) for c in calls] == expected


@pytest.mark.parametrize("stream", [False, True])
def test_a_two_turn_tool_round_trip(
    client: openai.OpenAI, rest_engine: AsyncEngine, stream: bool
) -> None:
    first = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required",
        temperature=0, max_tokens=300, extra_body={"chat_template": HERMES_TEMPLATE},
    )  # fmt: skip
    calls = first.choices[0].message.tool_calls or []
    _validate(calls)
    messages = [
        *MESSAGES,
        first.choices[0].message.model_dump(exclude_none=True),
        *({"role": "tool", "tool_call_id": c.id, "content": "sunny, 21 C"} for c in calls),
    ]
    second = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, tools=TOOLS, temperature=0, max_tokens=8,
        stream=stream, stream_options={"include_usage": True} if stream else None,
        extra_body={"chat_template": HERMES_TEMPLATE},
    )  # fmt: skip
    if stream:
        chunks = list(second)
        content, streamed, finish = _streamed_calls(chunks)
        usage = chunks[-1].usage
    else:
        [choice] = second.choices
        content, streamed, finish = choice.message.content or "", [], choice.finish_reason
        usage = second.usage
    assert finish == "length" and content and not streamed  # the final answer, as text
    # The prompt held the tool calls and the tool results as the template renders them.
    tok = rest_engine.tokenizer
    prompt = tok.apply_chat_template(
        [
            MESSAGES[0],
            {"role": "assistant", "content": "",
             "tool_calls": [{"id": c.id, "type": "function", "function": {
                 "name": c.function.name, "arguments": json.loads(c.function.arguments)}}
                 for c in calls]},
            *({"role": "tool", "tool_call_id": c.id, "content": "sunny, 21 C"} for c in calls),
        ],
        chat_template=HERMES_TEMPLATE, tools=TOOLS,
    )  # fmt: skip
    assert f"<tool_response>{calls[0].id}: sunny, 21 C</tool_response>" in prompt
    assert f'"arguments": {calls[0].function.arguments}' in prompt
    assert usage is not None
    assert usage.prompt_tokens == len(tok.encode(prompt, add_special_tokens=False))


def test_auto_parses_the_models_own_tool_calls_streamed_and_not(client: openai.OpenAI) -> None:
    force = {"structured_outputs": {"regex": r"I will check: " + HERMES_CALL}}
    kwargs: Any = dict(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=5,
        max_tokens=200, extra_body=force,
    )  # fmt: skip
    [choice] = client.chat.completions.create(**kwargs).choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I will check: "
    [call] = choice.message.tool_calls or []
    _validate([call])
    content, calls, finish = _streamed_calls(
        list(client.chat.completions.create(**kwargs, stream=True))
    )
    assert (content, finish) == ("I will check: ", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", call.function.arguments)
    ]
    # Text without the format's markers stays content.
    plain = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="auto", max_tokens=20,
        extra_body={"structured_outputs": {"regex": "a <tool or [{]b[}]"}},
    )  # fmt: skip
    assert plain.choices[0].message.content == "a <tool or {b}"
    assert not plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "strng"}}}}}],
          "tool_choice": "required"}, "tools[0].function.parameters"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"messages": [*MESSAGES, {"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
         "messages[0].tool_calls"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400_naming_the_field(
    http: httpx2.Client, extra: dict, param: str
) -> None:
    body = {"model": MODEL_NAME, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, **extra}
    r = http.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_assistant_tool_calls_reach_the_template_intact(rest_engine: AsyncEngine) -> None:
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [
                *MESSAGES,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
            ],
            "tools": TOOLS,
            "chat_template": HERMES_TEMPLATE,
        }
    )  # fmt: skip
    plan = ChatPlan.of(body, TRUSTED_TEMPLATES, rest_engine.tokenizer)
    messages = [m.to_template_message() for m in body.messages]
    assert messages[1]["tool_calls"] == [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    ]  # fmt: skip
    assert messages[2] == {"role": "tool", "content": "rain", "tool_call_id": "call_1"}
    text = rest_engine.tokenizer.decode(
        plan.render(rest_engine.tokenizer, body, messages), skip_special_tokens=False
    )
    assert text == (
        '<|im_start|>system\n<tools>{"type": "function", "function": {"name": "get_weather", '
        f'"description": "get_weather tool", "parameters": {json.dumps(WEATHER)}}}}}'
        '{"type": "function", "function": {"name": "get_time", "description": "get_time tool", '
        f'"parameters": {json.dumps(TIME)}}}}}</tools><|im_end|>\n'
        "<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>tool\n<tool_response>call_1: rain</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
