"""benchmarks/kv/allocator.py: the eviction window's runs and prefix hits against strict LRU."""

from __future__ import annotations

import json
import random
from pathlib import Path

from benchmarks.kv import allocator
from benchmarks.kv.transfer_measure import churned_table


def test_runs_of_consecutive_ids():
    assert [allocator.num_runs(t) for t in ([], [4], [1, 2, 3], [1, 3], [5, 6, 9, 10, 2])] == [
        0, 1, 1, 2, 3,
    ]  # fmt: skip


def test_a_churned_table_keeps_its_runs_only_with_the_window():
    """The transfer benchmark's churn (`--block-order pool`): strict LRU leaves a 256-block
    table in 83 runs for seed 0, the default window in 7."""
    tables = {
        w: churned_table(1024, 256, random.Random(256), w) for w in (1, 2)
    }  # the seed `--block-order pool` gives seed 0
    assert {w: allocator.num_runs(t) for w, t in tables.items()} == {1: 83, 2: 7}
    assert all(sorted(t) == t and len(set(t)) == 256 for t in tables.values())


def test_main_writes_both_windows(tmp_path: Path, capsys):
    out = tmp_path / "allocator.json"
    args = ["--seeds", "2", "--requests", "60", "--hit-seeds", "1", "--out", str(out)]
    assert allocator.main(args) == 0
    got = json.loads(out.read_text())
    assert sorted(got["windows"]) == ["1", "2"]
    for window in (1, 2):
        w = got["windows"][str(window)]
        assert w["runs"] == [allocator.table_runs(1024, 256, s, window) for s in (0, 1)]
        assert w["hit_rates"] == [allocator.prefix_hit_rate(400, 60, 0, window)]
        assert 0 < w["hit_rates"][0] < 1
    assert got["runs_ratio"] == got["windows"]["2"]["runs_mean"] / got["windows"]["1"]["runs_mean"]
    assert "window 2x / strict" in capsys.readouterr().out
