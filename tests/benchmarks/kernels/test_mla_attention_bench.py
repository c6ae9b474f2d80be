"""benchmarks.kernels.mla_attention runs end to end on a small shape and writes, per context,
the kernel's and the reference's times for a decode step and a prefill chunk (the script checks
that their outputs agree before timing)."""

from __future__ import annotations

import json

import pytest

from benchmarks.kernels import mla_attention


def test_a_small_run_writes_both_cases(tmp_path):
    out = tmp_path / "mla.json"
    args = ["--heads", "4", "--contexts", "40,300", "--batch", "2", "--prefill", "8"]
    assert mla_attention.main([*args, "--reps", "2", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["benchmark"] == "mla_attention" and record["config"]["dtype"] == "bfloat16"
    data = record["results"]
    assert data["read_bandwidth_gbs"] > 0
    assert [(r["context"], r["batch"], r["heads"]) for r in data["rows"]] == [
        (40, 2, 4),
        (300, 2, 4),
    ]
    for r in data["rows"]:
        for case in ("decode", "prefill"):
            c = r[case]
            assert c["kernel_ms"] > 0 and c["reference_ms"] > 0
            assert c["speedup"] == pytest.approx(c["reference_ms"] / c["kernel_ms"])
        assert r["decode"]["bytes_read"] == 2 * r["context"] * 576 * 2
