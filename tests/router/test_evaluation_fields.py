"""The fields evaluation harnesses use: `echo` on completions, `/tokenize`, `/detokenize`,
`/version`, and `priority` passed from REST to the engine's scheduler."""

from __future__ import annotations

import importlib.metadata
from typing import Any

import httpx2
import openai
import pytest

from duet.engine import AsyncEngine
from tests.router.rest_server import API_KEY, MODEL_NAME

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_echo_puts_the_prompt_before_each_choice(
    client: openai.OpenAI, rest_engine: AsyncEngine
) -> None:
    kwargs: Any = dict(model=MODEL_NAME, max_tokens=5, temperature=0)
    plain = client.completions.create(prompt=["Paged attention", "fox"], **kwargs)
    echoed = client.completions.create(prompt=["Paged attention", "fox"], echo=True, n=1, **kwargs)
    assert [c.text for c in echoed.choices] == [
        "Paged attention" + plain.choices[0].text,
        "fox" + plain.choices[1].text,
    ]
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            prompt="Paged attention", echo=True, stream=True, **kwargs
        )
        if c.choices
    )
    assert streamed == echoed.choices[0].text
    ids = rest_engine.tokenizer.encode("The quick", add_special_tokens=False)
    by_ids = client.completions.create(prompt=ids, echo=True, **kwargs)
    assert by_ids.choices[0].text.startswith("The quick")


def test_tokenize_and_detokenize(
    http: httpx2.Client, client: openai.OpenAI, rest_engine: AsyncEngine
) -> None:
    tok = rest_engine.tokenizer
    r = http.post("/tokenize", json={"prompt": "The quick brown fox", "return_token_strs": True},
                  headers=AUTH)  # fmt: skip
    assert r.status_code == 200, r.text
    ids = tok.encode("The quick brown fox")
    assert r.json() == {
        "count": len(ids), "max_model_len": rest_engine.max_model_len, "tokens": ids,
        "token_strs": [tok.id_to_token(i) for i in ids],
    }  # fmt: skip
    messages = [{"role": "user", "content": "hello there"}]
    r = http.post("/tokenize", json={"model": MODEL_NAME, "messages": messages}, headers=AUTH)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1)
    assert chat.usage is not None and r.json()["count"] == chat.usage.prompt_tokens
    assert tok.decode(r.json()["tokens"], skip_special_tokens=False) == (
        "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"
    )
    r = http.post("/detokenize", json={"tokens": ids}, headers=AUTH)
    assert r.status_code == 200 and r.json() == {"prompt": "The quick brown fox"}


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/detokenize", {"tokens": [1, 10**6]}, "tokens[1]"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, None),
        ("/tokenize", {"messages": [{"role": "robot", "content": "b"}]}, "messages[0].role"),
        ("/tokenize", {"messages": [{"role": "user", "content": "b"}], "chat_template": "{%"},
         "chat_template"),
        ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
    ],
)  # fmt: skip
def test_bad_tokenize_requests_are_4xx_naming_the_field(
    http: httpx2.Client, path: str, body: dict, param: str | None
) -> None:
    r = http.post(path, json=body, headers=AUTH)
    assert r.status_code == (404 if param == "model" else 400), r.text
    assert r.json()["error"]["param"] == param


def test_version(http: httpx2.Client) -> None:
    r = http.get("/version", headers=AUTH)
    assert r.status_code == 200
    assert r.json() == {"version": importlib.metadata.version("duet-serve")}


def test_priority_reaches_the_scheduler_or_is_refused(
    client: openai.OpenAI, rest_engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(openai.BadRequestError) as e:  # the engine schedules fcfs
        client.completions.create(model=MODEL_NAME, prompt="a", max_tokens=1,
                                  extra_body={"priority": 3})  # fmt: skip
    assert isinstance(e.value.body, dict) and e.value.body["param"] == "priority"
    seen: list[int] = []
    generate = rest_engine.generate

    def recording(prompt: Any, params: Any = None, request_id: Any = None, priority: int = 0):
        seen.append(priority)
        return generate(prompt, params, request_id, priority)

    monkeypatch.setattr(AsyncEngine, "scheduling_policy", property(lambda self: "priority"))
    monkeypatch.setattr(rest_engine, "generate", recording)
    client.completions.create(model=MODEL_NAME, prompt="a", max_tokens=1,
                              extra_body={"priority": 3})  # fmt: skip
    client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "a"}],
                                   max_tokens=1, extra_body={"priority": -2})  # fmt: skip
    assert seen == [3, -2]


