"""Paired rounds of the offline benchmark, driven with two duet engines (vLLM is not installed
in CI): orders alternate, each round's ratio is its own, repeated calls compute everything
again (the prefix cache is emptied) and give the same tokens; plus the flag's errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.offline.paired import DuetEngine, round_order, run_rounds
from benchmarks.offline.systems import RunConfig
from benchmarks.offline.throughput import parse_args
from benchmarks.offline.workload import make_workload


def test_round_order_alternates():
    assert [round_order(k, ["duet", "vllm"]) for k in range(3)] == [
        ["duet", "vllm"], ["vllm", "duet"], ["duet", "vllm"],
    ]  # fmt: skip


def test_rounds_of_two_engines(tiny_llama):
    workload = make_workload(6, 0, 512, {0, 1, 2}, prompt_len=(8, 40), output_len=(4, 12))
    cfg = RunConfig(
        model_dir=Path(tiny_llama), num_threads=1, max_num_seqs=8, max_num_batched_tokens=64,
        kv_cache_memory_bytes=1 << 22, max_model_len=64, warmup_prompts=[[5, 6, 7]],
    )  # fmt: skip
    a, b = DuetEngine(workload, "float32", cfg), DuetEngine(workload, "float32", cfg)
    logged: list[str] = []
    result = run_rounds({"duet": a, "other": b}, workload, rounds=3, log=logged.append)
    assert [r["order"] for r in result["rounds"]] == [
        ["duet", "other"], ["other", "duet"], ["duet", "other"],
    ]  # fmt: skip
    for r in result["rounds"]:
        assert r["ratio"] == pytest.approx(r["duet"]["tok_s"] / r["other"]["tok_s"])
        assert r["duet"]["tok_s"] == pytest.approx(workload.num_output_tokens / r["duet"]["wall_s"])
    ratios = sorted(r["ratio"] for r in result["rounds"])
    assert (result["min_ratio"], result["median_ratio"], result["max_ratio"]) == tuple(ratios)
    assert result["same_tokens_every_round"] is True
    assert result["same_tokens_every_round_by_engine"] == {"duet": True, "other": True}
    assert result["token_ids"]["duet"] == result["token_ids"]["other"]  # same weights, greedy
    assert [len(t) for t in result["token_ids"]["duet"]] == workload.max_tokens
    # Every timed call computed the whole workload: nothing came from the prefix cache.
    assert a.llm.engine.kv.prefix_stats.num_hits == b.llm.engine.kv.prefix_stats.num_hits == 0
    assert len(logged) == 6 and logged[1].startswith("  round 1 other: ")


def test_paired_rounds_flag():
    assert parse_args(["--paired-rounds", "3"]).paired_rounds == 3
    assert parse_args(["--paired-rounds", "3"]).out.name == "offline_throughput_paired.json"
    with pytest.raises(SystemExit):
        parse_args(["--paired-rounds", "-1"])


def test_length_flags_shape_the_workload(tmp_path):
    from benchmarks.offline.throughput import build_workloads

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"vocab_size": 300}')
    (model_dir / "tokenizer.json").write_text('{"added_tokens": [{"id": 0, "special": true}]}')
    args = parse_args(["--prompt-len", "20,30", "--output-len", "1,1", "--num-prompts", "5"])
    assert (args.prompt_len, args.output_len) == ((20, 30), (1, 1))
    workload, _ = build_workloads(args, model_dir)
    assert all(20 <= len(p) <= 30 for p in workload.prompts) and workload.max_tokens == [1] * 5
    assert parse_args([]).prompt_len is None  # the documented default lengths
    for bad in ("5", "9,3", "0,4", "a,b"):
        with pytest.raises(SystemExit):
            parse_args(["--prompt-len", bad])
