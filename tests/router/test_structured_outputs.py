"""Structured outputs through REST with the official openai client, on the random tiny model:
`response_format` (json_object, json_schema) and vLLM's `structured_outputs` extra on chat and
completions. Only the grammar makes these outputs valid, so every check is the grammar's."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx2
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.router.rest_server import API_KEY, MODEL_NAME

MESSAGES = [{"role": "user", "content": "Describe a pet as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog", "fish"]},
        "legs": {"type": "integer", "minimum": 0, "maximum": 4},
        "name": {"type": "string", "maxLength": 5},
        "vaccinated": {"type": "boolean"},
    },
    "required": ["kind", "legs", "name", "vaccinated"],
    "additionalProperties": False,
}


class Pet(BaseModel):
    kind: Literal["cat", "dog"]
    legs: int = Field(ge=0, le=4)
    nick: str = Field(pattern="^[a-z]{1,4}$")
    name: str = Field(max_length=5)


def test_json_schema_replies_validate_streamed_and_not(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, n=6, temperature=1.0, seed=4, max_tokens=200,
        response_format=fmt,  # type: ignore[arg-type]
    )  # fmt: skip
    assert len(resp.choices) == 6
    for choice in resp.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, temperature=1.0, seed=5, max_tokens=200,
        response_format=fmt, stream=True,  # type: ignore[arg-type]
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    for seed in range(3):
        resp = client.chat.completions.parse(
            model=MODEL_NAME, messages=MESSAGES, temperature=1.0, seed=seed, max_tokens=100,
            response_format=Pet,
        )  # fmt: skip
        pet = resp.choices[0].message.parsed
        assert isinstance(pet, Pet), resp.choices[0].message.content


def test_json_object_reply_is_a_json_object(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, temperature=0, max_tokens=300,
        response_format={"type": "json_object"},
    )  # fmt: skip
    [choice] = resp.choices
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content or ""), dict)


def test_regex_choice_and_grammar_on_completions_and_chat(client: openai.OpenAI) -> None:
    regex = r"[a-f]{3}-[0-9]{2,4}"
    resp = client.completions.create(
        model=MODEL_NAME, prompt="code:", n=4, temperature=1.0, seed=1, max_tokens=40,
        extra_body={"structured_outputs": {"regex": regex}},
    )  # fmt: skip
    assert all(re.fullmatch(regex, c.text) and c.finish_reason == "stop" for c in resp.choices)
    choices = ["red", "green", "blue"]
    resp = client.completions.create(
        model=MODEL_NAME, prompt="color:", n=4, temperature=1.0, seed=2, max_tokens=40,
        extra_body={"structured_outputs": {"choice": choices}},
    )  # fmt: skip
    assert all(c.text in choices for c in resp.choices)
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, temperature=1.0, seed=3, max_tokens=40,
        extra_body={"structured_outputs": {"grammar": 'root ::= "<" ("a" | "b")+ ">"'}},
    )  # fmt: skip
    assert re.fullmatch(r"<[ab]+>", chat.choices[0].message.content or "")
    # vLLM also takes response_format on completions.
    resp = client.completions.create(
        model=MODEL_NAME, prompt="json:", temperature=1.0, seed=4, max_tokens=200,
        extra_body={"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "p", "schema": SCHEMA}}},
    )  # fmt: skip
    jsonschema.validate(json.loads(resp.choices[0].text), SCHEMA)


def test_a_reply_cut_by_max_tokens_reports_length(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, temperature=0, max_tokens=3,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
    )  # fmt: skip
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage is not None and resp.usage.completion_tokens == 3


@pytest.mark.parametrize(
    "path, extra, param",
    [
        ("/v1/chat/completions",
         {"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"type": "strng"}}}},
         "response_format.json_schema.schema"),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema"}},
         "response_format.json_schema"),
        ("/v1/chat/completions", {"structured_outputs": {"regex": "(ab"}},
         "structured_outputs.regex"),
        ("/v1/completions", {"structured_outputs": {"grammar": "root ::= nope"}},
         "structured_outputs.grammar"),
        # a non-ASCII grammar: xgrammar's message held half a UTF-8 character (was a 500)
        ("/v1/completions", {"structured_outputs": {"grammar": "\u00c1\u0093?"}},
         "structured_outputs.grammar"),
        ("/v1/completions", {"structured_outputs": {"json": "{oops"}}, "structured_outputs.json"),
        ("/v1/completions", {"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}},
         "structured_outputs"),
        ("/v1/completions", {"structured_outputs": {"regexp": "a"}},
         "structured_outputs.regexp"),
        ("/v1/chat/completions",
         {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
         "response_format"),
        ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format.type"),
    ],
)  # fmt: skip
def test_bad_specs_are_400_naming_the_field(
    http: httpx2.Client, path: str, extra: dict, param: str
) -> None:
    body: dict = {"model": MODEL_NAME, "max_tokens": 4, **extra}
    if "chat" in path:
        body["messages"] = MESSAGES
    else:
        body["prompt"] = "hi"
    r = http.post(path, json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert error["message"].startswith(param)
