"""benchmarks.kernels.decode_splits on the CPU: every launch of the sweep (split counts, key
tiles) runs in the Triton interpreter and agrees with the engine's own launch (the sweep
raises otherwise); the engine's choice is marked once per batch; the report names the
fastest. Times mean nothing here."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.kernels import decode_splits


def test_smoke_sweep_checks_every_launch(tmp_path: Path) -> None:
    out = tmp_path / "splits.json"
    assert decode_splits.main(["--smoke", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [(r["batch"], r["splits"], r["BLOCK_N"]) for r in rows] == [
        (b, n, t) for b in (1, 3) for n in (1, 2, 4) for t in (16, 32)
    ]
    # the interpreter has one "SM": one program per KV head suffices; fp32 at head_dim 16
    # takes 32-key tiles
    assert [(r["batch"], r["splits"], r["BLOCK_N"]) for r in rows if r["chosen"]] == [
        (1, 1, 32), (3, 1, 32)
    ]  # fmt: skip
    assert set(report["best"]) == {"1", "3"}
    for batch, b in report["best"].items():
        mine = [r for r in rows if r["batch"] == int(batch)]
        assert b["fastest"]["us"] == min(r["us"] for r in mine)
        assert b["chosen"]["splits"] == 1
