"""`make gpu-check`: verify a machine with NVIDIA GPUs in one command, and write one JSON report.

    python -m benchmarks.gpu_check [--quick] [--out PATH] [--kv-backend nixl] [--skip STEP ...]

Steps, each in its own processes and bounded by its share of the time (`budgets`: the whole
check under 8 minutes on one H200, `--quick` under 4):

1. `tests`: the `gpu`-marked tests (`pytest -m gpu`; `--quick`: the loader's and the Triton
   kernels'), each outcome with the reason of every skip;
2. `kernels`: `benchmarks.kernels.gpu --quick` at Llama-3.1-8B shapes (decode batches 1 and
   64, a 2,048-token prefill): decode step time against the HBM roofline, prefill against
   the matmul peak, HF transformers as the baseline (the whole sweep is that module's own);
3. `serve`: `duet serve` with a Llama-3.1-8B-shaped model of dummy weights, driven by
   `duet bench serve` at 1, 16 and 64 concurrent streams of 512 prompt and 128 output tokens
   (`--quick`: 1 and 16): TTFT and ITL p50/p99, output tok/s, the one-stream ITL against the
   roofline step time, capture time and graph pool from the start-up log (serving.py);
4. `disaggregated`: a prefill and a decode worker as plain processes on one GPU, KV over
   `--kv-backend`, 16 prompts' greedy tokens against the aggregated engine's; then (not in
   `--quick`, nixl only) nixl's GB/s pulling and pushing 16 and 256 blocks of a Llama-8B
   layout between two processes' caches on the GPU against a device-to-device copy of the
   same bytes (`benchmarks.kv.transfer --device cuda`) (disaggregated.py);
5. `nccl_probe`: a torch_dist link whose peer never joins or dies after the first chunk,
   under PyTorch's and duet's TORCH_NCCL_ASYNC_ERROR_HANDLING (nccl_probe.py): findings,
   reported as `recorded`, never a failure.

The report, `benchmarks/results/gpu_check_<device>.json` by default, holds every step's
findings. Exits 0 only when no test failed, the benchmark ran, every serving request completed,
and the disaggregated run did not fail (skipped, with its reason, is not a failure). Without a
CUDA device it exits 2 with "no CUDA device" and runs nothing.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import re
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_check.processes import ROOT, StepTimeout, child_env, free_port, run_bounded

STEPS = ("tests", "kernels", "serve", "disaggregated", "nccl_probe")
BUDGETS_S: dict[str, int] = {
    "tests": 185, "kernels": 75, "serve": 90, "disaggregated": 80, "nccl_probe": 35,
}  # fmt: skip
"""From the whole run on an H200 of 2026-11-30: the tests were cut off at 155 s with 40 of
their 43 run (the last three, NIXL's, take 15 s alone), the kernels step (quick shapes, HF's
baseline, the profile) took 39 s, serving at three concurrencies and piecewise at one 73 s,
the disaggregated step's tokens about 30 s before nixl's GB/s (whose pull path took 14 s a
256-block transfer there, #42), the probe 28 s. The kernels step has since gained the decode
attention kernel's launch sweep (`benchmarks/kernels/decode_splits.py`: 20 launches a batch,
about 15 s with their compiles)."""
QUICK_BUDGETS_S: dict[str, int] = {
    "tests": 40, "kernels": 60, "serve": 55, "disaggregated": 35, "nccl_probe": 30,
}  # fmt: skip
START_UP_S = 15
"""The check's own start (Python, torch, CUDA) and the report, outside every step's budget."""
TOTAL_S, QUICK_TOTAL_S = 480, 240
"""The bounds the budgets must fit, start-up included (checked by the tests)."""
GPU_TEST_FILES = (
    "tests/engine/test_cuda_sampling.py",
    "tests/engine/test_loader.py",
    "tests/engine/test_piecewise_graphs.py",
    "tests/engine/test_quantized_model.py",
    "tests/engine/test_quantized_triton.py",
    "tests/engine/test_structured_outputs.py",
    "tests/engine/test_tensor_parallel.py",
    "tests/engine/test_triton_attention_order.py",
    "tests/engine/test_triton_elementwise.py",
    "tests/engine/test_triton_kernels.py",
    "tests/engine/test_triton_matmul.py",
    "tests/engine/test_triton_mla.py",
    "tests/engine/test_triton_moe.py",
    "tests/engine/test_triton_real_shapes.py",
    "tests/kv_transfer/test_nixl_gpu.py",
    "tests/kv_transfer/test_torch_dist_probe.py",
    "tests/deploy/test_gpu_disaggregated.py",
    "tests/deploy/test_gpu_nixl.py",
)
"""Every test file with a `gpu`-marked test (a test checks the list): named, not found by
collecting all of tests/, whose other modules import what a GPU machine need not carry (Ray,
Helm's SDK, Selenium)."""
DISAGGREGATED_TEST = "tests/deploy/test_gpu_disaggregated.py"
RAY_TESTS = (DISAGGREGATED_TEST, "tests/deploy/test_gpu_nixl.py")
"""GPU tests that start a local Ray cluster (and drive it with the openai client): the
air-gapped runbook does not carry Ray, so these run only where it is installed."""
QUICK_TESTS = ("tests/engine/test_loader.py", "tests/engine/test_triton_kernels.py")
NCCL_PROBE_TIMEOUT_S = 3.0
"""The transfer timeout the probe's links run under (their watchdog: 4x)."""


def budgets(quick: bool) -> dict[str, int]:
    return dict(QUICK_BUDGETS_S if quick else BUDGETS_S)


def no_cuda_reason() -> str | None:
    """Why this machine cannot be checked, or None when it has a CUDA device."""
    if torch.cuda.is_available():
        return None
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    return (
        f"no CUDA device: torch {torch.__version__} ({build}) sees no GPU. gpu-check needs an "
        "NVIDIA GPU, its driver and a CUDA build of torch (docs/gpu.md); nothing was run"
    )


def junit_outcomes(xml_text: str) -> dict[str, dict[str, str]]:
    """pytest's junit XML -> {test id: {"outcome": passed|failed|error|skipped, "detail"}}."""
    outcomes = {}
    for case in ET.fromstring(xml_text).iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, detail = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = "failed" if tag == "failure" else tag
                detail = (node.get("message") or node.text or "")[:2000]
                break
        outcomes[test_id] = {"outcome": outcome, "detail": detail}
    return outcomes


def summarize(outcomes: dict[str, dict[str, str]]) -> dict[str, int]:
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for o in outcomes.values():
        counts[o["outcome"]] += 1
    return counts


def device_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "gpu"


def gpu_test_files(quick: bool, num_gpus: int) -> tuple[list[str], dict[str, str]]:
    """The test files to run and those left out, each with its reason."""
    files = list(QUICK_TESTS if quick else GPU_TEST_FILES)
    left_out: dict[str, str] = {}
    missing = [m for m in ("ray", "helm_python", "openai") if importlib.util.find_spec(m) is None]
    for test in RAY_TESTS:
        if test not in files:
            continue
        if test == DISAGGREGATED_TEST and num_gpus < 2:
            left_out[test] = (
                f"needs two GPUs (found {num_gpus}): NCCL refuses two ranks on one device"
            )
        elif missing:
            left_out[test] = f"needs {', '.join(missing)}, not installed here"
    return [f for f in files if f not in left_out], left_out


def run_gpu_tests(workdir: Path, deadline: float, quick: bool) -> dict[str, Any]:
    """pytest over the gpu-marked tests. Cut off at the deadline (SIGINT), pytest still writes
    its junit report of the tests that ran: those outcomes are kept (`partial`), not lost
    with the step (as on the first H200 run, where 30 passed tests were reported only as a
    timeout)."""
    junit = workdir / "junit.xml"
    files, left_out = gpu_test_files(quick, torch.cuda.device_count())
    args = ["-m", "pytest", "-m", "gpu or sweep", "-q", "-rs", "-p", "no:cacheprovider",
            f"--junitxml={junit}", *files]  # fmt: skip
    timed_out = None
    try:
        code = run_bounded(args, deadline, workdir / "pytest.log", child_env())
    except StepTimeout as e:
        code, timed_out = None, str(e)
    outcomes = junit_outcomes(junit.read_text()) if junit.exists() else {}
    counts = summarize(outcomes)
    failures = {t: o for t, o in outcomes.items() if o["outcome"] in ("failed", "error")}
    ok = code == 0 and counts["passed"] > 0 and not failures
    report = {"ok": ok, "exit_code": code, **counts, "failures": failures,
              "left_out": left_out, "all": outcomes}  # fmt: skip
    if timed_out is not None:
        report.update(outcome="timed_out", partial=True, detail=timed_out[-1500:])
    return report


def run_kernel_benchmark(workdir: Path, deadline: float, quick: bool) -> dict[str, Any]:
    """`benchmarks.kernels.gpu` at Llama-3.1-8B shapes, at its `--quick` shapes in either mode
    (decode batches 1 and 64, one 2,048-token prefill: the whole sweep with HF's baseline
    outlasts the step's 90 s, as on the first H200 run). Outside `--quick` the decode steps are
    also profiled (device time by kind of kernel: benchmarks/kernels/gpu_profile.py). Cut off in
    HF's baseline, duet's rows are still reported (`partial`)."""
    out = workdir / "kernels.json"
    args = ["-m", "benchmarks.kernels.gpu", "--models", "llama8b", "--out", str(out), "--quick"]
    if not quick:
        args.append("--profile")
    try:
        code = run_bounded(args, deadline, workdir / "kernels.log", child_env())
    except StepTimeout as e:
        if not out.exists():
            raise
        results = json.loads(out.read_text())
        return {"ok": False, "outcome": "timed_out", "partial": True, "detail": str(e)[-1500:],
                "results": results, "summary": roofline_summary(results)}  # fmt: skip
    results = json.loads(out.read_text()) if out.exists() else None
    return {"ok": code == 0 and results is not None, "exit_code": code, "results": results,
            "summary": roofline_summary(results)}  # fmt: skip


def roofline_summary(results: dict[str, Any] | None) -> dict[str, Any] | None:
    """The decode steps' fractions of the HBM roofline and prefill's of the matmul peak."""
    if not results or "llama8b" not in results.get("models", {}):
        return None
    model = results["models"]["llama8b"]
    return {
        "decode_roofline_fraction": {str(d["batch"]): d["roofline_fraction"] for d in model["decode"]},
        "decode_graph_ms": {str(d["batch"]): d["graph_ms"] for d in model["decode"]},
        "decode_graph_host_ms": {str(d["batch"]): d.get("graph_host_ms") for d in model["decode"]},
        "prefill_peak_fraction": {str(p["tokens"]): p["peak_fraction"] for p in model["prefill"]},
        "prefill_sdpa_peak_fraction": {
            str(p["tokens"]): p.get("sdpa_peak_fraction") for p in model["prefill"]
        },
        "decode_profile_share": {
            f"{d['batch']} {mode}": prof["share"]
            for d in model["decode"] for mode, prof in d.get("profile", {}).items()
        },
        "piecewise_speedup": {
            f"{m['chunk']}+{m['decodes']}x{m['query']}": m.get("speedup")
            for m in model.get("mixed", [])
        },
        "piecewise_max_abs_logit_diff": {
            f"{m['chunk']}+{m['decodes']}x{m['query']}": m.get("max_abs_logit_diff")
            for m in model.get("mixed", [])
        },
        "decode_attention_best": (model.get("decode_attention") or {}).get("best"),
        "copy_bandwidth_gbs": results.get("copy_bandwidth_gbs"),
        "matmul_tflops": results.get("matmul_tflops"),
    }  # fmt: skip


def run_step(name: str, fn: Callable[[], dict[str, Any]], budget_s: int) -> dict[str, Any]:
    """One step's report: its own, plus how long it took; a timeout or an exception becomes
    the report of a failed step (the check goes on with the next)."""
    started = time.monotonic()
    print(f"gpu-check: {name} (up to {budget_s} s)", flush=True)
    try:
        report = fn()
    except StepTimeout as e:
        report = {"ok": False, "outcome": "timed_out", "detail": str(e)[-3000:]}
    except Exception as e:  # recorded in the report; the next step still runs
        report = {"ok": False, "outcome": "error", "detail": f"{type(e).__name__}: {e}"[-3000:],
                  "traceback": traceback.format_exc()[-3000:]}  # fmt: skip
    report["seconds"] = round(time.monotonic() - started, 1)
    report["budget_s"] = budget_s
    return report


def check_ok(steps: dict[str, dict[str, Any]]) -> bool:
    """Every step that ran did its job; a skipped step (asked, or without what it needs, such
    as the disaggregated step before its KV backend exists) does not fail the check."""
    for report in steps.values():
        if report.get("outcome") in ("skipped", "not_run"):
            continue
        if report.get("outcome") == "failed" or not report.get("ok", True):
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_check", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--out", help="report path (default benchmarks/results/gpu_check_<device>.json)"
    )
    parser.add_argument("--quick", action="store_true", help="fewer tests and shapes: < 4 min")
    parser.add_argument("--skip", nargs="*", default=[], choices=STEPS, metavar="STEP",
                        help=f"steps not to run: {', '.join(STEPS)}")  # fmt: skip
    parser.add_argument("--skip-bench", action="store_true", help="same as --skip kernels")
    parser.add_argument("--kv-backend", default="nixl",
                        help="KV backend of the disaggregated step (default: %(default)s)")  # fmt: skip
    args = parser.parse_args(argv)
    reason = no_cuda_reason()
    if reason is not None:
        print(f"gpu-check: {reason}", file=sys.stderr)
        return 2
    skip = set(args.skip) | ({"kernels"} if args.skip_bench else set())
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    print(f"gpu-check on {len(names)} GPU(s): {', '.join(names)}", flush=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        steps = run_steps(Path(tmp), budgets(args.quick), args.quick, args.kv_backend, skip)
    report = assemble_report(names, args.quick, steps, time.monotonic() - started)
    out = Path(args.out or ROOT / "benchmarks/results" / f"gpu_check_{device_slug(names[0])}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    outcome = {
        k: v.get("outcome", "ok" if v.get("ok", True) else "failed") for k, v in steps.items()
    }
    print(f"gpu-check: {'OK' if report['ok'] else 'FAILED'} in {report['elapsed_s']:.0f} s: "
          f"{outcome}; report {out}")  # fmt: skip
    for flag, choice in report["measured_defaults"].items():
        print(f"gpu-check: measured default {flag} = {choice['value']}: "
              f"{json.dumps({k: v for k, v in choice.items() if k != 'value'})}")  # fmt: skip
    return 0 if report["ok"] else 1


def run_steps(
    workdir: Path, budget: dict[str, int], quick: bool, kv_backend: str, skip: set[str]
) -> dict[str, dict[str, Any]]:
    from benchmarks.gpu_check.disaggregated import run_disaggregated
    from benchmarks.gpu_check.nccl_probe import run_probe
    from benchmarks.gpu_check.serving import LLAMA_8B, ServeSettings, run_serving, write_dummy_model

    def deadline(name: str) -> float:
        return time.monotonic() + budget[name]

    device = torch.device("cuda", 0)
    settings = ServeSettings.quick() if quick else ServeSettings()
    disaggregated_engine = dict(
        device="cuda", dtype="bfloat16", num_kv_blocks=2048, max_num_seqs=16,
        max_model_len=2048, deterministic=True,
    )  # fmt: skip
    work: dict[str, Callable[[], dict[str, Any]]] = {
        "tests": lambda: run_gpu_tests(workdir, deadline("tests"), quick),
        "kernels": lambda: run_kernel_benchmark(workdir, deadline("kernels"), quick),
        "serve": lambda: run_serving(
            settings, workdir / "serve", deadline("serve"), free_port(), device
        ),
        "disaggregated": lambda: run_disaggregated(
            write_dummy_model(workdir / "disaggregated" / "model", LLAMA_8B),
            disaggregated_engine,
            kv_backend,
            workdir / "disaggregated",
            deadline("disaggregated"),
            bandwidth_blocks=() if quick else (16, 256),
        ),
        "nccl_probe": lambda: run_probe(
            _mkdir(workdir / "nccl_probe"), deadline("nccl_probe"), NCCL_PROBE_TIMEOUT_S, False
        ),
    }
    steps: dict[str, dict[str, Any]] = {}
    for name in STEPS:
        if name in skip:
            steps[name] = {"outcome": "skipped", "detail": "asked (--skip)"}
            continue
        (workdir / name).mkdir(parents=True, exist_ok=True)
        steps[name] = run_step(name, work[name], budget[name])
    return steps


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def assemble_report(
    names: list[str], quick: bool, steps: dict[str, dict[str, Any]], elapsed_s: float
) -> dict[str, Any]:
    """The one JSON report: the machine, the versions, every step's findings, the verdict."""
    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "device": names[0] if names else None,
        "devices": names,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "quick": quick,
        "ok": check_ok(steps),
        "elapsed_s": round(elapsed_s, 1),
        "budgets_s": budgets(quick),
        "measured_defaults": measured_defaults(steps),
        "steps": steps,
    }


