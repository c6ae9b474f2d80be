"""benchmarks.quantized.gpu stays runnable without a GPU: it says so and exits 0, and --smoke runs
the whole script (kernels in Triton's interpreter, the sweep, the model's decode step) on tiny
CPU shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.quantized.gpu", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_without_cuda_says_so_and_exits_0(tmp_path):
    out = tmp_path / "q.json"
    proc = run("--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "no CUDA device on this machine, nothing measured" in proc.stdout
    assert not out.exists()


def test_smoke_run_writes_every_measurement(tmp_path):
    out = tmp_path / "q.json"
    proc = run("--smoke", "--sweep", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(out.read_text())
    assert [(r["layer"], r["rows"]) for r in results["kernels"]] == [("o", 1), ("o", 7)]
    for r in results["kernels"]:
        for fmt in ("int8", "int8-g32", "int4-g32", "int4-g128"):
            assert r[fmt]["ms"] > 0 and r[fmt]["bytes"] < r["bf16_bytes"], fmt
        # int4 reads under a third of bf16's bytes at groups of 128 (scales and zeros included)
        assert r["int4-g128"]["bytes"] / r["bf16_bytes"] < 0.3
    assert [(c["format"], c["rows"]) for c in results["sweep"]] == [
        ("int8", 1), ("int4-g32", 1), ("int4-g128", 1)
    ]  # fmt: skip
    model = results["model"]
    assert list(model) == ["bf16", "int8", "int4-g32", "int4-g128"]
    assert model["int8"][0]["weight_bytes"] < model["bf16"][0]["weight_bytes"]
    assert model["int4-g32"][0]["weight_bytes"] < model["int8"][0]["weight_bytes"]
    for rows in model.values():
        assert [r["batch"] for r in rows] == [1, 2]
        assert all(r["eager_ms"] > 0 and r["speedup_vs_bf16"] > 0 for r in rows)
