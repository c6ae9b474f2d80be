"""`POST /v1/embeddings` with the official `openai` client: the vectors (the client's default
base64 and plain floats, bitwise equal) match HF's final hidden states pooled the same way
(last token, or mean with `--embedding-pooling mean`) and scaled to unit length; text and
token-id inputs give the same vectors; usage counts the prompt tokens; bad input is a 400
naming the field; an engine that cannot compute them (pipeline stages) says so."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from duet.engine import AsyncEngine
from tests.engine.embedding_helpers import ST_MODULES, hf_vectors, write_st_config
from tests.router.rest_server import API_KEY, MODEL_NAME, LiveServer, make_app, make_engine

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paged attention stores keys.", "a"]


def client_of(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture
def mean_client(rest_engine: AsyncEngine) -> Iterator[openai.OpenAI]:
    app = make_app(rest_engine, MODEL_NAME, api_keys=[API_KEY], embedding_pooling="mean")
    server = LiveServer(app).start()
    c = client_of(server)
    yield c
    c.close()
    server.stop()


@pytest.mark.parametrize("kind", ["last", "mean"])
def test_vectors_match_hf_pooled_hidden_states(
    kind: str, client: openai.OpenAI, mean_client: openai.OpenAI, rest_engine: AsyncEngine,
    tiny_llama: str,
) -> None:  # fmt: skip
    c = client if kind == "last" else mean_client
    ids = [rest_engine.tokenize_prompt(t)[1] for t in TEXTS]
    reply = c.embeddings.create(model=MODEL_NAME, input=TEXTS)  # the client asks for base64
    assert (reply.object, reply.model, [d.index for d in reply.data]) == ("list", MODEL_NAME,
                                                                           [0, 1, 2])  # fmt: skip
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(len(i) for i in ids)
    vectors = [torch.tensor(d.embedding) for d in reply.data]
    for vector, ref in zip(vectors, hf_vectors(tiny_llama, ids, kind), strict=True):
        torch.testing.assert_close(vector, ref, atol=2e-5, rtol=2e-5)
        assert vector.norm().item() == pytest.approx(1.0, abs=1e-5)
    floats = c.embeddings.create(model=MODEL_NAME, input=TEXTS, encoding_format="float")
    assert [d.embedding for d in floats.data] == [d.embedding for d in reply.data]
    by_ids = c.embeddings.create(input=ids, model=MODEL_NAME, encoding_format="float")
    assert [d.embedding for d in by_ids.data] == [d.embedding for d in reply.data]
    one = c.embeddings.create(input=TEXTS[1], model=MODEL_NAME, encoding_format="float")
    assert one.data[0].embedding == reply.data[1].embedding
    width = len(vectors[0])
    same = c.embeddings.create(input="a", model=MODEL_NAME, dimensions=width)
    assert same.data[0].embedding == reply.data[2].embedding


def test_bad_input_is_a_400_naming_the_field(
    client: openai.OpenAI, rest_engine: AsyncEngine
) -> None:
    too_long = [5] * (rest_engine.max_model_len + 1)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[1, 2], []]}, "input"),
        ({"input": [10**9]}, "input"),
        ({"input": too_long}, "input"),
        ({"input": ["x"] * 2049}, "input"),
        ({"input": "x", "dimensions": 7}, "dimensions"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "extra_body": {"truncate": 1}}, "truncate"),
        ({"input": "x", "model": "no-such-model"}, "model"),
        # JSON types as the schema says them (schemathesis found `true` accepted)
        ({"input": "x", "extra_body": {"truncate_prompt_tokens": True}}, "truncate_prompt_tokens"),
        ({"input": "x", "extra_body": {"dimensions": "7"}}, "dimensions"),
        ({"input": "x", "extra_body": {"dimensions": True}}, "dimensions"),
        ({"input": [1, True]}, "input"),
        ({"input": "x", "extra_body": {"user": 5}}, "user"),
    ]
    for kwargs, param in cases:
        kwargs = {"model": MODEL_NAME, **kwargs}
        with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as e:
            client.embeddings.create(**kwargs)
        assert e.value.body["param"] == param, kwargs  # type: ignore[index]


class NoEmbeddings:
    """`engine` as a router sees one that cannot compute embeddings (pipeline stages)."""

    computes_embeddings = False

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def test_an_engine_without_embeddings_says_so(rest_engine: AsyncEngine) -> None:
    app = make_app(NoEmbeddings(rest_engine), MODEL_NAME, api_keys=[API_KEY])  # type: ignore[arg-type]
    server = LiveServer(app).start()
    try:
        with client_of(server) as c, pytest.raises(openai.BadRequestError) as e:
            c.embeddings.create(model=MODEL_NAME, input="hello")
        assert e.value.body["param"] == "input"  # type: ignore[index]
        assert "does not compute embeddings" in e.value.message
    finally:
        server.stop()


def test_auto_pooling_follows_the_models_sentence_transformers_config(
    tiny_llama: str, tmp_path: Path
) -> None:
    """By default (`--embedding-pooling auto`) the route pools as the model's
    sentence-transformers config declares (here mean), a flag overrides it, and a pooling duet
    does not compute (max) is a 400 saying so, naming `input`."""
    dirs = {}
    for name, flags in (("mean", {"pooling_mode_mean_tokens": True}),
                        ("max", {"pooling_mode_max_tokens": True})):  # fmt: skip
        dirs[name] = str(tmp_path / name)
        shutil.copytree(tiny_llama, dirs[name])
        write_st_config(dirs[name], ST_MODULES, flags)
    engine = make_engine(dirs["mean"])
    try:
        ids = [engine.tokenize_prompt(t)[1] for t in TEXTS]
        for pooling, kind in (("auto", "mean"), ("last", "last")):
            app = make_app(engine, MODEL_NAME, api_keys=[API_KEY], embedding_pooling=pooling)
            server = LiveServer(app).start()
            try:
                with client_of(server) as c:
                    reply = c.embeddings.create(model=MODEL_NAME, input=TEXTS)
            finally:
                server.stop()
            refs = hf_vectors(dirs["mean"], ids, kind)
            for d, ref in zip(reply.data, refs, strict=True):
                torch.testing.assert_close(torch.tensor(d.embedding), ref, atol=2e-5, rtol=2e-5)
    finally:
        engine.shutdown()
    engine = make_engine(dirs["max"])
    try:
        server = LiveServer(make_app(engine, MODEL_NAME, api_keys=[API_KEY])).start()
        try:
            with client_of(server) as c, pytest.raises(openai.BadRequestError) as e:
                c.embeddings.create(model=MODEL_NAME, input="hello")
        finally:
            server.stop()
        assert e.value.body["param"] == "input"  # type: ignore[index]
        assert "declares 'max' pooling" in e.value.message
    finally:
        engine.shutdown()


def test_truncate_prompt_tokens_embeds_the_last_tokens(
    client: openai.OpenAI, rest_engine: AsyncEngine
) -> None:
    """vLLM's `truncate_prompt_tokens`: each input's last N tokens (-1: the context) are
    embedded and counted, so an input past the context is cut, not refused."""
    context = rest_engine.max_model_len
    long = [(7 * i) % 400 + 3 for i in range(context + 40)]  # past the context
    text_ids = rest_engine.tokenize_prompt(TEXTS[0])[1]

    def embed(inputs: Any, **extra: Any) -> Any:
        return client.embeddings.create(
            model=MODEL_NAME, input=inputs, encoding_format="float", extra_body=extra
        )

    cut = embed([long, text_ids], truncate_prompt_tokens=5)
    want = embed([long[-5:], text_ids[-5:]])
    assert [d.embedding for d in cut.data] == [d.embedding for d in want.data]
    assert cut.usage.prompt_tokens == 10
    whole = embed([long], truncate_prompt_tokens=-1)  # as many as fit: the context less one
    assert whole.data[0].embedding == embed([long[1 - context :]]).data[0].embedding
    assert whole.usage.prompt_tokens == context - 1
    for keep in (0, -2, context + 1):
        with pytest.raises(openai.BadRequestError) as e:
            embed("hello", truncate_prompt_tokens=keep)
        assert e.value.body["param"] == "truncate_prompt_tokens", keep  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:
        embed([long])  # no truncation: past the context is refused
    assert e.value.body["param"] == "input"  # type: ignore[index]
