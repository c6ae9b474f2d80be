"""Every user mistake is a 4xx in OpenAI's error shape, naming the field; never a 500."""

from __future__ import annotations

import httpx2
import openai
import pytest

from tests.router.rest_server import API_KEY, MODEL_NAME

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        (dict(temperature=-1), "temperature"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_completion_tokens=0), "max_completion_tokens"),
        (dict(top_p=0), "top_p"),
        (dict(n=0), "n"),
        (dict(presence_penalty=3), "presence_penalty"),
        (dict(frequency_penalty=-2.5), "frequency_penalty"),
        (dict(top_logprobs=21, logprobs=True), "top_logprobs"),
        (dict(top_logprobs=2), "top_logprobs"),
        (dict(extra_body={"top_k": -2}), "top_k"),
        (dict(extra_body={"min_p": 1.5}), "min_p"),
        (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
        (dict(extra_body={"prompt_logprobs": 21}), "prompt_logprobs"),
        (dict(extra_body={"prompt_logprobs": "all"}), "prompt_logprobs"),
        (dict(extra_body={"min_tokens": 5}, max_tokens=2), "min_tokens"),
        (dict(stop=[""]), "stop"),
        (dict(logit_bias={"5": 100.5}), "logit_bias"),
        (dict(logit_bias={"five": 1.0}), "logit_bias"),
        (dict(logit_bias={"512": 1.0}), "logit_bias"),  # the tiny model's vocabulary is 512
        (dict(logit_bias={"5": "much"}), "logit_bias"),
        (dict(extra_body={"allowed_token_ids": []}), "allowed_token_ids"),
        (dict(extra_body={"allowed_token_ids": [7, 512]}), "allowed_token_ids"),
        (dict(extra_body={"allowed_token_ids": "7"}), "allowed_token_ids"),
        (dict(extra_body={"include_stop_str_in_output": "yes"}), "include_stop_str_in_output"),
        (dict(extra_body={"truncate_prompt_tokens": 0}), "truncate_prompt_tokens"),
        (dict(extra_body={"cache_salt": ""}), "cache_salt"),
        (dict(extra_body={"bad_words": [" "]}), "bad_words[0]"),
        (dict(extra_body={"truncate_prompt_tokens": 5000}), "truncate_prompt_tokens"),
        (dict(messages=[]), "messages"),
        (dict(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role"),
        (dict(messages=[{"content": "hi"}]), "messages[0].role"),
    ],
)
def test_bad_chat_field_is_400_naming_it(client: openai.OpenAI, kwargs: dict, param: str) -> None:
    request = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=4)
    request.update(kwargs)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**request)
    err = info.value
    assert err.status_code == 400
    assert err.param == param
    assert err.type == "invalid_request_error"
    assert param.split("[")[0] in err.message


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        (dict(prompt=""), "prompt"),
        (dict(prompt=[]), "prompt"),
        (dict(prompt=[1, 99999]), "prompt"),
        (dict(prompt=[[1, 2], []]), "prompt"),
        (dict(logprobs=21), "logprobs"),
        (dict(extra_body={"prompt_logprobs": -1}), "prompt_logprobs"),
        (dict(extra_body={"prompt_logprobs": 21}), "prompt_logprobs"),
        (dict(extra_body={"best_of": 3}), "best_of"),
        (dict(logit_bias={"7": -101}), "logit_bias"),
        (dict(logit_bias={"99999": 1}), "logit_bias"),
        (dict(extra_body={"allowed_token_ids": [-1]}), "allowed_token_ids"),
        (dict(extra_body={"truncate_prompt_tokens": -2}), "truncate_prompt_tokens"),
        (dict(extra_body={"truncate_prompt_tokens": 1025}), "truncate_prompt_tokens"),
        (dict(extra_body={"prompt": {"not": "a prompt"}}), "prompt"),
    ],
)
def test_bad_completion_field_is_400(
    client: openai.OpenAI, kwargs: dict, param: str | None
) -> None:
    request: dict = dict(model=MODEL_NAME, prompt="hello", max_tokens=4)
    request.update(kwargs)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**request)
    assert info.value.status_code == 400
    assert info.value.param == param


