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
    assert all(r["ok"] and r["max_abs_diff"] <= 1e-4 and "error" not in r for r in rows)
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


def test_a_launch_that_fails_is_a_row_not_the_end(monkeypatch) -> None:
    """On a GPU a launch that does not compile (say, shared memory) leaves its error in its row;
    a wrong one is marked; the fastest is among the right ones."""
    import torch

    from duet.engine.kernels import triton_decode

    real = triton_decode.paged_decode_attention

    def flaky(out, *args, tiles=None):
        if tiles and tiles.get("BLOCK_N") == 16:
            raise RuntimeError("out of resources")
        real(out, *args, tiles=tiles)
        if args[-1] == 2:  # num_splits
            out += 1.0

    monkeypatch.setattr(triton_decode, "paged_decode_attention", flaky)
    rows = decode_splits.sweep(torch.device("cpu"), torch.float32, (1,), 40,
                               {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16}, (1, 2),
                               ({"BLOCK_N": 16}, {"BLOCK_N": 32}), iters=1)  # fmt: skip
    got = [(r["splits"], r["BLOCK_N"], r.get("error"), r.get("ok")) for r in rows]
    assert got == [(1, 16, "RuntimeError: out of resources", None), (1, 32, None, True),
                   (2, 16, "RuntimeError: out of resources", None), (2, 32, None, False)]  # fmt: skip
    assert decode_splits.best(rows)["1"]["fastest"]["splits"] == 1
