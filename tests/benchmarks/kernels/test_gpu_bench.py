"""benchmarks.kernels.gpu stays runnable without a GPU: it says so and exits 0, and --smoke runs the
whole script on tiny CPU shapes."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.kernels import gpu
from benchmarks.kernels.gpu_profile import kind_of, summarise


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_without_cuda_says_so_and_exits_0(capsys, tmp_path):
    out = tmp_path / "gpu.json"
    assert gpu.main(["--out", str(out)]) == 0
    assert "no CUDA device on this machine, nothing measured" in capsys.readouterr().out
    assert not out.exists()


def test_smoke_run_writes_every_measurement(tmp_path):
    out = tmp_path / "gpu.json"
    assert gpu.main(["--smoke", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["copy_bandwidth_gbs"] > 0 and results["matmul_tflops"] > 0
    tiny = results["models"]["tiny"]
    assert [d["batch"] for d in tiny["decode"]] == [1, 4]
    assert [p["tokens"] for p in tiny["prefill"]] == [64]
    for d in tiny["decode"]:
        assert d["eager_ms"] > 0 and d["hf_step_ms"] > 0 and d["roofline_ms"] > 0
    for p in tiny["prefill"]:
        assert p["tflops"] > 0 and p["hf_ms"] > 0
    # a chunk of 16 beside 4 decodes; 4 requests verifying 2 guesses each: in pieces (replayed
    # by calling them on the CPU) the eager step's logits, bit for bit in fp32
    mixed = [(m["chunk"], m["decodes"], m["query"], m["tokens"]) for m in tiny["mixed"]]
    assert mixed == [(16, 4, 1, 20), (0, 4, 3, 12)]
    for m in tiny["mixed"]:
        assert m["eager_ms"] > 0 and m["piecewise_ms"] > 0
        assert m["max_abs_logit_diff"] == 0.0


def test_prefill_rows_time_the_kernel_and_sdpa_on_the_triton_backend():
    """On a GPU the prefill rows time the paged prefill kernel and, in the same run, the
    prompt's attention in SDPA (`--prefill-attention sdpa`); here under the interpreter."""
    s = gpu.Settings(smoke=True)
    s.triton = True
    s.prefill_lens = [32]  # the interpreter's time grows with the prompt's square
    _, duet = gpu.build_models(gpu.MODELS["tiny"], s)
    [row] = gpu.prefill_bench(duet, s)
    assert row["tokens"] == 32 and row["ms"] > 0 and row["sdpa_ms"] > 0
    assert row["tflops"] == pytest.approx(row["flops"] / row["ms"] / 1e9)
    assert row["sdpa_tflops"] == pytest.approx(row["flops"] / row["sdpa_ms"] / 1e9)
    assert row["sdpa_max_abs_logit_diff"] < 1e-4  # fp32: two summation orders
    s.deterministic = True  # the kernel only: SDPA is not batch-invariant with decode
    s.prefill_lens = [8]
    [row] = gpu.prefill_bench(duet, s)
    assert "sdpa_ms" not in row and "sdpa_max_abs_logit_diff" not in row


def test_smoke_profile_splits_each_decode_step_by_kind(tmp_path):
    out = tmp_path / "gpu.json"
    assert gpu.main(["--smoke", "--profile", "--out", str(out)]) == 0
    for d in json.loads(out.read_text())["models"]["tiny"]["decode"]:
        assert list(d["profile"]) == ["eager"]  # no graphs on the CPU
        p = d["profile"]["eager"]
        assert p["kernels_seen"] > 0 and p["by_kind_ms"]["gemm"] > 0
        assert p["kernel_ms"] == pytest.approx(sum(p["by_kind_ms"].values()), rel=1e-9)
        assert p["step_ms"] == d["eager_ms"]
        assert p["uncovered_ms"] == pytest.approx(d["eager_ms"] - p["kernel_ms"], rel=1e-9)
        tops = [k["ms"] for k in p["top"]]
        assert tops == sorted(tops, reverse=True) and 0 < len(tops) <= 10


def test_kernel_kinds_of_names_seen_on_hopper():
    names = {
        "nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT": "gemm",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64": "gemm",
        "_matmul_kernel": "gemm",
        "_decode_kernel": "attention",
        "_merge_kernel": "attention",
        "_write_kv_kernel": "kv_write",
        "_rms_norm_kernel": "norm",
        "void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel": "activation",
        "void at::native::reduce_kernel<512, 1, ArgMaxOps<float>>": "sampling",
        "void at::native::index_elementwise_kernel<128, 4>": "copy_elementwise",
        "void at::native::unrolled_elementwise_kernel<direct_copy_kernel_cuda>": "copy_elementwise",
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL": "communication",
        "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x1>": "gemm",
        "triton_poi_fused_0": "other",
    }
    assert {name: kind_of(name) for name in names} == names


def test_profile_summary_arithmetic():
    prof = {"kernel_ms": 6.0, "by_kind_ms": {"gemm": 4.0, "attention": 2.0}, "kernels_seen": 3}
    s = summarise(prof, step_ms=8.0, weight_bytes=8_000_000_000, bandwidth_gbs=4000.0)
    assert s["uncovered_ms"] == 2.0 and s["share"] == {"gemm": 0.5, "attention": 0.25}
    assert s["weights_roofline_ms"] == 2.0 and s["gemm_of_roofline"] == 0.5


def test_unknown_model_is_refused():
    with pytest.raises(SystemExit) as exc:
        gpu.main(["--models", "llama8b,gpt5"])
    assert exc.value.code == 2


def test_cut_off_in_hf_baseline_keeps_duets_rows(tmp_path, monkeypatch):
    """The first whole gpu-check on an H200 lost every duet number when its time ran out inside
    HF's baseline: duet's rows are on disk before HF runs."""

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # what gpu-check's deadline sends (SIGINT)

    monkeypatch.setattr(gpu, "hf_bench", interrupted)
    out = tmp_path / "gpu.json"
    with pytest.raises(KeyboardInterrupt):
        gpu.main(["--smoke", "--out", str(out)])
    tiny = json.loads(out.read_text())["models"]["tiny"]
    assert tiny["hf_baseline"] == "not measured (yet)"
    assert [d["batch"] for d in tiny["decode"]] == [1, 4]
    assert all(d["roofline_fraction"] > 0 and "hf_step_ms" not in d for d in tiny["decode"])
    [prefill] = tiny["prefill"]
    assert prefill["tokens"] == 64 and prefill["peak_fraction"] > 0 and "hf_ms" not in prefill