def test_image_content_part_is_400(client: openai.OpenAI) -> None:
    image = {"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": [image]}]
        )
    assert info.value.param == "messages[0].content"
    assert "only text" in info.value.message


def test_prompt_too_long_is_400_naming_the_prompt(client: openai.OpenAI) -> None:
    long_text = "hello " * 2000  # well past the 1024-token context
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": long_text}]
        )
    assert info.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt=long_text)
    assert info.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5000)
    assert info.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=5000
        )
    assert info.value.param == "max_completion_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=5000, stream=True)
    assert info.value.param == "max_tokens"  # streaming requests are checked before the stream


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-17", messages=MESSAGES)
    assert info.value.status_code == 404
    assert info.value.code == "model_not_found"
    assert info.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-17", prompt="hi", stream=True)


def test_missing_or_wrong_api_key_is_401(client: openai.OpenAI, http: httpx2.Client) -> None:
    wrong = client.with_options(api_key="sk-wrong")
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.chat.completions.create(model=MODEL_NAME, messages=MESSAGES)
    assert info.value.status_code == 401
    assert info.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    # No Authorization header at all (the openai client always sends one).
    for method, path in [
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("GET", "/v1/models"),
        ("GET", "/metrics"),
        ("GET", "/no/such/path"),
    ]:
        r = http.request(method, path, json={})
        assert r.status_code == 401, path
        assert r.json()["error"]["type"] == "authentication_error"
        assert r.headers["www-authenticate"] == "Bearer"
    r = http.get("/v1/models", headers={"Authorization": "Basic abc"})
    assert r.status_code == 401
    # The probes answer without a key.
    assert http.get("/health").status_code == 200
    assert http.get("/ready").status_code == 200


def test_malformed_bodies_are_400(http: httpx2.Client) -> None:
    r = http.post(
        "/v1/chat/completions",
        content=b'{"messages": [',
        headers={**AUTH, "Content-Type": "application/json"},
    )
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "JSON" in r.json()["error"]["message"]
    r = http.post("/v1/chat/completions", json=[1, 2], headers=AUTH)
    assert r.status_code == 400
    assert "must be a JSON object" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json={"max_tokens": 3}, headers=AUTH)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "prompt"
    r = http.post(
        "/v1/chat/completions",
        content=b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
        headers={**AUTH, "Content-Type": "application/json"},
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "temperature"


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800x"}]}',
         "messages[0].content"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", '
         '"text": "ok"}, {"type": "text", "text": "\\udfff"}]}]}', "messages[0].content[1].text"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], '
         '"metadata": {"\\ud83d": "x"}}', "metadata.\\ud83d"),
        ("/v1/completions", '{"prompt": "a\\ud800"}', "prompt"),
        ("/v1/completions", '{"prompt": ["ok", "\\ud800"]}', "prompt[1]"),
        ("/tokenize", '{"prompt": "\\ud800x"}', "prompt"),
    ],
)  # fmt: skip
def test_a_lone_surrogate_is_400_naming_the_string(
    http: httpx2.Client, route: str, body: str, param: str
) -> None:
    """JSON's `\\ud800` escape parses to a lone surrogate, which no tokenizer takes (it was a 500:
    'TextInputSequence must be str')."""
    body = body[:-1] + f', "model": "{MODEL_NAME}", "max_tokens": 2}}'
    r = http.post(
        route, content=body.encode(), headers={**AUTH, "Content-Type": "application/json"}
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert "lone UTF-16 surrogate" in error["message"]


def test_unknown_route_and_wrong_method_keep_the_error_shape(http: httpx2.Client) -> None:
    r = http.get("/v1/nothing-here", headers=AUTH)
    assert r.status_code == 404
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = http.get("/v1/chat/completions", headers=AUTH)
    assert r.status_code == 405
    assert "error" in r.json()
