"""Request bodies -> engine SamplingParams; error locations -> OpenAI `param` names."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from duet.router.errors import format_loc
from duet.router.openai_protocol import ChatCompletionRequest, CompletionRequest

MESSAGES = [{"role": "user", "content": "hi"}]


def test_chat_defaults_and_mapping() -> None:
    req = ChatCompletionRequest.model_validate({"messages": MESSAGES, "unknown_field": 1})
    params = req.to_sampling_params()
    assert params.max_tokens is None  # up to the context
    assert params.temperature == 1.0 and params.top_p == 1.0 and params.top_k == -1
    assert params.logprobs is None
    req = ChatCompletionRequest.model_validate(
        {"messages": MESSAGES, "max_tokens": 9, "max_completion_tokens": 4, "logprobs": True,
         "top_logprobs": 3, "stop": "x", "seed": 5, "session_id": "s1"}
    )  # fmt: skip
    params = req.to_sampling_params()
    assert (params.max_tokens, params.logprobs, params.stop, params.seed) == (4, 3, ["x"], 5)
    assert req.max_tokens_field == "max_completion_tokens"
    assert req.session_id == "s1"


def test_content_parts_join_with_newlines() -> None:
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                   {"type": "text", "text": "b"}]}]}
    )  # fmt: skip
    assert req.messages[0].to_template_message() == {"role": "user", "content": "a\nb"}


def test_top_logprobs_needs_logprobs() -> None:
    with pytest.raises(ValidationError, match="requires logprobs"):
        ChatCompletionRequest.model_validate({"messages": MESSAGES, "top_logprobs": 2})


@pytest.mark.parametrize(
    ("prompt", "prompts"),
    [
        ("a", ["a"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2], [[1, 2]]),
        ([[1], [2, 3]], [[1], [2, 3]]),
        ([], [[]]),
    ],
)
def test_completion_prompt_forms(prompt: object, prompts: list) -> None:
    req = CompletionRequest.model_validate({"prompt": prompt})
    assert req.prompts() == prompts
    assert req.to_sampling_params().max_tokens == 16


def test_format_loc() -> None:
    assert format_loc(("body", "messages", 0, "content")) == "messages[0].content"
    assert format_loc(("body", "temperature")) == "temperature"
    assert format_loc(("body",)) is None
    assert format_loc(("query", "starting_after")) == "starting_after"
    assert format_loc(("path", "response_id")) == "response_id"
