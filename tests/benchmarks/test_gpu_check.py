"""`make gpu-check` (benchmarks.gpu_check) on the CPU: without CUDA it refuses with "no CUDA
device" and exit 2, writing nothing; every piece that can run here does: pytest's junit read
into exact outcomes, the report and its verdict, the time budgets, the roofline arithmetic,
the start-up log's facts, and (slow) the serving step against a tiny dummy model, the
disaggregated step over tcp and the NCCL probe over NCCL's emulation, all on the CPU."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check
from benchmarks.gpu_check.disaggregated import backend_unavailable, run_disaggregated
from benchmarks.gpu_check.nccl_probe import run_probe
from benchmarks.gpu_check.processes import free_port
from benchmarks.gpu_check.serving import (
    LLAMA_8B,
    TINY,
    ServeSettings,
    decode_bytes_per_step,
    engine_counters,
    engine_share,
    run_serving,
    start_up_facts,
    write_dummy_model,
)

CPU = torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
@pytest.mark.parametrize("flags", [[], ["--quick"]])
def test_without_cuda_refuses_with_a_clear_message(capsys, tmp_path, flags):
    out = tmp_path / "report.json"
    assert gpu_check.main(["--out", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpu-check: no CUDA device: torch ")
    assert "nothing was run" in err
    assert not out.exists()


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="1" tests="4">
<testcase classname="tests.engine.test_cuda_sampling" name="test_matches_cpu" time="1.0"/>
<testcase classname="tests.engine.test_triton_kernels.TestOnCuda" name="test_graph" time="2.0">
<failure message="AssertionError: tokens differ">long traceback</failure></testcase>
<testcase classname="tests.deploy.test_gpu_disaggregated"
 name="test_disaggregated_over_nccl_equals_aggregated" time="0.0">
<skipped type="pytest.skip" message="the disaggregated NCCL run needs two GPUs (found 1)">
</skipped></testcase>
<testcase classname="tests.x" name="test_setup_broke" time="0.0">
<error message="failed on setup with &quot;OSError&quot;">trace</error></testcase>
</testsuite></testsuites>"""


def test_a_tests_step_cut_off_keeps_what_ran(tmp_path: Path, monkeypatch):
    """At the deadline pytest is interrupted and writes the junit report of what ran: the
    step reports those outcomes as `partial` beside the timeout."""
    from benchmarks.gpu_check.processes import StepTimeout

    def interrupted(args, deadline, log, env=None):
        junit = next(a for a in args if a.startswith("--junitxml=")).split("=", 1)[1]
        Path(junit).write_text(JUNIT)
        raise StepTimeout("['-m', 'pytest', '-m'] ran past its deadline:\n...")

    monkeypatch.setattr(gpu_check, "run_bounded", interrupted)
    report = gpu_check.run_gpu_tests(tmp_path, time.monotonic() + 5, quick=True)
    assert (report["ok"], report["outcome"], report["partial"]) == (False, "timed_out", True)
    assert (report["passed"], report["failed"], report["skipped"], report["error"]) == (1, 1, 1, 1)
    assert report["detail"].endswith("ran past its deadline:\n...")
    assert report["exit_code"] is None


def test_junit_outcomes_and_summary():
    outcomes = gpu_check.junit_outcomes(JUNIT)
    assert outcomes == {
        "tests.engine.test_cuda_sampling::test_matches_cpu": {"outcome": "passed", "detail": ""},
        "tests.engine.test_triton_kernels.TestOnCuda::test_graph": {
            "outcome": "failed",
            "detail": "AssertionError: tokens differ",
        },
        "tests.deploy.test_gpu_disaggregated::test_disaggregated_over_nccl_equals_aggregated": {
            "outcome": "skipped",
            "detail": "the disaggregated NCCL run needs two GPUs (found 1)",
        },
        "tests.x::test_setup_broke": {
            "outcome": "error",
            "detail": 'failed on setup with "OSError"',
        },
    }
    assert gpu_check.summarize(outcomes) == {"passed": 1, "failed": 1, "error": 1, "skipped": 1}


