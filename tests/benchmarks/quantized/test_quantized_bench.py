"""benchmarks.quantized: the NLL it reports is the engine's own log-probabilities, and its
ratios pair the right systems."""

from __future__ import annotations

import pytest
import torch

from benchmarks.quantized.accuracy import top1_match, window_nll
from benchmarks.quantized.bandwidth import gguf_streamed_bytes, streamed_bytes_per_token
from benchmarks.quantized.methods import applicable, engine_kwargs, label
from benchmarks.quantized.speed import SpeedResult, greedy_agreement, ratios
from benchmarks.quantized.tokens import agreement, compare
from duet.engine import LLM, SamplingParams
from duet.engine.gguf_loader import default_model_path


def test_window_nll_is_the_engines_negative_logprobs(tiny_llama: str) -> None:
    llm = LLM(tiny_llama, dtype="float32", load_progress=False, num_kv_blocks=64)
    prompt = [5, 17, 99, 200, 3, 42, 7]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                logprobs=0))[0].outputs[0]  # fmt: skip
    model = llm.engine.runner.model
    whole, n_whole, top1 = window_nll(model, torch.tensor(prompt + out.token_ids), torch.float32)
    prompt_only, n_prompt, _ = window_nll(model, torch.tensor(prompt), torch.float32)
    assert (n_whole, n_prompt) == (12, 6)
    assert top1[6:].tolist() == out.token_ids  # greedy: each next token is the top-1
    generated = -sum(lp.sampled.logprob for lp in out.logprobs)
    assert whole - prompt_only == pytest.approx(generated, abs=1e-3)


def test_ratios_pair_formats_with_bf16_and_llama_cpp() -> None:
    results = [
        SpeedResult("duet-bf16", 100, [10.0, 12.0, 11.0], [100.0]),
        SpeedResult("duet-int4", 30, [22.0], [90.0]),
        SpeedResult("llama.cpp-Q4_1", None, [20.0, 20.0]),
    ]
    assert ratios(results) == {
        "duet-int4/duet-bf16 single_stream_median": 2.0,
        "duet-int4/duet-bf16 batch_median": 0.9,
        "duet-int4/llama.cpp-Q4_1 single_stream_median": 1.1,
    }
    fp32 = [SpeedResult("duet-fp32", 100, [10.0], []), SpeedResult("duet-int8", 50, [15.0], [])]
    assert ratios(fp32) == {"duet-int8/duet-fp32 single_stream_median": 1.5}


def test_methods() -> None:
    assert engine_kwargs("bf16", 64) == {"dtype": "bfloat16"}
    assert engine_kwargs("int4", 64) == {
        "dtype": "bfloat16", "quantization": "int4", "quantization_group_size": 64,
    }  # fmt: skip
    assert engine_kwargs("gguf", 64) == {"dtype": "bfloat16", "quantization": "gguf"}
    assert engine_kwargs("int8", 64, lm_head=True) == {
        "dtype": "bfloat16", "quantization": "int8", "quantize_lm_head": True,
    }  # fmt: skip
    assert engine_kwargs("bf16", 64, lm_head=True) == {"dtype": "bfloat16"}
    assert applicable("gguf", None) and applicable("gguf", "m.gguf")
    assert not applicable("gguf", "/models/hf-dir") and applicable("int8", "/models/hf-dir")
    with pytest.raises(ValueError, match="method must be one of bf16, int8, int4, gguf"):
        engine_kwargs("int2", 32)
    assert engine_kwargs("int8", 32, dtype="float32") == {
        "dtype": "float32",
        "quantization": "int8",
    }
    assert (label("bf16", "float32"), label("bf16", "bfloat16")) == ("duet-fp32", "duet-bf16")
    assert label("int4", "float32") == "duet-int4"
    with pytest.raises(ValueError, match="dtype must be one of bfloat16, float32"):
        engine_kwargs("int8", 32, dtype="float16")


def test_streamed_bytes_are_the_weights_a_step_reads_and_its_kv(tiny_llama: str) -> None:
    llm = LLM(tiny_llama, dtype="float32", load_progress=False, num_kv_blocks=64)
    table = llm.engine.runner.model.embed_tokens.weight.nbytes
    assert table == 512 * 64 * 4  # a lookup reads one row of it; the untied head is its own
    kv_per_token = 2 * 2 * 2 * 16 * 4  # layers x (K, V) x KV heads x head_dim x fp32
    assert streamed_bytes_per_token(llm, 0) == llm.engine.weight_bytes - table
    grown = streamed_bytes_per_token(llm, 100) - streamed_bytes_per_token(llm, 0)
    assert grown == 100 * kv_per_token
    row = SpeedResult("duet-fp32", 1, [10.0, 30.0, 20.0], streamed_bytes_per_token=5 * 10**8)
    assert row.summary()["single_stream_gbs"] == 10.0  # 20 tok/s x 0.5 GB


