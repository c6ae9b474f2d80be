"""The fields evaluation harnesses use: `echo` on completions, `/tokenize`, `/detokenize`,
`/version`, and `priority` passed from REST to the engine's scheduler."""

from __future__ import annotations

import importlib.metadata
from typing import Any

import httpx2
import openai
import pytest

from engine import AsyncEngine
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
