"""Speculative decoding's exactness over the issue's matrix: greedy outputs with speculation
(ngram and a draft model, num_speculative_tokens 1, 3 and 5) equal those without it, token for
token, for 32 mixed prompts on a tiny model of every architecture in fp32 and bf16, and with
ngram (1 and 5 tokens) on the embedded default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import pytest

from duet.engine import LLM, SamplingParams
from duet.engine.outputs import RequestOutput
from tests.engine.test_spec_decode import PROMPTS

# 32 prompts: the end-to-end tests' 8 (repeats accepted, no repeats rejected, long prompts
# prefilled in chunks beside speculating decodes), and 24 more of every kind.
MIXED: list[list[int]] = PROMPTS + [
    [(i * (7 + j) + 3 * j) % (40 + 20 * j) + 5 for i in range(8 + 9 * j)] for j in range(24)
]
KS = (1, 3, 5)


def _llm(model: str, dtype: str, spec: dict | None = None) -> LLM:
    return LLM(
        model, dtype=dtype, load_progress=False, max_num_batched_tokens=96, max_num_seqs=32,
        speculative_config=spec, deterministic=True,
    )  # fmt: skip


def _tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _config(method: str, k: int, draft: str | None) -> dict:
    # every batch size speculates here (the CPU's default stops above 4 decoding requests)
    spec = {"method": method, "num_speculative_tokens": k, "disable_by_batch_size": 64}
    if method == "ngram":
        return {**spec, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    return {**spec, "model": draft}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "smollm2"])
def test_every_architecture_gives_the_same_greedy_tokens(tiny_model_factory, arch, dtype):
    target = tiny_model_factory(arch)
    draft = tiny_model_factory(arch, num_hidden_layers=1)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    assert len(MIXED) == 32
    reference = _tokens(_llm(target, dtype).generate(MIXED, params))
    # ngram; a random 1-layer draft (its guesses rejected); the target as its own draft (every
    # guess accepted: whole runs kept)
    for method, model in (("ngram", None), ("draft_model", draft), ("draft_model", target)):
        for k in KS:
            case = (method, model == target, k)
            llm = _llm(target, dtype, _config(method, k, model))
            assert _tokens(llm.generate(MIXED, params)) == reference, case
            stats = llm.engine.stats.spec_decode
            assert stats is not None and stats.num_draft_tokens > 0, case
            if method == "ngram":
                assert stats.num_accepted_tokens > 0, case
            elif model == target:
                assert stats.num_accepted_tokens == stats.num_draft_tokens, case


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_default_model_gives_the_same_greedy_tokens_with_ngram(dtype):
    """The embedded SmolLM2 (real weights): chat prompts that copy text, and token prompts."""
    llm = _llm(None, dtype)  # type: ignore[arg-type]
    text = "Paged attention stores keys and values in blocks; a block table maps them. "
    # 1, 5, 9, 13 repeats (up to ~260 tokens: chunked at 96), and 4 token prompts (the suite's
    # minute: 8 and 8 took 67 s of it in both dtypes, about as long as the rest of the file)
    chats = [llm.engine.encode_chat([{"role": "user", "content": f"Repeat {i} times: {text}"}])
             for i in range(1, 16, 4)]  # fmt: skip
    prompts = chats + MIXED[:4]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    reference = _tokens(llm.generate(prompts, params))
    # The tiny models take every k in both dtypes; here the shortest in fp32 and the longest in
    # bf16 (both in both took 20 s more of the suite).
    k = KS[0] if dtype == "float32" else KS[-1]
    spec = _llm(None, dtype, _config("ngram", k, None))  # type: ignore[arg-type]
    assert _tokens(spec.generate(prompts, params)) == reference, k
    stats = spec.engine.stats.spec_decode
    assert stats is not None and stats.num_accepted_tokens > 0, k