def test_echo_with_logprobs_scores_the_prompt(
    client: openai.OpenAI, reference_llm: Any, rest_engine: AsyncEngine
) -> None:
    """OpenAI's echo + logprobs (the log-likelihood requests of evaluation harnesses): the
    echoed prompt tokens carry logprobs (the first null), then the generated ones'."""
    from duet.engine import SamplingParams

    ids = rest_engine.tokenizer.encode("The quick brown fox", add_special_tokens=False)
    kwargs: Any = dict(model=MODEL_NAME, prompt=ids, max_tokens=2, temperature=0, logprobs=2)
    out = client.completions.create(echo=True, **kwargs)
    plain = client.completions.create(**kwargs)
    ref = reference_llm.generate(
        [ids], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2)
    )[0]
    lps = out.choices[0].logprobs
    assert lps is not None and lps.token_logprobs is not None and lps.top_logprobs is not None
    assert len(lps.token_logprobs) == len(ids) + 2
    assert lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
    expected = [ref.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(ids))]
    assert lps.token_logprobs[1 : len(ids)] == pytest.approx(expected, abs=1e-5)
    assert all(len(top) in (2, 3) for top in lps.top_logprobs[1:])  # top 2 (+ the token)
    assert plain.choices[0].logprobs is not None
    assert lps.token_logprobs[len(ids) :] == plain.choices[0].logprobs.token_logprobs
    stream = client.completions.create(echo=True, stream=True, **kwargs)
    streamed: list = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.token_logprobs or []
    assert streamed == lps.token_logprobs


def test_echo_with_max_tokens_0_returns_only_the_scored_prompt(
    client: openai.OpenAI, rest_engine: AsyncEngine
) -> None:
    """What several harnesses send to score a text: echo, logprobs, max_tokens 0. The reply
    is the prompt with its logprobs (the same as with max_tokens 1, less the generated token),
    no completion tokens, finished for length; streamed the same."""
    text = "The quick brown fox"
    ids = rest_engine.tokenizer.encode(text, add_special_tokens=False)
    kwargs: Any = dict(model=MODEL_NAME, prompt=ids, temperature=0, logprobs=1, echo=True)
    scored = client.completions.create(max_tokens=0, **kwargs)
    one = client.completions.create(max_tokens=1, **kwargs)
    [choice] = scored.choices
    assert choice.text == rest_engine.tokenizer.decode(ids)
    assert choice.finish_reason == "length"
    lps, ref = choice.logprobs, one.choices[0].logprobs
    assert lps is not None and ref is not None and ref.token_logprobs is not None
    assert lps.token_logprobs == ref.token_logprobs[: len(ids)]
    assert lps.tokens == ref.tokens[: len(ids)]  # type: ignore[index]
    assert lps.top_logprobs == ref.top_logprobs[: len(ids)]  # type: ignore[index]
    assert lps.text_offset == ref.text_offset[: len(ids)]  # type: ignore[index]
    assert scored.usage is not None
    assert (scored.usage.prompt_tokens, scored.usage.completion_tokens) == (len(ids), 0)
    stream = client.completions.create(
        max_tokens=0, stream=True, stream_options={"include_usage": True}, **kwargs
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    streamed: list = []
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.token_logprobs or []
    assert streamed == lps.token_logprobs
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 0
    # Without echo there would be nothing to return: a 400 naming max_tokens.
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=0)
    assert info.value.param == "max_tokens"
    assert "unless echo is true" in info.value.message


def test_prompt_logprobs_on_completions_and_chat(
    client: openai.OpenAI, http: httpx2.Client, reference_llm: Any
) -> None:
    from duet.engine import SamplingParams

    body: Any = dict(model=MODEL_NAME, prompt="hello world again", max_tokens=1,
                     temperature=0, prompt_logprobs=1)  # fmt: skip
    r = http.post("/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["prompt_logprobs"]
    ref = reference_llm.generate(
        ["hello world again"], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    )[0]
    assert got[0] is None and len(got) == len(ref.prompt_token_ids)
    for entry, expected in zip(got[1:], ref.prompt_logprobs[1:], strict=True):
        assert list(entry) == [str(t) for t in expected]
        for t, lp in expected.items():
            assert entry[str(t)]["logprob"] == pytest.approx(lp.logprob, abs=1e-5)
            assert entry[str(t)]["rank"] == lp.rank
    messages = [{"role": "user", "content": "hi"}]
    chat = dict(model=MODEL_NAME, messages=messages, max_tokens=1, prompt_logprobs=0)
    r = http.post("/v1/chat/completions", json=chat, headers=AUTH)
    assert r.status_code == 200, r.text
    lps = r.json()["prompt_logprobs"]
    assert lps[0] is None and len(lps) == r.json()["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 for entry in lps[1:])
    with http.stream("POST", "/v1/chat/completions", json={**chat, "stream": True},
                     headers=AUTH) as s:  # fmt: skip
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: {")]
    import json

    firsts = [json.loads(e) for e in events if "prompt_logprobs" in json.loads(e)]
    assert len(firsts) == 1 and firsts[0]["prompt_logprobs"] == lps
