"""POST /v1/completions through the official openai client: prompts as text, token ids or
lists of either; choice indices, logprobs and usage in OpenAI's shapes."""

from __future__ import annotations

import openai

from duet.engine import LLM, SamplingParams
from tests.router.rest_server import MODEL_NAME

PROMPT = "The quick brown fox jumps over the lazy dog."
IDS = dict(extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})


def _token_ids(choice) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]


def test_greedy_tokens_match_offline_llm(client: openai.OpenAI, reference_llm: LLM) -> None:
    resp = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, temperature=0, max_tokens=12, logprobs=0, **IDS
    )
    ref = reference_llm.generate(
        PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    )[0]
    assert resp.object == "text_completion"
    [choice] = resp.choices
    assert _token_ids(choice) == ref.token_ids
    assert choice.text == ref.text
    assert choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == len(reference_llm.tokenizer.encode(PROMPT))
    assert resp.usage.completion_tokens == 12


def test_default_max_tokens_is_16(client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True}
    )
    assert resp.usage.completion_tokens == 16


def test_stream_matches_non_stream_with_usage(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, temperature=0, max_tokens=12, **IDS)
    full = client.completions.create(**kwargs)
    chunks = list(
        client.completions.create(
            stream=True,
            stream_options={"include_usage": True},
            **kwargs,
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_token_id_prompt_equals_text_prompt(client: openai.OpenAI, reference_llm: LLM) -> None:
    ids = reference_llm.tokenizer.encode(PROMPT)
    by_text = client.completions.create(model=MODEL_NAME, prompt=PROMPT, temperature=0, **IDS)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, temperature=0, **IDS)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_many_prompts_and_n(client: openai.OpenAI, reference_llm: LLM) -> None:
    prompts = [PROMPT, "def add(a, b):", "Continuous batching mixes"]
    resp = client.completions.create(
        model=MODEL_NAME, prompt=prompts, n=2, temperature=0, max_tokens=6, **IDS
    )
    refs = reference_llm.generate(
        prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    )
    assert [c.index for c in resp.choices] == list(range(6))
    for i, ref in enumerate(refs):
        for j in range(2):  # choice i * n + j is sample j of prompt i; greedy: all alike
            assert resp.choices[2 * i + j].text == ref.text
    assert resp.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in refs)
    assert resp.usage.completion_tokens == 6 * 6

    streamed = [""] * 6
    for chunk in client.completions.create(
        model=MODEL_NAME, prompt=prompts, n=2, temperature=0, max_tokens=6, stream=True, **IDS
    ):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [c.text for c in resp.choices]


def test_list_of_token_id_lists(client: openai.OpenAI, reference_llm: LLM) -> None:
    prompts = [reference_llm.tokenizer.encode(p) for p in (PROMPT, "def add(a, b):")]
    resp = client.completions.create(
        model=MODEL_NAME, prompt=prompts, temperature=0, max_tokens=4, **IDS
    )
    assert len(resp.choices) == 2
    assert resp.usage.prompt_tokens == sum(map(len, prompts))


def test_logprobs_shape(client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, temperature=0, max_tokens=10, logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    lp = resp.choices[0].logprobs
    assert lp is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 10
    assert len(lp.text_offset) == 10
    assert lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0
        assert 1 <= len(top) <= 3  # two alternatives plus the sampled token (texts may collide)
        assert max(top.values()) >= logprob - 1e-6
        assert token in top
