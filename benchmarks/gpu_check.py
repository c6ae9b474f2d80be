"""`make gpu-check`: verify a machine with NVIDIA GPUs in one command, and write one JSON report.

    python -m benchmarks.gpu_check [--out PATH] [--skip-bench] [--models llama8b,smollm2]

1. the `gpu`-marked tests (`pytest -m gpu`): the Triton kernels compiled at Llama-3.1-8B and
   SmolLM2 shapes in bf16, CUDA-graph decode with split-K captured, seeded sampling at
   temperature > 0 on CUDA (and against the CPU), deterministic inference in bf16 (decode ==
   prefill, chunked == whole, prefix hit == cold attention, bitwise; the batch-invariant
   matmul), the KV pool sized from free memory, the GPU
   benchmark's own checks, and the disaggregated run with KV over NCCL against the aggregated
   engine (two GPUs; with one, pytest skips it and the report says why);
2. `benchmarks.kernels.gpu`: decode step time against the HBM roofline, prefill against the
   matmul peak, HF transformers as the baseline;
3. the report, `benchmarks/results/gpu_check_<device>.json` by default: the device, each test's
   outcome (with the reason of every skip), the benchmark's numbers.

Exits 0 only when no test failed or errored and the benchmark ran. Without a CUDA device it
exits 2 with "no CUDA device": nothing here is meaningful on a CPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
DISAGGREGATED_TEST = "test_disaggregated_over_nccl_equals_aggregated"
TESTS_TIMEOUT_S = 3600
BENCH_TIMEOUT_S = 3600


def no_cuda_reason() -> str | None:
    """Why this machine cannot be checked, or None when it has a CUDA device."""
    if torch.cuda.is_available():
        return None
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    return (
        f"no CUDA device: torch {torch.__version__} ({build}) sees no GPU. gpu-check needs an "
        "NVIDIA GPU, its driver and a CUDA build of torch in .venv (docs/gpu.md); nothing was run"
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


def run_gpu_tests(env: dict[str, str]) -> tuple[dict[str, dict[str, str]], int]:
    """Every gpu-marked test, in a subprocess; (outcomes by test id, pytest's exit code)."""
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", f"--junitxml={junit}"]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=TESTS_TIMEOUT_S)
        if not junit.exists():
            return {}, proc.returncode or 1
        return junit_outcomes(junit.read_text()), proc.returncode


def run_benchmark(env: dict[str, str], models: str) -> tuple[dict[str, Any] | None, int]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "gpu.json"
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.kernels.gpu",
            "--models",
            models,
            "--out",
            str(out),
        ]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=BENCH_TIMEOUT_S)
        results = json.loads(out.read_text()) if out.exists() else None
        return results, proc.returncode


def device_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "gpu"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_check", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--out", help="report path (default benchmarks/results/gpu_check_<device>.json)"
    )
    parser.add_argument("--skip-bench", action="store_true", help="tests only, no benchmark")
    parser.add_argument("--models", default="llama8b,smollm2", help="for benchmarks.kernels.gpu")
    args = parser.parse_args(argv)
    reason = no_cuda_reason()
    if reason is not None:
        print(f"gpu-check: {reason}", file=sys.stderr)
        return 2

    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    # NOTE: TRITON_INTERPRET=1 would run the "GPU" kernels on the CPU: never inherit it.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    print(f"gpu-check on {len(names)} GPU(s): {', '.join(names)}", flush=True)

    outcomes, pytest_code = run_gpu_tests(env)
    counts = summarize(outcomes)
    disaggregated = next(
        (dict(o, test=t) for t, o in outcomes.items() if t.endswith(DISAGGREGATED_TEST)),
        {"outcome": "missing", "detail": f"{DISAGGREGATED_TEST} did not run"},
    )
    bench, bench_code = (None, 0) if args.skip_bench else run_benchmark(env, args.models)
    failures = {t: o for t, o in outcomes.items() if o["outcome"] in ("failed", "error")}
    ok = (
        pytest_code == 0
        and counts["passed"] > 0
        and not failures
        and (args.skip_bench or (bench_code == 0 and bench is not None))
    )
    report = {
        "device": names[0],
        "devices": names,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "ok": ok,
        "tests": {"exit_code": pytest_code, **counts, "failures": failures, "all": outcomes},
        "disaggregated_nccl": disaggregated,
        "benchmark": {"skipped": True} if args.skip_bench else {"exit_code": bench_code, "results": bench},
    }  # fmt: skip
    out = Path(args.out or ROOT / "benchmarks/results" / f"gpu_check_{device_slug(names[0])}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"gpu-check: {'OK' if ok else 'FAILED'}: tests {counts}, disaggregated NCCL run "
        f"{disaggregated['outcome']}, benchmark "
        f"{'skipped' if args.skip_bench else f'exit {bench_code}'}; report {out}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
