"""The chat template as transformers renders it: tools, assistant tool calls and tool results
(a Qwen2.5-style template), a per-request template, and continue_final_message."""

from __future__ import annotations

import json

import pytest
from transformers import PreTrainedTokenizerFast

from duet.engine import InvalidInputError
from duet.engine.tokenizer import Tokenizer

# Qwen2.5-Instruct's tool-calling template, shortened (its system-prompt wording aside).
QWEN_TOOLS = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- set tool_call = tool_call.function %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}'
    "{{- '\", \"arguments\": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
MESSAGES = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "rain, 12 C"},
]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizers(tiny_llama: str) -> tuple[Tokenizer, PreTrainedTokenizerFast]:
    ours = Tokenizer.from_dir(tiny_llama)
    return ours, PreTrainedTokenizerFast(tokenizer_object=ours.backend)


def test_tools_and_tool_turns_render_as_transformers_does(tokenizers) -> None:
    ours, hf = tokenizers
    for gen in (True, False):
        got = ours.apply_chat_template(MESSAGES, gen, chat_template=QWEN_TOOLS, tools=TOOLS)
        want = hf.apply_chat_template(
            MESSAGES, tools=TOOLS, chat_template=QWEN_TOOLS, add_generation_prompt=gen,
            tokenize=False,
        )  # fmt: skip
        assert got == want
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in got
    assert "<tool_response>\nrain, 12 C\n</tool_response>" in got
    assert json.dumps(TOOLS[0]) in got


def test_continue_final_message_as_transformers_does(tokenizers) -> None:
    ours, hf = tokenizers
    messages = [MESSAGES[0], {"role": "assistant", "content": "It is "}]
    got = ours.apply_chat_template(messages, False, QWEN_TOOLS, continue_final_message=True)
    want = hf.apply_chat_template(
        messages, chat_template=QWEN_TOOLS, continue_final_message=True, tokenize=False
    )
    assert got == want
    assert got.endswith("<|im_start|>assistant\nIt is ")  # cut right after the content
    # The model's own template (ChatML) by default; a missing final message is refused.
    assert ours.apply_chat_template(messages[:1]).endswith("<|im_start|>assistant\n")
    with pytest.raises(InvalidInputError) as e:
        ours.apply_chat_template(
            [{"role": "assistant", "content": "x"}], False, "{{ 'y' }}", continue_final_message=True
        )
    assert e.value.field == "continue_final_message"
    with pytest.raises(InvalidInputError) as e:
        ours.apply_chat_template(messages, chat_template="{% if %}")
    assert e.value.field == "chat_template"
