"""`prefill_attention` "sdpa" (engine/attention.py): with the Triton backend, a step whose
prefills are all whole prompts (no cached prefix) runs their attention in torch's
scaled_dot_product_attention on the step's own K/V, FlashAttention on a GPU; steps with a
cached prefix or a later chunk stay in the paged prefill kernel. On the CPU: the Triton kernels
interpreted, SDPA's CPU kernel; the GPU's numbers are the kernel benchmark's
(benchmarks/kernels/gpu.py, both backends in one run)."""

from __future__ import annotations

import pytest
import torch

from duet.engine import LLM, EngineConfig, InvalidInputError, SamplingParams, attention
from duet.engine.attention_metadata import AttentionMetadata

CPU = torch.device("cpu")
ENGINE = dict(dtype="float32", device="cpu", attention_backend="triton", block_size=4,
              num_kv_blocks=128, max_num_seqs=8, max_model_len=128, load_progress=False,
              deterministic=False)  # fmt: skip


def _whole(query_lens: list[int], seq_lens: list[int], prefill_attention: str = "sdpa") -> bool:
    blocks = [list(range(-(-s // 4))) for s in seq_lens]
    meta = AttentionMetadata.build(query_lens, seq_lens, blocks, 4, CPU, triton_num_kv_heads=2,
                                   prefill_attention=prefill_attention)  # fmt: skip
    assert meta.kernel_batch is not None
    return meta.kernel_batch.whole_prompts_in_sdpa


def test_only_steps_of_whole_prompts_go_to_sdpa() -> None:
    assert _whole([5], [5]) and _whole([5, 1, 7], [5, 30, 7])  # prompts, beside a decode
    assert not _whole([5, 3], [5, 9])  # a chunk after a cached prefix or an earlier chunk
    assert not _whole([1, 1], [8, 9])  # decodes only
    assert not _whole([5], [5], "triton")


def test_whole_prompts_in_sdpa_give_the_prefill_kernels_tokens(
    tiny_llama: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    original = attention._whole_prompts_in_sdpa

    def spy(query, *args):  # type: ignore[no-untyped-def]
        calls.append(query.shape[0])
        return original(query, *args)

    monkeypatch.setattr(attention, "_whole_prompts_in_sdpa", spy)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (3, 17, 40, 9)]
    # The same prompts again: prefix-cache hits, so chunks after a cached prefix (the kernel).
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    runs = {}
    for backend in ("triton", "sdpa"):
        calls.clear()
        llm = LLM(tiny_llama, prefill_attention=backend, **ENGINE)
        first = llm.generate(prompts, params)
        num_first = len(calls)
        again = llm.generate(prompts, params)
        assert [o.num_cached_tokens for o in again] == [0, 16, 36, 8]
        runs[backend] = (first + again, num_first, len(calls) - num_first)
    num_layers = 2
    assert runs["triton"][1:] == (0, 0)
    assert runs["sdpa"][1:] == (num_layers, 0)  # the four prompts in one step, each layer
    for want, got in zip(runs["triton"][0], runs["sdpa"][0], strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        lp_want = [e.sampled.logprob for e in want.outputs[0].logprobs]
        lp_got = [e.sampled.logprob for e in got.outputs[0].logprobs]
        assert lp_got == pytest.approx(lp_want, abs=1e-4)


def test_sdpa_is_refused_with_deterministic_inference(tiny_llama: str) -> None:
    with pytest.raises(InvalidInputError) as info:
        LLM(tiny_llama, **{**ENGINE, "deterministic": True, "prefill_attention": "sdpa"})
    assert info.value.field == "prefill_attention"
    assert "not batch-invariant" in str(info.value)
    with pytest.raises(InvalidInputError, match="must be one of auto, triton, sdpa; got 'flash'"):
        EngineConfig(prefill_attention="flash")


def test_auto_is_sdpa_on_cuda_unless_deterministic() -> None:
    """The default: SDPA where it was measured faster (a CUDA prefill, docs/gpu.md), the paged
    kernel on the CPU and wherever deterministic inference needs it; a named value stays."""
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    auto = EngineConfig()
    assert auto.prefill_attention == "auto"
    assert auto.resolve_prefill_attention(cuda, deterministic=False) == "sdpa"
    assert auto.resolve_prefill_attention(cuda, deterministic=True) == "triton"
    assert auto.resolve_prefill_attention(cpu, deterministic=False) == "triton"
    for named in ("triton", "sdpa"):
        config = EngineConfig(prefill_attention=named)
        assert config.resolve_prefill_attention(cuda, deterministic=True) == named