@pytest.mark.parametrize(
    ("dtype", "quantization", "expert_bytes"),
    [
        ("float32", None, 16 * 3 * 64 * 64 * 4),  # grouped panels: 16 experts x 3 [64, 64]
        ("bfloat16", "int8", 16 * (3 * 64 * 64 + 3 * 64 * 4)),  # int8 views of stacks + scales
    ],
)
def test_a_token_reads_only_its_top_k_experts(
    tiny_model_factory, dtype, quantization, expert_bytes
):
    """Qwen3-MoE, 2 sparse layers of 16 experts, top-2: per token 14 of each layer's 16
    experts are not read, whether the experts are dense panels or int8 stacks."""
    llm = LLM(tiny_model_factory("qwen3_moe"), dtype=dtype, load_progress=False,
              num_kv_blocks=16, quantization=quantization)  # fmt: skip
    table = llm.engine.runner.model.embed_tokens.weight.nbytes
    unread = 2 * expert_bytes * 14 // 16
    assert streamed_bytes_per_token(llm, 0) == llm.engine.weight_bytes - table - unread


def test_gguf_streamed_bytes_are_its_tensors() -> None:
    """The embedded SmolLM2 ties its head to the token embedding: every tensor is read."""
    import gguf

    path = default_model_path()
    reader = gguf.GGUFReader(path)
    assert "output.weight" not in {t.name for t in reader.tensors}
    end = max(int(t.data_offset) + int(t.n_bytes) for t in reader.tensors)
    start = min(int(t.data_offset) for t in reader.tensors)
    streamed = gguf_streamed_bytes(path)
    # the tensor data, less the alignment padding between tensors (32 bytes at most each)
    assert end - start - 32 * len(reader.tensors) <= streamed <= end - start


def test_profile_times_every_part_and_leaves_the_model_as_it_was(tiny_llama: str) -> None:
    from benchmarks.quantized.profile import profile_format

    llm = LLM(tiny_llama, dtype="float32", load_progress=False, num_kv_blocks=64)
    want = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6))
    row = profile_format(llm, [5, 6, 7], tokens=4, rounds=1)
    assert set(row["parts_ms"]) == {"projections", "attention", "mlp_activation", "norms",
                                    "lm_head", "forward_other", "host"}  # fmt: skip
    assert all(row["parts_ms"][p] > 0 for p in ("projections", "attention", "norms", "lm_head"))
    # 2 layers of qkv (64 x 128), o (64 x 64), gate|up (64 x 256) and down (128 x 64), fp32
    layer = 64 * 128 + 64 * 64 + 64 * 256 + 128 * 64
    assert row["projection_bytes"] >= 2 * layer * 4  # oneDNN's packed copies may be padded
    assert row["projection_bytes"] < 2 * layer * 4 * 1.25
    model = llm.engine.runner.model
    assert not any({"forward", "add_and_norm"} & set(vars(m)) for m in model.modules())
    again = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6))
    assert again[0].outputs[0].token_ids == want[0].outputs[0].token_ids


def test_greedy_agreement_is_the_share_before_the_first_difference() -> None:
    bf16 = SpeedResult("duet-bf16", 1, tokens=[[1, 2, 3, 4], [5, 6, 7, 8]])
    int8 = SpeedResult("duet-int8", 1, tokens=[[1, 2, 3, 4], [5, 6, 7, 8]])
    int4 = SpeedResult("duet-int4", 1, tokens=[[1, 2, 9, 4], [0, 6, 7, 8]])
    llama = SpeedResult("llama.cpp-Q4_1", None, tokens=[])
    assert greedy_agreement([bf16, int8, int4, llama]) == {
        "duet-int8/duet-bf16": {"prefix_agreement": 1.0, "equal_outputs": 2, "outputs": 2},
        "duet-int4/duet-bf16": {"prefix_agreement": 0.25, "equal_outputs": 0, "outputs": 2},
    }
    assert "tokens" not in bf16.summary()


def test_top1_match_counts_the_places_whose_top_token_is_bf16s() -> None:
    rows = [{"method": "bf16", "top1": torch.tensor([1, 2, 3, 4])},
            {"method": "int4", "top1": torch.tensor([1, 0, 3, 0])}]  # fmt: skip
    top1_match(rows)
    assert rows == [{"method": "bf16", "top1_match_vs_bf16": 1.0},
                    {"method": "int4", "top1_match_vs_bf16": 0.5}]  # fmt: skip


def test_tokens_compare_says_identical_and_each_trees_agreement() -> None:
    bf16 = {"greedy": [[1, 2, 3, 4], [5, 6, 7, 8]], "top1": [1, 2, 3, 4]}
    int4 = {"greedy": [[1, 2, 9, 4], [5, 6, 7, 8]], "top1": [1, 2, 0, 4]}
    assert agreement(int4, bf16) == {"greedy_prefix": 0.75, "equal_outputs": 1, "top1_match": 0.75}
    old = {"bf16": bf16, "int4": int4}
    new = {"bf16": {**bf16, "top1": [1, 0, 3, 0]}, "int4": int4}
    assert compare(old, new) == [
        "bf16: DIFFERENT tokens",
        "int4: identical tokens; old vs its bf16: top-1 75.00%, greedy 75.0%, 1 equal; "
        "new vs its bf16: top-1 25.00%, greedy 75.0%, 1 equal",
    ]