DEFAULT_MARGIN = 1.03
"""How much better (3%) the alternative must measure before it replaces a default."""


def measured_defaults(steps: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """What this run says each default undecided on a GPU should be, with the numbers: the
    prefill attention (`--prefill-attention`: the kernel benchmark's prefill rows at the
    longest prompt measured), the CUDA-graph mode (`--cuda-graph-mode`: the serve step's
    output tok/s and ITL p99 at each concurrency both servers ran) and nixl's mode
    (`DUET_KV_NIXL_MODE`: pull and push GB/s at the most blocks both moved). A choice this run did not
    measure is absent; the alternative wins only by `DEFAULT_MARGIN`."""
    out: dict[str, dict[str, Any]] = {}
    summary = (steps.get("kernels") or {}).get("summary") or {}
    kernel = summary.get("prefill_peak_fraction") or {}
    sdpa = summary.get("prefill_sdpa_peak_fraction") or {}
    tokens = max((t for t in kernel if sdpa.get(t) is not None), key=int, default=None)
    if tokens is not None:
        better = sdpa[tokens] > kernel[tokens] * DEFAULT_MARGIN
        out["prefill_attention"] = {
            "value": "sdpa" if better else "triton", "prompt_tokens": int(tokens),
            "peak_fraction": {"triton": kernel[tokens], "sdpa": sdpa[tokens]},
        }  # fmt: skip
    serve = steps.get("serve") or {}
    decode = {lv["concurrency"]: lv for lv in serve.get("levels", [])}
    pieces = serve.get("piecewise") or {}
    shared = [lv for lv in pieces.get("levels", []) if lv["concurrency"] in decode]
    if pieces.get("ok") and shared:
        better = all(
            lv["output_tok_s"] > decode[lv["concurrency"]]["output_tok_s"] * DEFAULT_MARGIN
            and lv["itl_ms_p99"] <= decode[lv["concurrency"]]["itl_ms_p99"]
            for lv in shared
        )
        out["cuda_graph_mode"] = {
            "value": "piecewise" if better else "decode",
            "by_concurrency": {
                str(lv["concurrency"]): {
                    mode: {"output_tok_s": level["output_tok_s"], "itl_ms_p99": level["itl_ms_p99"]}
                    for mode, level in (("decode", decode[lv["concurrency"]]), ("piecewise", lv))
                }
                for lv in shared
            },
        }  # fmt: skip
    bandwidth = (steps.get("disaggregated") or {}).get("kv_bandwidth") or {}
    gbs: dict[int, dict[str, float]] = {}
    rows = bandwidth.get("rows", [])
    order = "pool" if _both_modes(rows, "pool") else "random"
    for row in rows:
        if row.get("block_order", "random") != order:
            continue  # chosen by the engine's own tables where both modes ran with them
        mode = "push" if row["backend"] == "nixl-push" else "pull"
        gbs.setdefault(row["blocks"], {})[mode] = row["nixl_gbs"]
    both = [n for n, by_mode in gbs.items() if len(by_mode) == 2]
    if both:
        blocks = max(both)
        pull, push = gbs[blocks]["pull"], gbs[blocks]["push"]
        out["kv_nixl_mode"] = {
            "value": "push" if push > pull * DEFAULT_MARGIN else "pull", "blocks": blocks,
            "block_order": order, "gbs": {"pull": pull, "push": push},
        }  # fmt: skip
    return out


def _both_modes(rows: list[dict[str, Any]], order: str) -> bool:
    """Whether nixl pulled and pushed with block ids in `order`."""
    return {r["backend"] for r in rows if r.get("block_order") == order} >= {"nixl", "nixl-push"}
