"""OpenAI's `prediction` (Predicted Outputs) on chat completions: honoured on an engine that
speculates with ngram (the reply is the same; the prediction's text reaches the engine as its
tokens), named ignored on one that does not, a bad one a 400 naming it. The engine's side:
tests/engine/test_predicted_outputs.py."""

from __future__ import annotations

import httpx2

from duet.engine import AsyncEngine, EngineConfig, SamplingParams
from tests.engine.test_predicted_outputs import ENGINE, NGRAM
from tests.router.rest_server import API_KEY, MODEL_NAME, LiveServer, make_app


def test_rest_honours_prediction_only_on_an_ngram_engine(
    tiny_llama: str, rest_server: LiveServer
) -> None:
    engine = AsyncEngine.from_config(
        EngineConfig(model=tiny_llama, speculative_config=NGRAM, **ENGINE)
    )
    live = LiveServer(make_app(engine, MODEL_NAME, api_keys=[API_KEY])).start()
    try:
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Say it"}],
                "max_tokens": 12, "temperature": 0}  # fmt: skip
        headers = {"Authorization": f"Bearer {API_KEY}"}
        plain = httpx2.post(f"{live.url}/v1/chat/completions", json=body, headers=headers,
                            timeout=60)  # fmt: skip
        text = plain.json()["choices"][0]["message"]["content"]
        predicted = {**body, "prediction": {"type": "content", "content": [
            {"type": "text", "text": text[: len(text) // 2]}, {"type": "text", "text": text[len(text) // 2 :]},
        ]}}  # fmt: skip
        sent: list[SamplingParams] = []
        generate = engine.generate

        def spy(prompt, params=None, *args, **kwargs):  # type: ignore[no-untyped-def]
            sent.append(params)
            return generate(prompt, params, *args, **kwargs)

        engine.generate = spy  # type: ignore[method-assign]
        reply = httpx2.post(f"{live.url}/v1/chat/completions", json=predicted, headers=headers,
                            timeout=60)  # fmt: skip
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == text
        assert "duet-ignored-fields" not in reply.headers
        # the two parts' text, tokenized as text (the engine's side: its own test)
        want = engine.tokenizer.encode(text, add_special_tokens=False)
        assert [p.prediction_token_ids for p in sent] == [want] and want
        # Without ngram speculation it changes nothing, and the header says so.
        other = httpx2.post(f"{rest_server.url}/v1/chat/completions", json=predicted,
                            headers=headers, timeout=60)  # fmt: skip
        assert other.status_code == 200 and other.headers["duet-ignored-fields"] == "prediction"
        bad = httpx2.post(f"{live.url}/v1/chat/completions", headers=headers, timeout=60,
                          json={**body, "prediction": {"type": "file", "content": "x"}})  # fmt: skip
        assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("prediction")
    finally:
        live.stop()
        engine.shutdown()
