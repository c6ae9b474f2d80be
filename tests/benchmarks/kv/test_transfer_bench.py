"""The KV-transfer benchmark's measurement at a tiny size: real sender and receiver processes,
the JSON's structure and the bytes it counts (timings are not asserted), the raw NIXL
baseline, the targets, the staging pool it passes to the backends, plus its flag errors."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from benchmarks.kv import transfer
from benchmarks.kv.allocator import num_runs
from benchmarks.kv.raw_nixl import RawNixl, nixl_installed
from benchmarks.kv.transfer import check_targets, format_table, main, parse_args
from benchmarks.kv.transfer_measure import (
    block_tables,
    default_pool_blocks,
    measure_layout,
    pool_problem,
)
from benchmarks.kv.transfer_peers import LAYOUTS, LayoutSpec
from duet.kv_transfer.chunks import plan_pieces
from duet.kv_transfer.staging import MIN_STAGING_BYTES

TINY = LayoutSpec("tiny", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
STATS = {"median", "min", "max"}
RESULT_KEYS = {
    "load_avg_before", "num_blocks", "bytes", "duet_done_s", "duet_ack_s", "send_call_s",
    "raw_s", "duet_done_gbps", "duet_ack_gbps", "raw_gbps", "ratio_done", "ratio_ack",
    "duet_cpu_s", "raw_cpu_s", "other_cores_median", "other_cores_max", "busy", "reps",
    "raw_nixl_s", "raw_nixl_gbps", "ratio_done_nixl", "raw_nixl_cpu_s", "chunks",
    "raw_copy_s", "raw_copy_gbps", "ratio_done_copy",
}  # fmt: skip
DUET_REP_KEYS = {
    "done_s", "ack_s", "send_call_s", "cpu_s", "own_cores", "other_cores", "checked", "chunks",
}  # fmt: skip
RAW_REP_KEYS = {"s", "cpu_s", "own_cores", "other_cores"}


def test_block_bytes_of_the_real_layouts():
    # 2 (K and V) * layers * block_size * kv_heads * head_dim * bytes per element
    assert LAYOUTS["smollm2-135m-fp32"].block_bytes == 2 * 30 * 16 * 3 * 64 * 4 == 737_280
    assert LAYOUTS["smollm2-135m-bf16"].block_bytes == 368_640
    assert LAYOUTS["llama3-8b-bf16"].block_bytes == 2 * 32 * 16 * 8 * 128 * 2 == 2_097_152


@pytest.mark.slow
@pytest.mark.parametrize(
    ("backend", "raw_nixl", "copy"),
    [("torch_dist", False, False), ("tcp", False, True), ("tcp", True, False),
     ("nixl", True, True), ("nixl-push", False, False)],
)  # fmt: skip
def test_measure_tiny_layout_counts_exact_bytes(tmp_path, backend, raw_nixl, copy):
    """`copy`: the copy baseline (on a GPU the device-to-device copy; here a host copy)."""
    logged: list[str] = []
    layout = measure_layout(
        TINY, [1, 3], reps=1, warmup=0, pool_blocks=5, timeout_s=30, backend=backend,
        raw_nixl=raw_nixl, copy_baseline=copy, log=logged.append,
    )  # fmt: skip
    block_bytes = 2 * 2 * 4 * 2 * 8 * 4
    assert layout["layout"] == {
        "name": "tiny", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "block_size": 4,
        "dtype": "float32", "block_bytes": block_bytes,
    }  # fmt: skip
    assert (layout["pool_blocks"], layout["backend"], layout["device"]) == (5, backend, "cpu")
    assert [r["num_blocks"] for r in layout["results"]] == [1, 3]
    for result, num_blocks in zip(layout["results"], [1, 3], strict=True):
        assert set(result) == RESULT_KEYS
        assert result["bytes"] == num_blocks * block_bytes
        timed = ["duet_done_s", "duet_ack_s", "send_call_s", "raw_s"]
        for key in timed + (["raw_nixl_s"] if raw_nixl else []):
            assert set(result[key]) == STATS
            assert 0 < result[key]["min"] <= result[key]["median"] <= result[key]["max"]
        if raw_nixl:  # the NIXL write of the same bytes, against which nixl's target stands
            assert result["raw_nixl_gbps"] == pytest.approx(
                result["bytes"] / result["raw_nixl_s"]["median"] / 1e9
            )
            assert result["ratio_done_nixl"] == pytest.approx(
                result["raw_nixl_s"]["median"] / result["duet_done_s"]["median"]
            )
        else:
            assert [result[k] for k in ("raw_nixl_s", "raw_nixl_gbps", "ratio_done_nixl")] == [
                None, None, None,
            ]  # fmt: skip
        if copy:
            assert set(result["raw_copy_s"]) == STATS
            median = result["raw_copy_s"]["median"]
            assert result["raw_copy_gbps"] == pytest.approx(result["bytes"] / median / 1e9)
            assert result["ratio_done_copy"] == pytest.approx(
                median / result["duet_done_s"]["median"]
            )
        else:
            assert [result[k] for k in ("raw_copy_s", "raw_copy_gbps", "ratio_done_copy")] == [
                None, None, None,
            ]  # fmt: skip
        assert result["chunks"] == 1  # a tiny transfer: one message
        assert result["duet_done_gbps"] == pytest.approx(
            result["bytes"] / result["duet_done_s"]["median"] / 1e9
        )
        assert result["ratio_done"] == pytest.approx(
            result["raw_s"]["median"] / result["duet_done_s"]["median"]
        )
        [rep] = result["reps"]
        assert set(rep) == {"duet", "raw"} | ({"raw_nixl"} if raw_nixl else set()) | (
            {"raw_copy"} if copy else set()
        )
        assert set(rep["duet"]) == DUET_REP_KEYS and set(rep["raw"]) == RAW_REP_KEYS
        if raw_nixl:
            assert set(rep["raw_nixl"]) == RAW_REP_KEYS
        if copy:
            assert set(rep["raw_copy"]) == RAW_REP_KEYS
        assert rep["duet"]["checked"] is True  # the only rep: the receiver's blocks verified
        assert len(result["load_avg_before"]) == 3
    assert len(logged) == 2 and logged[0].startswith(f"  tiny {backend} 1 blocks: load average")
    table = format_table([layout])
    row = table.splitlines()[2].split()
    assert row[:4] == ["tiny", backend, "1", f"{block_bytes / 1e6:.2f}"]
    first = layout["results"][0]
    if raw_nixl:
        nixl_cells = [f"{first['raw_nixl_gbps']:.2f}", f"{first['ratio_done_nixl']:.2f}"]
    else:
        nixl_cells = ["-", "-"]
    copy_cells = (
        [f"{first['raw_copy_gbps']:.2f}", f"{first['ratio_done_copy']:.2f}"] if copy else ["-", "-"]
    )
    assert row[9:14] == [*nixl_cells, *copy_cells, "1"]
    json.dumps(layout)  # the whole result is JSON-serialisable


@pytest.mark.slow
def test_the_staging_pool_reaches_the_backends_and_cuts_tcp_frames():
    """`--kv-staging-memory` is both sides' pool: tcp's whole-request send goes as as many
    frames as the receiver's pieces allow (a quarter of its pool), counted per transfer."""
    mid = LayoutSpec("mid", num_layers=2, num_kv_heads=2, head_dim=64, block_size=16,
                     dtype="float32")  # fmt: skip
    layer_block_bytes = 2 * 16 * 2 * 64 * 4  # K and V of one block in one layer: 16 KiB
    expected = plan_pieces([(0, 2, layer_block_bytes)], 40, MIN_STAGING_BYTES // 4, whole=True)
    assert len(expected) == 6  # 640 KiB layers in 256 KiB pieces: 3 a layer
    chunks = {}
    for staging in (None, MIN_STAGING_BYTES):
        layout = measure_layout(
            mid, [40], reps=1, warmup=0, pool_blocks=44, timeout_s=30, backend="tcp",
            staging_bytes=staging, log=lambda _: None,
        )  # fmt: skip
        assert layout["staging_bytes"] == staging
        [result] = layout["results"]
        assert result["reps"][0]["duet"]["checked"] is True  # landed bit-exact either way
        chunks[staging] = result["chunks"]
    assert chunks == {None: 1, MIN_STAGING_BYTES: 6}


def test_the_raw_nixl_write_lands_the_bytes_and_notifies():
    """The baseline itself, in one process: the receiver's buffer holds the sender's first
    `nbytes` once `wait` returns; a write larger than the buffer is refused by name."""
    recv, send = RawNixl("t-recv", 1 << 16), RawNixl("t-send", 1 << 16)
    try:
        recv.buffer.zero_()
        send.buffer.copy_(torch.arange(1 << 16).to(torch.uint8))
        send.connect(recv.metadata, recv.address)
        # NOTE: the receiver waits on a thread of its own, as in its own process: a small
        # write completes only once the target's worker has made progress
        with ThreadPoolExecutor(1) as pool:
            waited = pool.submit(recv.wait, 7, 10)
            send.write(1000, tag=7, timeout_s=10)
            waited.result(timeout=20)
        assert torch.equal(recv.buffer[:1000], send.buffer[:1000])
        assert int(recv.buffer[1000:].count_nonzero()) == 0
        with pytest.raises(ValueError, match=r"nbytes: 65537 is not in \[1, 65536\]"):
            send.write((1 << 16) + 1, tag=8, timeout_s=10)
        with pytest.raises(TimeoutError, match="raw NIXL write 9: no notification"):
            recv.wait(9, timeout_s=0.05)
    finally:
        send.close()
        recv.close()


def _result(num_blocks, done_gbps, ratio_done, ratio_done_nixl):
    return {
        "num_blocks": num_blocks, "duet_done_gbps": done_gbps, "ratio_done": ratio_done,
        "ratio_done_nixl": ratio_done_nixl,
    }  # fmt: skip


def _layout(name, backend, *results):
    return {"layout": {"name": name}, "backend": backend, "results": list(results)}


def test_targets_nixl_against_the_raw_write_and_tcp():
    layouts = [
        _layout("a", "tcp", _result(16, 9.0, 0.1, 0.1), _result(256, 2.0, 0.9, 0.4)),
        _layout("a", "torch_dist", _result(256, 1.0, 0.7, 0.2)),
        _layout("a", "nixl", _result(256, 3.0, 1.5, 0.8)),  # >= 0.8 and faster than tcp
        _layout("a", "nixl-push", _result(256, 1.9, 0.8, 0.9)),  # slower than tcp
        _layout("b", "nixl", _result(256, 3.0, 1.5, 0.79)),  # no tcp on b: the ratio alone
        _layout("c", "nixl", _result(256, 3.0, 1.5, None)),  # no raw NIXL write: not met
    ]
    assert check_targets(layouts) == {
        "a/tcp": True, "a/torch_dist": False, "a/nixl": True, "a/nixl-push": False,
        "b/nixl": False, "c/nixl": False,
    }  # fmt: skip
    assert check_targets([_layout("a", "tcp", _result(16, 9.0, 1.0, 1.0))]) == {}


def test_flag_errors_name_the_flag(capsys):
    for argv, message in [
        (["--blocks", "1,0"], "every block count must be >= 1"),
        (["--blocks", "x"], "a comma list of integers"),
        (["--layouts", "gpt5"], "choose from smollm2-135m-fp32"),
        (["--backends", "tcp,rdma"], "choose from torch_dist, tcp, nixl, nixl-push"),
        (["--kv-staging-memory", "512KiB"], "--kv-staging-memory: must be in [1048576, "),
        (["--kv-staging-memory", "lots"], "must be a number of bytes"),
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
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            parse_args(["--device", "cuda"])
        assert "--device cuda: no CUDA device here" in capsys.readouterr().err
    else:
        with pytest.raises(SystemExit):
            parse_args(["--device", "cuda", "--backends", "nixl,tcp"])
        assert "--backends tcp: with --device cuda only nixl" in capsys.readouterr().err


def test_the_copy_baseline_is_off_on_the_cpu_unless_asked():
    assert parse_args([]).copy_baseline is False
    assert parse_args(["--copy-baseline"]).copy_baseline is True


def test_without_nixl_the_defaults_leave_it_out_and_asking_for_it_is_an_error(capsys, monkeypatch):
    assert nixl_installed()  # this environment installs it (make install)
    args = parse_args([])
    assert (args.backends, args.raw_nixl) == (["torch_dist", "tcp", "nixl"], True)
    monkeypatch.setattr(transfer, "nixl_installed", lambda: False)
    args = parse_args([])
    assert (args.backends, args.raw_nixl) == (["torch_dist", "tcp"], False)
    for argv, message in [
        (["--backends", "tcp,nixl-push"], "--backends nixl-push: needs NIXL"),
        (["--raw-nixl"], "--raw-nixl: needs NIXL"),
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
    assert report["config"]["raw_nixl"] is True and report["config"]["kv_staging_bytes"] is None
    assert (report["config"]["device"], report["config"]["copy_baseline"]) == ("cpu", False)
    assert report["target"]["met"] == {}  # 256 blocks were not measured
    assert [layout["backend"] for layout in report["layouts"]] == ["torch_dist", "tcp", "nixl"]
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

    # churned, yet in few runs: the allocator takes the blocks that make the fewest runs
    # among the least recently freed (strict LRU: 83 runs for `src`, test_allocator_bench.py)
    assert [num_runs(src), num_runs(dst)] == [7, 4]
    assert block_tables(1024, 256, seed=0, order="pool") == (src, dst)  # seeded
    assert block_tables(1024, 256, seed=1, order="pool") != (src, dst)
    with pytest.raises(ValueError, match=r"--pool-blocks: 300 leaves no room for churn"):
        block_tables(300, 256, seed=0, order="pool")


def test_the_default_pool_leaves_room_for_churn_at_any_size():
    """`--block-order pool`: four times the largest transfer, and at least the largest plus
    the churn's largest prompt (128 blocks), so small transfers churn too."""
    assert default_pool_blocks([256], "pool") == 1024
    assert default_pool_blocks([2, 16], "pool") == 16 + 128
    assert default_pool_blocks([16], "random") == 16 + 44
    for sizes in ([2], [16], [256]):
        assert pool_problem(default_pool_blocks(sizes, "pool"), sizes, "pool") is None
