"""POST /v1/chat/completions through the official openai client: the same tokens as the offline
API, streamed or not, with OpenAI's shapes for n, logprobs, stop, seed and usage."""

from __future__ import annotations

import httpx2
import openai
import pytest

from duet.engine import LLM, SamplingParams
from tests.router.rest_server import API_KEY, MODEL_NAME

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Paged attention stores keys and values in blocks."},
]
GREEDY = dict(temperature=0, max_tokens=16, extra_body={"ignore_eos": True})


def _offline(llm: LLM, messages: list[dict], max_tokens: int = 16):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return llm.chat(messages, params)[0]


def test_greedy_matches_offline_llm_and_usage_counts(
    client: openai.OpenAI, reference_llm: LLM
) -> None:
    resp = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **GREEDY)
    ref = _offline(reference_llm, MESSAGES)
    assert resp.object == "chat.completion"
    assert resp.model == MODEL_NAME
    assert resp.id.startswith("chatcmpl-")
    [choice] = resp.choices
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert choice.message.content == ref.text
    assert choice.finish_reason == "length"
    assert choice.logprobs is None
    num_prompt = len(reference_llm.tokenizer.encode_chat(MESSAGES))
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == num_prompt
    assert resp.usage.completion_tokens == len(ref.token_ids) == 16
    assert resp.usage.total_tokens == num_prompt + 16


def test_stream_deltas_add_up_to_the_full_response(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **GREEDY)
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length"
    assert all(f is None for f in finishes[:-1])
    # include_usage: every chunk carries usage null, the last one (no choices) the totals.
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump(include={"prompt_tokens", "completion_tokens"}) == (
        full.usage.model_dump(include={"prompt_tokens", "completion_tokens"})
    )


def test_stream_without_include_usage_has_no_usage_chunk(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, stream=True, **GREEDY)
    )
    assert all(c.choices for c in chunks)
    assert all(c.usage is None for c in chunks)


def test_content_parts_are_joined_text(client: openai.OpenAI, reference_llm: LLM) -> None:
    parts = [{"type": "text", "text": "Paged attention"}, {"type": "text", "text": "in blocks."}]
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": parts}], **GREEDY
    )
    ref = _offline(reference_llm, [{"role": "user", "content": "Paged attention\nin blocks."}])
    assert resp.choices[0].message.content == ref.text
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_n_choices_streamed_and_not(client: openai.OpenAI) -> None:
    kwargs = dict(
        model=MODEL_NAME, messages=MESSAGES, n=3, temperature=1.0, seed=11, max_tokens=8,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    resp = client.chat.completions.create(**kwargs)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert resp.usage.completion_tokens == 3 * 8
    texts = [c.message.content for c in resp.choices]
    assert len(set(texts)) > 1  # per-sample seeds differ (seed + index)

    streamed = ["", "", ""]
    finished = set()
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert streamed == texts
    assert finished == {0, 1, 2}


def test_logprobs_and_top_logprobs(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, logprobs=True, top_logprobs=3, **GREEDY
    )
    content = resp.choices[0].logprobs.content
    assert content is not None and len(content) == 16
    for item in content:
        assert item.logprob <= 0
        assert item.bytes == list(item.token.encode("utf-8"))
        assert len(item.top_logprobs) == 3
        lps = [t.logprob for t in item.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        # greedy: the sampled token is the most likely one
        assert item.logprob == pytest.approx(lps[0])
    # The streamed logprobs are the same entries, in order.
    streamed = []
    for chunk in client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, logprobs=True, top_logprobs=3, stream=True, **GREEDY
    ):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content or []
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]


def test_logprobs_without_top_logprobs(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, logprobs=True, **GREEDY
    )
    content = resp.choices[0].logprobs.content
    assert content is not None and len(content) == 16
    assert all(item.top_logprobs == [] for item in content)


def test_stop_string_cuts_the_text(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **GREEDY)
    text = full.choices[0].message.content or ""
    # A short ASCII piece from the middle of the greedy text (fixed model: always the same).
    stop = next(text[i : i + 2] for i in range(3, len(text) - 2) if text[i : i + 2].isascii())
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, stop=[stop], **GREEDY
    )
    assert resp.choices[0].message.content == text[: text.index(stop)]
    assert resp.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, stop=stop, stream=True, **GREEDY
        )
        if c.choices
    )
    assert streamed == text[: text.index(stop)]


def test_same_seed_same_text(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        resp = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, temperature=1.0, seed=seed, max_tokens=16,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return resp.choices[0].message.content or ""

    assert sample(1234) == sample(1234)
    assert sample(1234) != sample(4321)


def test_max_completion_tokens_wins_and_extras_are_accepted(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        temperature=0,
        max_tokens=20,
        max_completion_tokens=5,
        extra_body={
            "ignore_eos": True,
            "top_k": 5,
            "min_p": 0.01,
            "repetition_penalty": 1.1,
            "min_tokens": 2,
            "a_field_from_the_future": {"x": 1},  # unknown fields are ignored, like vLLM
        },
    )
    assert resp.usage.completion_tokens == 5


def test_model_may_be_omitted(http: httpx2.Client) -> None:
    r = http.post(
        "/v1/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 2},
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    assert r.status_code == 200
    assert r.json()["model"] == MODEL_NAME
