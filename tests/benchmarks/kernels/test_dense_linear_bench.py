"""benchmarks.kernels.dense_linear runs end to end at one row count in both dtypes and writes a
measurement per layer against the baseline torch has for the dtype."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.kernels import dense_linear
from duet.engine.model.dense_cpu_linear import load_dense_kernel
from duet.engine.model.packed_linear import packing_supported


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_one_row_count_measures_every_layer(tmp_path, dtype):
    out = tmp_path / "dense.json"
    dense_linear.main(["--dtype", dtype, "--rows", "1", "--rounds", "1", "--out", str(out)])
    data = json.loads(out.read_text())
    packed = packing_supported(getattr(torch, dtype))
    assert data["baseline"] == ("oneDNN packed" if packed else "torch F.linear")
    kernel = load_dense_kernel()
    form = "FMA panels"
    if dtype == "bfloat16" and kernel.amx():
        form = "AMX tiles"
    elif dtype == "bfloat16" and kernel.bf16_dot():
        form = "AVX512-BF16 dot"
    assert data["duet_form"] == form
    assert [(r["layer"], r["n"], r["k"], r["rows"]) for r in data["results"]] == [
        ("qkv", 960, 576, 1),
        ("o", 576, 576, 1),
        ("gate_up", 3072, 576, 1),
        ("down", 576, 1536, 1),
    ]
    for r in data["results"]:
        assert r["duet_ms"] > 0 and r["baseline_ms"] > 0
        assert r["duet_over_baseline"] == pytest.approx(r["duet_ms"] / r["baseline_ms"])
