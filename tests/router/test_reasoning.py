"""Reasoning and chat-template options through REST with the official openai client: a server
started with the qwen3 reasoning parser (on the same engine as the other REST tests) puts the
thinking into `reasoning_content`, and a plain server's greedy text is the oracle for it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from duet.engine import AsyncEngine
from duet.router.openai_chat import ChatOptions
from tests.router.rest_server import API_KEY, MODEL_NAME, LiveServer, make_app

MESSAGES: list[Any] = [{"role": "user", "content": "Think, then answer."}]
# Qwen3's way: the generation prompt opens <think>, or closes an empty one without thinking.
QWEN3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def thinking_client(rest_engine: AsyncEngine) -> Iterator[openai.OpenAI]:
    options = ChatOptions(reasoning_parser="qwen3", trust_request_chat_template=True)
    live = LiveServer(make_app(rest_engine, MODEL_NAME, api_keys=[API_KEY], chat_options=options))
    live.start()
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    yield client
    client.close()
    live.stop()


def _create(client: openai.OpenAI, **kwargs: Any) -> Any:
    extra = {"chat_template": QWEN3_TEMPLATE, **kwargs.pop("extra_body", {})}
    return client.chat.completions.create(
        model=MODEL_NAME, messages=kwargs.pop("messages", MESSAGES), temperature=0,
        max_tokens=kwargs.pop("max_tokens", 12), extra_body=extra, **kwargs,
    )  # fmt: skip


def test_thinking_goes_to_reasoning_content_streamed_and_not(
    client: openai.OpenAI, thinking_client: openai.OpenAI
) -> None:
    plain = _create(client).choices[0].message.content  # the same tokens, unparsed
    assert plain and "</think>" not in plain
    [choice] = _create(thinking_client).choices
    assert (choice.message.reasoning_content, choice.message.content) == (plain, None)
    chunks = list(_create(thinking_client, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == plain
    assert not any(d.content for d in deltas)


def test_enable_thinking_false_through_chat_template_kwargs(
    client: openai.OpenAI, thinking_client: openai.OpenAI
) -> None:
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    plain = _create(client, extra_body=off).choices[0].message.content
    [choice] = _create(thinking_client, extra_body=off).choices
    assert (choice.message.content, choice.message.reasoning_content) == (plain, None)


def test_structured_output_after_a_closed_thought_and_continue_final_message(
    thinking_client: openai.OpenAI,
) -> None:
    n = {"type": "integer", "minimum": 0, "maximum": 99}
    schema = {
        "type": "object",
        "properties": {"n": n},
        "required": ["n"],
        "additionalProperties": False,
    }
    messages = [*MESSAGES, {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\n"}]
    resp = _create(
        thinking_client, messages=messages, max_tokens=30,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )  # fmt: skip
    [choice] = resp.choices
    assert choice.finish_reason == "stop" and choice.message.reasoning_content is None
    assert isinstance(json.loads(choice.message.content)["n"], int)
    # While thinking, the grammar waits: the reply is free text (all reasoning) up to max_tokens.
    resp = _create(thinking_client, max_tokens=8, response_format={"type": "json_object"})
    [choice] = resp.choices
    assert choice.finish_reason == "length" and choice.message.content is None
    assert choice.message.reasoning_content


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"continue_final_message": True}, "continue_final_message"),
        ({"chat_template": "{% for %}"}, "chat_template"),
        ({"chat_template": "{{ messages[0].content + 1 }}"}, "chat_template"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
        ({"continue_final_message": True, "add_generation_prompt": False,
          "chat_template": "{{ 'x' }}"}, "continue_final_message"),
    ],
)  # fmt: skip
def test_bad_template_options_are_400_naming_the_field(
    thinking_client: openai.OpenAI, extra: dict, param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        thinking_client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=2, extra_body=extra
        )
    assert isinstance(e.value.body, dict) and e.value.body["param"] == param
