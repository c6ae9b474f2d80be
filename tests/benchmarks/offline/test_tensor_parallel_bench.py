"""`benchmarks.offline.throughput --tensor-parallel-size N`, on the tiny model: a TP=2 and a
TP=1 engine alternate rounds on one workload, each step splits into communication (rank 0's
time in collectives) and compute, and the flag's errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.offline.systems import RunConfig
from benchmarks.offline.tensor_parallel import compare, step_split
from benchmarks.offline.throughput import parse_args
from benchmarks.offline.workload import make_workload


def test_step_split_is_per_engine_step() -> None:
    record = {"wall_s": 2.0, "num_steps": 100, "collective_s": 0.5}
    assert step_split(record) == {"step_ms": 20.0, "comm_ms": 5.0, "compute_ms": 15.0}
    assert step_split({"wall_s": 1.0, "num_steps": 10})["comm_ms"] == 0.0  # one rank


def test_two_ranks_against_one(tiny_llama: str) -> None:
    workload = make_workload(4, 0, 512, {0, 1, 2}, prompt_len=(8, 40), output_len=(4, 12))
    cfg = RunConfig(
        model_dir=Path(tiny_llama), num_threads=2, max_num_seqs=8, max_num_batched_tokens=64,
        kv_cache_memory_bytes=1 << 22, max_model_len=64, warmup_prompts=[[5, 6, 7]],
    )  # fmt: skip
    result = compare(workload, "float32", cfg, size=2, rounds=2, idle_wait_s=0.0)
    assert result["engines"] == ["tp2", "tp1"]
    assert [r["order"] for r in result["rounds"]] == [["tp2", "tp1"], ["tp1", "tp2"]]
    for record in result["rounds"]:
        tp2, tp1 = record["tp2"], record["tp1"]
        # The same steps: every rank schedules as rank 0 does, and the prefix cache was
        # emptied on both ranks before each call (else rank 1's hits would break the step).
        assert tp2["num_steps"] == tp1["num_steps"] > 0
        # Two all-reduces a layer (2 layers), the embedding's, the logits' gather, the
        # sampled tokens' and commands' broadcasts: at least five collectives a step.
        assert tp2["collective_calls"] >= 5 * tp2["num_steps"]
        assert 0 < tp2["comm_ms"] < tp2["step_ms"]
        assert tp2["compute_ms"] == pytest.approx(tp2["step_ms"] - tp2["comm_ms"])
        assert "collective_s" not in tp1 and tp1["comm_ms"] == 0.0
    assert result["same_tokens_every_round"] is True
    assert result["num_prompts"] == 4 and 3 <= result["same_tokens_as_one_rank"] <= 4
    assert 0 < result["median_comm_fraction"] < 1


def test_tensor_parallel_size_flag() -> None:
    args = parse_args(["--tensor-parallel-size", "2"])
    assert (args.tensor_parallel_size, args.out.name) == (2, "offline_throughput_tp.json")
    assert parse_args([]).tensor_parallel_size == 1
    with pytest.raises(SystemExit):
        parse_args(["--tensor-parallel-size", "0"])
