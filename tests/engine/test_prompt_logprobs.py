"""Prompt logprobs (`SamplingParams.prompt_logprobs`, vLLM's semantics): every prompt token
after the first gets its logprob, its rank and the top-k, computed from the logits of every
prompt position during (chunked) prefill. Chunking and a (skipped) prefix-cache hit give the
same values bitwise; fp32 values match HF's full forward."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

import pytest
import torch

from duet.engine import LLM, SamplingParams
from duet.engine.errors import InvalidInputError
from tests.conftest import SMOLLM2_SHAPES

K = 3


def _params(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, **kw)


def _values(out) -> list:
    assert out.prompt_logprobs is not None
    assert out.prompt_logprobs[0] is None
    return [[(t, lp.logprob, lp.rank) for t, lp in d.items()] for d in out.prompt_logprobs[1:]]


def _llm(path: str, dtype: str, **kw) -> LLM:
    return LLM(path, dtype=dtype, load_progress=False, num_kv_blocks=200, **kw)


@pytest.fixture(scope="module")
def smollm_shapes(tiny_model_factory) -> str:
    return tiny_model_factory("llama", **SMOLLM2_SHAPES)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chunks_and_prefix_hits_give_bitwise_the_same_values(smollm_shapes, dtype):
    rng = random.Random(0)
    prompt = [rng.randrange(3, 500) for _ in range(70)]
    params = _params(prompt_logprobs=K)
    whole = _llm(smollm_shapes, dtype, max_num_batched_tokens=256)
    assert whole.engine.deterministic
    cold = whole.generate([prompt], params)[0]
    expected = _values(cold)
    assert len(expected) == len(prompt) - 1
    # The same prompt again: its blocks are cached, but the request recomputes them.
    again = whole.generate([prompt], params)[0]
    assert again.num_cached_tokens == 0
    assert _values(again) == expected
    assert again.token_ids == cold.token_ids
    for chunk in (7, 16):
        chunked = _llm(smollm_shapes, dtype, max_num_batched_tokens=chunk)
        assert _values(chunked.generate([prompt], params)[0]) == expected, chunk


def test_fp32_values_match_an_hf_full_forward(tiny_llama):
    from transformers import AutoModelForCausalLM

    rng = random.Random(1)
    prompt = [rng.randrange(3, 500) for _ in range(40)]
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)  # [P, V]
    out = _llm(tiny_llama, "float32", max_num_batched_tokens=16).generate(
        [prompt], _params(prompt_logprobs=K)
    )[0]
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    for p in range(1, len(prompt)):
        entry = out.prompt_logprobs[p]
        assert entry is not None
        row = ref[p - 1]
        token = prompt[p]
        assert next(iter(entry)) == token  # the prompt token comes first
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = [t for t, lp in entry.items() if lp.rank is not None and lp.rank <= K]
        assert sorted(top) == sorted(row.topk(K).indices.tolist())
        for t in top:
            assert entry[t].logprob == pytest.approx(row[t].item(), abs=1e-4)


def test_shape_zero_k_samples_and_requests_that_did_not_ask(tiny_llama):
    llm = _llm(tiny_llama, "float32", max_num_batched_tokens=8)
    prompt = list(range(5, 25))
    zero, plain = llm.generate(
        [prompt, prompt], [_params(prompt_logprobs=0, n=2), _params(logprobs=2)]
    )
    assert plain.prompt_logprobs is None
    assert len(zero.outputs) == 2
    assert zero.prompt_logprobs is not None
    for token, entry in zip(prompt[1:], zero.prompt_logprobs[1:], strict=True):
        assert entry is not None and list(entry) == [token]  # only the prompt token
        assert entry[token].token == llm.engine.tokenizer.id_to_token(token)
    # Asking for prompt logprobs changes nothing else: same tokens as the plain request.
    assert zero.outputs[0].token_ids == plain.token_ids


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_bad_values_name_the_field(value):
    with pytest.raises(InvalidInputError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)


def _on_a_thread(flush_denormals: bool, fn: Callable[[], object]) -> object:
    """`fn()` (or what it raised) on a new thread in that floating-point mode (a thread's
    own: this one keeps whatever an engine built on it left)."""
    out: list[object] = []

    def run() -> None:
        torch.set_flush_denormal(flush_denormals)
        try:
            out.append(fn())
        except Exception as e:  # returned, for the caller to assert on
            out.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    return out[0]


def test_samples_after_the_first_keep_a_subnormal_top_p_on_a_flushing_thread(tiny_llama):
    """`n` > 1 with prompt logprobs: samples after the first drop them, on the engine's
    thread, where the CPU engine flushes denormals to zero (engine/cpu_runtime.py). Their
    params were validated again there, and a top_p of 5e-324 (valid: the router and the
    schema take any value in (0, 1]) read as 0 and refused the request (schemathesis found
    it). Added on a thread in that mode, the request is taken, and every sample asks for no
    prompt logprobs but the first."""
    llm = _llm(tiny_llama, "float32")
    params = _on_a_thread(False, lambda: _params(n=3, prompt_logprobs=0, top_p=5e-324))
    assert isinstance(params, SamplingParams)
    added = _on_a_thread(True, lambda: llm.engine.add_request([5, 6, 7, 8], params, "r"))
    assert not isinstance(added, Exception), added
    samples = llm.engine.requests.states["r"].samples
    assert [s.request.sampling_params.prompt_logprobs for s in samples] == [0, None, None]
    assert {s.request.sampling_params.top_p for s in samples} == {5e-324}
    assert params.prompt_logprobs == 0  # the caller's params untouched
