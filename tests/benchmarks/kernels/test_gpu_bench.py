"""benchmarks.kernels.gpu stays runnable without a GPU: it says so and exits 0, and --smoke runs the
whole script on tiny CPU shapes."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.kernels import gpu


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
