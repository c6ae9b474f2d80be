"""Embeddings (`SamplingParams.pooling`): a prompt's final hidden states (after the model's last
norm), pooled `last` or `mean` and scaled to unit length. fp32 values match HF's
`output_hidden_states` pooled the same way; chunked prefill, a batch beside generating
requests and a prefix-cache hit give bitwise the same vector."""

from __future__ import annotations

import random

import pytest
import torch

from duet.engine import LLM, SamplingParams
from duet.engine.errors import InvalidInputError
from tests.conftest import SMOLLM2_SHAPES
from tests.engine.embedding_helpers import ST_MODULES, hf_vectors, write_st_config


def _embed(kind: str) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=1, pooling=kind)


def _llm(path: str, dtype: str, **kw) -> LLM:
    return LLM(path, dtype=dtype, load_progress=False, num_kv_blocks=200, **kw)


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 9, 40, 70)]


@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
def test_fp32_embeddings_match_hf_pooled_hidden_states(tiny_llama, kind):
    prompts = _prompts()
    outs = _llm(tiny_llama, "float32", max_num_batched_tokens=16).generate(prompts, _embed(kind))
    for prompt, out, ref in zip(prompts, outs, hf_vectors(tiny_llama, prompts, kind), strict=True):
        assert out.embedding is not None and out.finished
        vector = torch.tensor(out.embedding)
        assert vector.shape == ref.shape
        assert vector.norm().item() == pytest.approx(1.0, abs=1e-5)
        torch.testing.assert_close(vector, ref, atol=2e-5, rtol=2e-5), len(prompt)
        assert len(out.token_ids) == 1  # one token sampled, not the answer


@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
def test_chunks_batches_and_prefix_hits_give_bitwise_the_same_vector(tiny_model_factory, kind):
    path = tiny_model_factory("llama", **SMOLLM2_SHAPES)
    prompts = _prompts()
    whole = _llm(path, "bfloat16", max_num_batched_tokens=256)
    assert whole.engine.deterministic
    expected = [o.embedding for o in whole.generate(prompts, _embed(kind))]
    again = whole.generate(prompts, _embed(kind))  # cached now: `last` may hit, `mean` may not
    assert [o.embedding for o in again] == expected
    if kind in ("mean", "cls"):
        assert {o.num_cached_tokens for o in again} == {0}
    else:
        assert max(o.num_cached_tokens for o in again) > 0
    for chunk in (7, 16):
        chunked = _llm(path, "bfloat16", max_num_batched_tokens=chunk)
        assert [o.embedding for o in chunked.generate(prompts, _embed(kind))] == expected, chunk
    # Beside requests that generate: each prompt's vector is its own, the others' text too.
    talk = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = whole.generate(prompts[:2], talk)
    mixed = whole.generate([*prompts, *prompts[:2]], [*(_embed(kind),) * len(prompts), talk, talk])
    assert [o.embedding for o in mixed[: len(prompts)]] == expected
    assert [o.token_ids for o in mixed[len(prompts) :]] == [o.token_ids for o in alone]
    assert [o.embedding for o in mixed[len(prompts) :]] == [None, None]


def test_bad_pooling_is_refused():
    with pytest.raises(InvalidInputError, match="pooling: must be one of last, mean, cls"):
        SamplingParams(max_tokens=1, pooling="max")
    with pytest.raises(InvalidInputError, match="pooling: needs max_tokens 1 and n 1"):
        SamplingParams(max_tokens=2, pooling="last")
    with pytest.raises(InvalidInputError, match="pooling: needs max_tokens 1 and n 1"):
        SamplingParams(max_tokens=1, n=2, pooling="mean")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_base_model_checkpoint_embeds_and_refuses_to_generate(tiny_model_factory, arch):
    """An embedding model as HF ships it (`LlamaModel`, `Qwen3Model`: the base class, no LM
    head, tensors without `model.`) loads, and its vectors are HF's `AutoModel`'s pooled; a
    request to generate text is refused naming `model`."""
    import json
    import os

    from transformers import AutoModel

    path = tiny_model_factory(arch, base_model=True)
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["architectures"][0].endswith("Model")  # not ...ForCausalLM
    prompts = _prompts()
    llm = _llm(path, "float32", max_num_batched_tokens=16)
    assert llm.engine.arch.embedding_only
    outs = llm.generate(prompts, _embed("last"))
    hf = AutoModel.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for prompt, out in zip(prompts, outs, strict=True):
            hidden = hf(torch.tensor([prompt])).last_hidden_state[0]
            ref = torch.nn.functional.normalize(hidden[-1], dim=0)
            torch.testing.assert_close(torch.tensor(out.embedding), ref, atol=2e-5, rtol=2e-5)
    with pytest.raises(InvalidInputError, match=r"model: .* computes embeddings only"):
        llm.generate(prompts[:1], SamplingParams(max_tokens=4))


@pytest.mark.parametrize(
    ("flags", "declared"),
    [
        ({"pooling_mode_lasttoken": True}, "last"),
        ({"pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False}, "mean"),
        ({"pooling_mode_cls_token": True}, "cls"),
        ({"pooling_mode_max_tokens": True}, "max"),
        ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}, "cls+mean"),
    ],
)
def test_the_sentence_transformers_pooling_is_read(tmp_path, flags, declared):
    from duet.engine.pooling_config import declared_pooling

    write_st_config(str(tmp_path), ST_MODULES, flags)
    assert declared_pooling(str(tmp_path)) == declared


def test_no_or_a_broken_sentence_transformers_config_declares_nothing(tmp_path):
    from duet.engine.pooling_config import declared_pooling

    assert declared_pooling(str(tmp_path)) is None  # no modules.json
    write_st_config(str(tmp_path), ST_MODULES[:1], None)
    assert declared_pooling(str(tmp_path)) is None  # no Pooling module
    write_st_config(str(tmp_path), ST_MODULES, None)
    assert declared_pooling(str(tmp_path)) is None  # its config.json is missing (logged)
