"""OpenAI sampling fields over REST, through the official client: `logit_bias` (a bias on
the sampler's logits, exact and deterministic) on chat completions and completions, vLLM's
`allowed_token_ids`, `bad_words`, `include_stop_str_in_output`, `truncate_prompt_tokens` and
`cache_salt`, and `stream_options.continuous_usage_stats`
(vLLM's: the usage so far in every chunk)."""

from __future__ import annotations

import uuid

import openai
import pytest

from duet.engine import AsyncEngine
from tests.router.rest_server import MODEL_NAME

MESSAGES = [{"role": "user", "content": "hello"}]


def test_chat_logit_bias_forces_a_token(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
        logit_bias={"300": 100},
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert [t.token for t in logprobs.content] == ["token_id:300"] * 6


def test_completion_logit_bias_forces_and_bans(client: openai.OpenAI) -> None:
    base = client.completions.create(
        model=MODEL_NAME, prompt=[5, 6, 7, 8], max_tokens=5, temperature=0, logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    forced = client.completions.create(
        model=MODEL_NAME, prompt=[5, 6, 7, 8], max_tokens=5, temperature=0, logprobs=0,
        logit_bias={"42": 100}, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    assert forced.choices[0].logprobs is not None
    assert forced.choices[0].logprobs.tokens == ["token_id:42"] * 5
    assert base.choices[0].logprobs is not None
    first = base.choices[0].logprobs.tokens[0]
    banned = first.removeprefix("token_id:")
    again = client.completions.create(
        model=MODEL_NAME, prompt=[5, 6, 7, 8], max_tokens=5, temperature=0, logprobs=0,
        logit_bias={banned: -100}, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    assert again.choices[0].logprobs is not None
    assert first not in again.choices[0].logprobs.tokens


def test_chat_allowed_token_ids_sample_only_those(client: openai.OpenAI) -> None:
    allowed = [11, 300, 301, 302]
    for temperature in (0, 1.0):
        out = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=temperature, seed=3,
            logprobs=True, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True,
                                       "allowed_token_ids": allowed},
        )  # fmt: skip
        content = out.choices[0].logprobs.content  # type: ignore[union-attr]
        assert content is not None and len(content) == 8
        assert {t.token for t in content} <= {f"token_id:{a}" for a in allowed}


def test_completion_bad_words_turn_greedy_off_them(client: openai.OpenAI) -> None:
    greedy = dict(model=MODEL_NAME, prompt=[5, 6, 7, 8], max_tokens=12, temperature=0,
                  extra_body={"ignore_eos": True})  # fmt: skip
    free = client.completions.create(**greedy).choices[0].text  # type: ignore[call-overload]
    word = free.split()[0]
    out = client.completions.create(**{**greedy, "extra_body": {"ignore_eos": True,  # type: ignore[call-overload]
                                                                "bad_words": [word]}})  # fmt: skip
    assert word in free and word not in out.choices[0].text


def test_completion_stop_string_kept_when_asked(client: openai.OpenAI) -> None:
    free = client.completions.create(model=MODEL_NAME, prompt=[5, 6, 7, 8], max_tokens=12,
                                     temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    text = free.choices[0].text
    stop = text[3:6]
    assert len(stop) == 3
    for keep, want in ((False, text[: text.find(stop)]),
                       (True, text[: text.find(stop) + 3])):  # fmt: skip
        out = client.completions.create(
            model=MODEL_NAME, prompt=[5, 6, 7, 8], max_tokens=12, temperature=0, stop=[stop],
            extra_body={"ignore_eos": True, "include_stop_str_in_output": keep},
        )  # fmt: skip
        assert (out.choices[0].text, out.choices[0].finish_reason) == (want, "stop")


def test_completion_truncate_prompt_tokens_keeps_the_last_ones(client: openai.OpenAI) -> None:
    prompt = list(range(40, 60))
    greedy = dict(model=MODEL_NAME, max_tokens=6, temperature=0, echo=True)
    cut = client.completions.create(prompt=prompt, **greedy,
                                    extra_body={"truncate_prompt_tokens": 5})  # fmt: skip
    tail = client.completions.create(prompt=prompt[-5:], **greedy)
    assert cut.usage is not None and cut.usage.prompt_tokens == 5
    assert cut.choices[0].text == tail.choices[0].text  # the echo is the prompt read
    whole = client.completions.create(prompt=prompt, **greedy,
                                      extra_body={"truncate_prompt_tokens": -1})  # fmt: skip
    assert whole.usage is not None and whole.usage.prompt_tokens == 20


def test_a_text_too_long_for_the_context_is_served_truncated(
    client: openai.OpenAI, rest_engine: AsyncEngine
) -> None:
    tokenizer = rest_engine.engine.tokenizer
    assert tokenizer.max_token_chars is not None
    text = "a b " * (rest_engine.max_model_len * tokenizer.max_token_chars // 4 + 100)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt=text, max_tokens=2)
    assert info.value.param == "prompt"  # provably too long, refused before tokenizing
    for body in ({"prompt": text}, {"messages": [{"role": "user", "content": text}]}):
        create = client.completions.create if "prompt" in body else client.chat.completions.create
        out = create(model=MODEL_NAME, max_tokens=2, **body,  # type: ignore[operator]
                     extra_body={"truncate_prompt_tokens": 8})  # fmt: skip
        assert out.usage.prompt_tokens == 8


def test_chat_prefix_cache_hits_only_within_a_cache_salt(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "a long enough question " * 8}]

    def cached(salt: str) -> int:
        out = client.chat.completions.create(model=MODEL_NAME, messages=messages,  # type: ignore[arg-type]
                                             max_tokens=1, extra_body={"cache_salt": salt})  # fmt: skip
        assert out.usage is not None and out.usage.prompt_tokens_details is not None
        return out.usage.prompt_tokens_details.cached_tokens or 0

    first = f"tenant-{uuid.uuid4().hex}"
    assert cached(first) == 0
    assert cached(first) > 0
    assert cached(f"tenant-{uuid.uuid4().hex}") == 0


def test_seeded_logit_bias_is_deterministic(client: openai.OpenAI) -> None:
    bias = {str(t): 4 for t in range(200, 260)}

    def draw() -> str:
        out = client.completions.create(
            model=MODEL_NAME, prompt="once upon", max_tokens=12, temperature=1.0, seed=9,
            logit_bias=bias, extra_body={"ignore_eos": True},
        )  # fmt: skip
        return out.choices[0].text

    assert len({draw() for _ in range(3)}) == 1


@pytest.mark.parametrize("include_usage", [True, False])
def test_chat_continuous_usage_stats(client: openai.OpenAI, include_usage: bool) -> None:
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": include_usage, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    if not include_usage:  # as in vLLM, continuous stats need include_usage
        assert all(c.usage is None for c in chunks)
        return
    assert all(c.usage is not None for c in chunks)
    usages = [c.usage for c in chunks if c.usage is not None]
    prompt = usages[-1].prompt_tokens
    assert all(u.prompt_tokens == prompt for u in usages)
    assert all(u.total_tokens == u.prompt_tokens + u.completion_tokens for u in usages)
    completions = [u.completion_tokens for u in usages]
    assert completions[0] == 0  # the role chunk
    assert completions == sorted(completions)
    assert completions[-1] == 5
    # the chunks between carry the count so far (a chunk waits while its text is held back)
    assert all(1 <= n <= 5 for n in completions[1:])
    assert len(set(completions)) > 2


def test_completion_continuous_usage_stats(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL_NAME, prompt=[5, 6, 7], max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    assert all(c.usage is not None for c in chunks)
    usages = [c.usage for c in chunks if c.usage is not None]
    assert all(u.prompt_tokens == 3 for u in usages)
    completions = [u.completion_tokens for u in usages]
    assert completions == sorted(completions) and completions[0] >= 1
    assert len(set(completions)) > 1  # not only the closing usage chunk
    assert not chunks[-1].choices and completions[-1] == 4
