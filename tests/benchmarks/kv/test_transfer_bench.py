"""The KV-transfer benchmark's measurement at a tiny size: real sender and receiver processes,
the JSON's structure and the bytes it counts (timings are not asserted), plus its flag errors."""

from __future__ import annotations

import itertools
import json

import pytest

from benchmarks.kv.transfer import format_table, main, parse_args
from benchmarks.kv.transfer_measure import block_tables, measure_layout
from benchmarks.kv.transfer_peers import LAYOUTS, LayoutSpec

TINY = LayoutSpec("tiny", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
STATS = {"median", "min", "max"}
RESULT_KEYS = {
    "load_avg_before", "num_blocks", "bytes", "duet_done_s", "duet_ack_s", "send_call_s",
    "raw_s", "duet_done_gbps", "duet_ack_gbps", "raw_gbps", "ratio_done", "ratio_ack",
    "duet_cpu_s", "raw_cpu_s", "other_cores_median", "other_cores_max", "busy", "reps",
}  # fmt: skip
DUET_REP_KEYS = {"done_s", "ack_s", "send_call_s", "cpu_s", "own_cores", "other_cores", "checked"}


def test_block_bytes_of_the_real_layouts():
    # 2 (K and V) * layers * block_size * kv_heads * head_dim * bytes per element
    assert LAYOUTS["smollm2-135m-fp32"].block_bytes == 2 * 30 * 16 * 3 * 64 * 4 == 737_280
    assert LAYOUTS["smollm2-135m-bf16"].block_bytes == 368_640
    assert LAYOUTS["llama3-8b-bf16"].block_bytes == 2 * 32 * 16 * 8 * 128 * 2 == 2_097_152


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch_dist", "tcp"])
def test_measure_tiny_layout_counts_exact_bytes(tmp_path, backend):
    logged: list[str] = []
    layout = measure_layout(
        TINY, [1, 3], reps=1, warmup=0, pool_blocks=5, timeout_s=30, backend=backend,
        log=logged.append,
    )  # fmt: skip
    block_bytes = 2 * 2 * 4 * 2 * 8 * 4
    assert layout["layout"] == {
        "name": "tiny", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "block_size": 4,
        "dtype": "float32", "block_bytes": block_bytes,
    }  # fmt: skip
    assert (layout["pool_blocks"], layout["backend"]) == (5, backend)
    assert [r["num_blocks"] for r in layout["results"]] == [1, 3]
    for result, num_blocks in zip(layout["results"], [1, 3], strict=True):
        assert set(result) == RESULT_KEYS
        assert result["bytes"] == num_blocks * block_bytes
        for key in ("duet_done_s", "duet_ack_s", "send_call_s", "raw_s"):
            assert set(result[key]) == STATS
            assert 0 < result[key]["min"] <= result[key]["median"] <= result[key]["max"]
        assert result["duet_done_gbps"] == pytest.approx(
            result["bytes"] / result["duet_done_s"]["median"] / 1e9
        )
        assert result["ratio_done"] == pytest.approx(
            result["raw_s"]["median"] / result["duet_done_s"]["median"]
        )
        [rep] = result["reps"]
        assert set(rep["duet"]) == DUET_REP_KEYS and set(rep["raw"]) == {
            "s", "cpu_s", "own_cores", "other_cores",
        }  # fmt: skip
        assert rep["duet"]["checked"] is True  # the only rep: the receiver's blocks verified
        assert len(result["load_avg_before"]) == 3
    assert len(logged) == 2 and logged[0].startswith(f"  tiny {backend} 1 blocks: load average")
    table = format_table([layout])
    assert table.splitlines()[2].split()[:4] == ["tiny", backend, "1", f"{block_bytes / 1e6:.2f}"]
    json.dumps(layout)  # the whole result is JSON-serialisable


def test_flag_errors_name_the_flag(capsys):
    for argv, message in [
        (["--blocks", "1,0"], "every block count must be >= 1"),
        (["--blocks", "x"], "a comma list of integers"),
        (["--layouts", "gpt5"], "choose from smollm2-135m-fp32"),
        (["--backends", "tcp,rdma"], "choose from torch_dist, tcp"),
        (["--reps", "0"], "--reps: must be >= 1"),
        (["--threads", "0"], "--threads: must be >= 1"),
        (["--poll-interval-ms", "0"], "--poll-interval-ms: must be in (0, 100]"),
        (["--tcp-stripes", "17"], "--tcp-stripes: must be in [1, 16]"),
        (["--blocks", "256", "--pool-blocks", "100"], "--pool-blocks: 100 is smaller than"),
        (
            ["--blocks", "256", "--block-order", "pool", "--pool-blocks", "300"],
            "--pool-blocks: 300 leaves no room for churn beside 256 blocks (need >= 384)",
        ),
    ]:
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err


def test_pool_smaller_than_a_transfer_is_refused():
    with pytest.raises(ValueError, match="--pool-blocks: 2 is smaller than the largest transfer"):
        measure_layout(TINY, [3], reps=1, pool_blocks=2)


@pytest.mark.slow
def test_main_writes_the_json(tmp_path, capsys):
    out = tmp_path / "kv.json"
    argv = ["--layouts", "smollm2-135m-bf16", "--blocks", "1", "--reps", "1", "--warmup", "0"]
    assert main([*argv, "--pool-blocks", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "kv_transfer"
    assert report["command"].endswith(" ".join(argv) + f" --pool-blocks 2 --out {out}")
    assert report["config"]["threads"] == 1 and report["target"]["num_blocks"] == 256
    assert report["config"]["malloc"] == "engine" and report["config"]["tcp_stripes"] == 2
    assert report["target"]["met"] == {}  # 256 blocks were not measured
    assert [layout["backend"] for layout in report["layouts"]] == ["torch_dist", "tcp"]
    for layout in report["layouts"]:
        assert layout["results"][0]["bytes"] == 368_640
    assert "smollm2-135m-bf16" in capsys.readouterr().out


def test_block_tables_random_or_in_runs():
    src, dst = block_tables(300, 256, seed=0)
    assert len(set(src)) == len(set(dst)) == 256 and max(src + dst) < 300
    assert src != sorted(src)  # no order
    src, dst = block_tables(300, 256, seed=0, order="runs")
    assert src == list(range(src[0], src[0] + 256)) and dst == list(range(dst[0], dst[0] + 256))
    assert 0 <= src[0] <= 44 and 0 <= dst[0] <= 44
    assert block_tables(300, 256, seed=0, order="runs") == (src, dst)  # seeded


def test_block_tables_from_the_engines_allocator_after_churn():
    src, dst = block_tables(1024, 256, seed=0, order="pool")
    assert len(set(src)) == len(set(dst)) == 256 and max(src + dst) < 1024
    assert src == sorted(src) and dst == sorted(dst)  # ascending, as BlockPool serves them
    for ids in (src, dst):
        runs = 1 + sum(1 for a, b in itertools.pairwise(ids) if b != a + 1)
        assert 16 < runs < 200  # churned: neither one run nor every block on its own
    assert block_tables(1024, 256, seed=0, order="pool") == (src, dst)  # seeded
    assert block_tables(1024, 256, seed=1, order="pool") != (src, dst)
    with pytest.raises(ValueError, match=r"--pool-blocks: 300 leaves no room for churn"):
        block_tables(300, 256, seed=0, order="pool")