def test_device_slug():
    assert gpu_check.device_slug("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"
    assert gpu_check.device_slug("???") == "gpu"


def test_the_gpu_test_list_is_every_file_with_a_gpu_test():
    root = Path(__file__).resolve().parents[2]
    mark = re.compile(r"^\s*(@pytest\.mark\.gpu$|pytest\.mark\.gpu,)", re.MULTILINE)
    marked = {
        str(path.relative_to(root))
        for path in (root / "tests").rglob("test_*.py")
        if mark.search(path.read_text())
    }
    assert set(gpu_check.GPU_TEST_FILES) == marked
    files, left_out = gpu_check.gpu_test_files(quick=False, num_gpus=1)
    # Ray is installed here (make install), so only the two-GPU test is left out.
    assert gpu_check.DISAGGREGATED_TEST not in files and len(files) == len(marked) - 1
    assert left_out == {gpu_check.DISAGGREGATED_TEST: "needs two GPUs (found 1): NCCL refuses "
                        "two ranks on one device"}  # fmt: skip
    assert "tests/deploy/test_gpu_nixl.py" in files
    assert gpu_check.gpu_test_files(quick=True, num_gpus=1) == (list(gpu_check.QUICK_TESTS), {})


def test_budgets_fit_eight_and_four_minutes():
    assert set(gpu_check.BUDGETS_S) == set(gpu_check.QUICK_BUDGETS_S) == set(gpu_check.STEPS)
    assert sum(gpu_check.budgets(False).values()) + gpu_check.START_UP_S <= gpu_check.TOTAL_S
    assert sum(gpu_check.budgets(True).values()) + gpu_check.START_UP_S <= gpu_check.QUICK_TOTAL_S
    assert (gpu_check.TOTAL_S, gpu_check.QUICK_TOTAL_S) == (480, 240)


def test_verdict_and_report():
    passed = {"ok": True}
    skipped = {"outcome": "skipped", "detail": "kv backend 'nixl' is not registered"}
    assert gpu_check.check_ok({"tests": passed, "disaggregated": skipped})
    assert not gpu_check.check_ok({"tests": passed, "serve": {"ok": False}})
    assert not gpu_check.check_ok({"disaggregated": {"ok": True, "outcome": "failed"}})
    assert not gpu_check.check_ok({"kernels": {"ok": False, "outcome": "timed_out"}})
    report = gpu_check.assemble_report(["NVIDIA H200"], True, {"tests": passed}, 12.34)
    assert (report["device"], report["quick"], report["ok"], report["elapsed_s"]) == (
        "NVIDIA H200",
        True,
        True,
        12.3,
    )
    assert report["budgets_s"] == gpu_check.QUICK_BUDGETS_S and report["steps"] == {"tests": passed}
    json.dumps(report)  # one JSON document


def test_a_failing_step_is_recorded_and_the_check_goes_on():
    def broken() -> dict:
        raise RuntimeError("no such model")

    report = gpu_check.run_step("serve", broken, 5)
    assert (report["ok"], report["outcome"], report["budget_s"]) == (False, "error", 5)
    assert report["detail"] == "RuntimeError: no such model"


def test_roofline_summary_of_the_kernel_benchmark():
    results = {
        "copy_bandwidth_gbs": 4000.0, "matmul_tflops": 750.0,
        "models": {"llama8b": {
            "decode": [{"batch": 1, "roofline_fraction": 0.5, "graph_ms": 8.0,
                        "profile": {"eager": {"share": {"gemm": 0.25}},
                                    "graph": {"share": {"gemm": 0.75}}}},
                       {"batch": 64, "roofline_fraction": 0.6, "graph_ms": 12.0}],
            "prefill": [{"tokens": 2048, "peak_fraction": 0.55, "sdpa_peak_fraction": 0.62}],
            "mixed": [{"chunk": 256, "decodes": 64, "query": 1, "speedup": 2.5,
                       "max_abs_logit_diff": 0.0}],
        }},
    }  # fmt: skip
    assert gpu_check.roofline_summary(results) == {
        "decode_roofline_fraction": {"1": 0.5, "64": 0.6},
        "decode_graph_ms": {"1": 8.0, "64": 12.0},
        "decode_graph_host_ms": {"1": None, "64": None},
        "prefill_peak_fraction": {"2048": 0.55},
        "prefill_sdpa_peak_fraction": {"2048": 0.62},
        "decode_profile_share": {"1 eager": {"gemm": 0.25}, "1 graph": {"gemm": 0.75}},
        "piecewise_speedup": {"256+64x1": 2.5},
        "piecewise_max_abs_logit_diff": {"256+64x1": 0.0},
        "decode_attention_best": None,
        "copy_bandwidth_gbs": 4000.0,
        "matmul_tflops": 750.0,
    }
    assert gpu_check.roofline_summary(None) is None


def _level(concurrency: int, tok_s: float, itl_p99: float) -> dict:
    return {"concurrency": concurrency, "output_tok_s": tok_s, "itl_ms_p99": itl_p99}


@pytest.mark.parametrize(
    ("sdpa", "pieces", "want"),
    [
        (0.62, _level(16, 1400.0, 60.0), {"prefill_attention": "sdpa", "cuda_graph_mode": "piecewise"}),
        (0.58, _level(16, 1400.0, 60.0), {"prefill_attention": "triton", "cuda_graph_mode": "piecewise"}),
        (0.62, _level(16, 1400.0, 70.0), {"prefill_attention": "sdpa", "cuda_graph_mode": "decode"}),
        (0.62, _level(16, 1260.0, 60.0), {"prefill_attention": "sdpa", "cuda_graph_mode": "decode"}),
        (None, None, {}),
    ],
)  # fmt: skip
def test_measured_defaults_name_the_faster_choice_with_its_numbers(sdpa, pieces, want):
    """The report says which default each undecided choice should take: the alternative only
    when it measured 3% better (and, for piecewise graphs, no worse ITL p99)."""
    summary = {"prefill_peak_fraction": {"512": 0.40, "2048": 0.57},
               "prefill_sdpa_peak_fraction": {"512": 0.9, "2048": sdpa}}  # fmt: skip
    serve = {"ok": True, "levels": [_level(1, 120.0, 9.0), _level(16, 1240.0, 64.0)]}
    if pieces is not None:
        serve["piecewise"] = {"ok": True, "levels": [pieces]}
    steps = {"kernels": {"summary": summary if sdpa is not None else {}}, "serve": serve}
    got = gpu_check.measured_defaults(steps)
    assert {k: v["value"] for k, v in got.items()} == want
    if sdpa is not None:  # the longest prompt measured decides
        assert got["prefill_attention"]["prompt_tokens"] == 2048
        assert got["prefill_attention"]["peak_fraction"] == {"triton": 0.57, "sdpa": sdpa}
        assert got["cuda_graph_mode"]["by_concurrency"] == {"16": {
            "decode": {"output_tok_s": 1240.0, "itl_ms_p99": 64.0},
            "piecewise": {"output_tok_s": pieces["output_tok_s"], "itl_ms_p99": pieces["itl_ms_p99"]},
        }}  # fmt: skip


def test_engine_counters_from_metrics_and_a_levels_share():
    text = (
        '# TYPE duet:engine_steps_total counter\n'
        'duet:engine_steps_total{model_name="m"} 110.0\n'
        'duet:engine_step_seconds_total{model_name="m"} 0.75\n'
        'duet:engine_execute_seconds_total{model_name="m"} 0.5\n'
    )  # fmt: skip
    after = engine_counters(text)
    assert after == {"steps": 110.0, "step_s": 0.75, "execute_s": 0.5}
    before = {"steps": 10.0, "step_s": 0.25, "execute_s": 0.1}
    share = engine_share(before, after)
    assert share["steps"] == 100
    assert share["step_ms"] == pytest.approx(5.0) and share["execute_ms"] == pytest.approx(4.0)
    assert share["host_ms"] == pytest.approx(1.0)
    assert engine_share(after, after) == {"steps": 0}
    assert engine_counters("") == {"steps": 0.0, "step_s": 0.0, "execute_s": 0.0}


def _bandwidth(pull: float, push: float) -> dict:
    return {"outcome": "measured", "rows": [
        {"backend": "nixl", "blocks": 16, "nixl_gbs": 9.0},
        {"backend": "nixl-push", "blocks": 16, "nixl_gbs": 1.0},
        {"backend": "nixl", "blocks": 256, "nixl_gbs": pull},
        {"backend": "nixl-push", "blocks": 256, "nixl_gbs": push},
    ]}  # fmt: skip


@pytest.mark.parametrize(("pull", "push", "want"), [
    (0.07, 3.87, "push"), (100.0, 102.0, "pull"), (100.0, 104.0, "push"), (500.0, 3.87, "pull"),
])  # fmt: skip
def test_measured_defaults_name_the_faster_nixl_mode(pull, push, want):
    """nixl's mode (`DUET_KV_NIXL_MODE`) from the bandwidth rows at the most blocks measured:
    push only when it moved 3% more GB/s (the H200 of 2026-11-30: pull 0.07, push 3.87)."""
    steps = {"disaggregated": {"kv_bandwidth": _bandwidth(pull, push)}}
    assert gpu_check.measured_defaults(steps) == {"kv_nixl_mode": {
        "value": want, "blocks": 256, "block_order": "random", "gbs": {"pull": pull, "push": push},
    }}  # fmt: skip
    # with the engine's own tables measured too (`--block-order pool`), those decide
    rows = steps["disaggregated"]["kv_bandwidth"]["rows"]
    rows += [
        {"backend": "nixl", "block_order": "pool", "blocks": 256, "nixl_gbs": push},
        {"backend": "nixl-push", "block_order": "pool", "blocks": 256, "nixl_gbs": pull},
    ]  # fmt: skip
    flipped = "push" if pull > push * gpu_check.DEFAULT_MARGIN else "pull"  # the modes swapped
    assert gpu_check.measured_defaults(steps)["kv_nixl_mode"] == {
        "value": flipped, "blocks": 256, "block_order": "pool", "gbs": {"pull": push, "push": pull},
    }  # fmt: skip
    del rows[-1]  # pulled but not pushed with them: the random ids decide
    assert gpu_check.measured_defaults(steps)["kv_nixl_mode"]["block_order"] == "random"
    steps["disaggregated"]["kv_bandwidth"] = {"outcome": "timed_out", "ucx_data_paths": []}
    assert gpu_check.measured_defaults(steps) == {}


def test_the_kernels_step_profiles_decode_outside_quick(tmp_path: Path, monkeypatch):
    seen: list[list[str]] = []

    def run_bounded(args: list[str], *rest: object) -> int:
        seen.append(args)
        return 1  # nothing written: the step reports the exit code

    monkeypatch.setattr(gpu_check, "run_bounded", run_bounded)
    for quick in (False, True):
        report = gpu_check.run_kernel_benchmark(tmp_path, time.monotonic() + 60, quick)
        assert report == {"ok": False, "exit_code": 1, "results": None, "summary": None}
    assert [a[-1] for a in seen] == ["--profile", "--quick"]


def test_decode_roofline_bytes_of_llama_8b():
    # Every weight but the embedding (7,504,924,672 parameters) and 576 tokens of KV (32 layers
    # x K and V x 8 heads x 128), in bf16.
    assert (
        decode_bytes_per_step(LLAMA_8B, 576, torch.bfloat16)
        == (7_504_924_672 + 576 * 32 * 2 * 8 * 128) * 2
    )


def test_start_up_facts_from_the_serve_log():
    log = (
        "INFO duet.engine.kv_sizing: GPU memory: 139.80 GiB total, weights 14.96, activations "
        "1.20, others 0.50, cuda_graphs 0.31; KV pool 50000 blocks\n"
        "INFO duet.engine.model_runner: CUDA graphs: decode batches of 1,2,4,8,16,32,48,64 "
        "requests captured in 6.3 s; graph pool 0.42 GiB\n"
        "INFO duet.engine.model_runner: CUDA graphs: steps of up to 512 tokens in 33 pieces, "
        "24 sizes captured in 9.8 s; graph pool 0.75 GiB\n"
        "INFO duet.engine.llm_engine: loaded model (LlamaForCausalLM, bfloat16 on cuda:0) in "
        "21.5s; KV pool 50000 blocks x 16 tokens\n"
    )
    assert start_up_facts(log) == {
        "load_s": 21.5, "kv_blocks": 50000.0, "graph_capture_s": 6.3, "graph_pool_gib": 0.42,
        "graph_pool_reserved_gib": 0.31, "piecewise_capture_s": 9.8, "piecewise_pool_gib": 0.75,
    }  # fmt: skip
    assert start_up_facts("")["graph_capture_s"] is None


def test_disaggregated_step_needs_a_backend_that_pairs_processes_on_one_gpu(tmp_path: Path):
    cuda = torch.device("cuda", 0)
    assert backend_unavailable("nixl", cuda) is None  # the nixl extra: make install has it
    for name in ("torch_dist", "tcp"):
        assert "cannot pair two processes on one GPU" in (backend_unavailable(name, cuda) or "")
    assert backend_unavailable("tcp", CPU) is None
    report = run_disaggregated(tmp_path, {"device": "cuda"}, "no_such", tmp_path, time.monotonic())
    assert report["outcome"] == "skipped"
    assert "kv backend 'no_such' is not registered here" in report["detail"]


@pytest.mark.slow
def test_serving_step_on_a_tiny_dummy_model_on_the_cpu(tmp_path: Path):
    settings = ServeSettings.cpu_smoke()
    report = run_serving(settings, tmp_path, time.monotonic() + 240, free_port(), CPU)
    assert report["ok"] and report["server_exit_code"] == 0
    levels = report["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 4]
    assert [(lv["completed"], lv["failed"]) for lv in levels] == [(2, 0), (4, 0)]
    for lv in levels:
        assert 0 < lv["ttft_ms_p50"] <= lv["ttft_ms_p99"] and lv["output_tok_s"] > 0
        # the engine's steps in the level (its /metrics before and after): at one stream a
        # step a token, 6 tokens for each of 2 requests and the warm-up's; the host work
        # besides the model runner, per step
        engine = lv["engine"]
        assert engine["steps"] >= (18 if lv["concurrency"] == 1 else 6)
        assert engine["step_ms"] > engine["execute_ms"] > 0
        assert engine["host_ms"] == pytest.approx(engine["step_ms"] - engine["execute_ms"])
    start = report["start_up"]
    assert start["kv_blocks"] == 128 and start["load_s"] is not None
    assert start["graph_capture_s"] is None  # the CPU captures no graphs
    one = report["one_stream"]
    assert one["mean_context"] == 16 + 3
    assert one["roofline_fraction"] == pytest.approx(one["roofline_step_ms"] / one["itl_ms_p50"])
    # the second server, with --cuda-graph-mode piecewise (on the CPU: accepted, nothing
    # captured), benched at 4 streams
    pieces = report["piecewise"]
    assert pieces["ok"] and pieces["flags"] == ["--cuda-graph-mode", "piecewise"]
    assert pieces["server_exit_code"] == 0 and "error" not in pieces
    assert [(lv["concurrency"], lv["completed"], lv["failed"]) for lv in pieces["levels"]] == [
        (4, 4, 0)
    ]
    assert pieces["start_up"]["piecewise_capture_s"] is None


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["tcp", "nixl"])
def test_disaggregated_step_on_the_cpu(tmp_path: Path, backend: str):
    """The step as the GPU runs it (nixl is its default there), on CPU caches."""
    model = write_dummy_model(tmp_path / "model", TINY)
    engine = {"device": "cpu", "dtype": "float32", "num_kv_blocks": 256, "max_model_len": 512}
    report = run_disaggregated(
        model, engine, backend, tmp_path, time.monotonic() + 240, bandwidth_blocks=(2,)
    )
    assert report["outcome"] == "passed", report
    assert (report["num_prompts"], report["num_equal"]) == (16, 16)
    assert report["transfers"] == {"done": 16}  # every prompt's KV went over the backend
    assert report["worker_exit_codes"] == {"prefill": 0, "decode": 0}
    if backend != "nixl":
        assert "kv_bandwidth" not in report
        return
    # on the GPU: nixl between two caches on the device against a device-to-device copy
    bandwidth = report["kv_bandwidth"]
    assert (bandwidth["outcome"], bandwidth["layout"]) == ("measured", "llama3-8b-bf16")
    rows = bandwidth["rows"]
    two = 2 * 2 * 32 * 16 * 8 * 128 * 2  # two blocks of the 8B layout
    assert [(r["backend"], r["block_order"], r["blocks"], r["bytes"]) for r in rows] == [
        ("nixl", "random", 2, two), ("nixl-push", "random", 2, two),
        ("nixl", "pool", 2, two), ("nixl-push", "pool", 2, two),
    ]  # fmt: skip
    for r in rows:
        assert r["nixl_gbs"] > 0 and r["copy_gbs"] > 0 and r["raw_nixl_gbs"] > 0
        assert r["of_copy"] == pytest.approx(r["nixl_gbs"] / r["copy_gbs"], rel=1e-9)
    # the data paths UCX chose between the two processes (on the H200: what a pull rode on)
    paths = {(p["context"], p["operation"]): p["ranges"] for p in bandwidth["ucx_data_paths"]}
    cma = [["0..inf", "zero-copy", "cma/memory"]]
    read = "remote memory read by ucp_get*(multi) into host memory from host"
    write = "remote memory write by ucp_put*(multi) from host memory to host"
    assert paths[("decode intra-node cfg#1", read)] == cma  # the pull
    assert paths[("bench intra-node cfg#1", write)] == cma  # the push


@pytest.mark.slow
def test_nccl_probe_over_the_emulation_on_the_cpu(tmp_path: Path):
    """NCCL's emulation on gloo: what the probe records (the GPU's answers are the check's)."""
    report = run_probe(tmp_path, time.monotonic() + 120, 2.0, emulate=True, chunk_bytes=1 << 20,
                       handlings=("default",))  # fmt: skip
    assert (report["link"], report["num_gpus"], report["chunk_bytes"]) == (
        "nccl-emulated (gloo)",
        0,
        1 << 20,
    )
    cases = {(c["case"], c["handling"]): c for c in report["cases"]}
    assert sorted(cases) == [("dies", "default"), ("never_joins", "default")]
    for handling in ("default",):
        lone = cases[("never_joins", handling)]
        # gloo waits for its peer while the link opens: the open is what stalls.
        assert lone["result"]["open"]["returned"] is False
        assert lone["returned_within_timeout"] is False and lone["survived_watchdog"]
        dies = cases[("dies", handling)]
        assert dies["peer"] == "PEER_FIRST_CHUNK True"
        assert dies["result"]["chunk0"]["completed"] is True
        assert dies["result"]["chunk1"]["completed"] is False  # its peer is gone
        assert dies["returned_within_timeout"] is True and dies["abort_returned"] is True
        assert dies["survived_watchdog"] and dies["exit_code"] == 0
