"""What a benchmark ran on: the CPU's model and the SIMD flags that change duet's code paths,
and the commit of the code it measured."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]

# the flags that pick kernels or dtypes in duet (engine/kernels/cpu_simd.h, engine/config.py)
SIMD_FLAGS = {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}


def cpu_info() -> dict[str, Any]:
    """{"cpu_model", "num_cpus", "cpu_flags"} read from /proc/cpuinfo ("unknown" elsewhere)."""
    cpu_model, flags = "unknown", set[str]()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and cpu_model == "unknown":
                cpu_model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {
        "cpu_model": cpu_model,
        "num_cpus": os.cpu_count(),
        "cpu_flags": sorted(flags & SIMD_FLAGS),
    }


def git_commit(*paths: str) -> str | None:
    """HEAD, with "-dirty" when the code under `paths` differs from it (results files aside)."""

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        )

    try:
        head = git("rev-parse", "--short", "HEAD").stdout.strip()
        status = git("status", "--porcelain", "--", *paths, ":!benchmarks/results").stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("-dirty" if status.strip() else "")) or None


def write_record(
    out: Path,
    benchmark: str,
    args: argparse.Namespace,
    results: dict[str, Any],
    code: tuple[str, ...] = ("engine", "router"),
) -> None:
    """The result JSON: the benchmark's name and flags, the machine and the commit of `code`,
    when it ran, and `results`."""
    record = {
        "benchmark": benchmark,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": {**cpu_info(), "git_commit": git_commit(*code)},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "results": results,
    }
    write_json(out, record, indent=1)


def write_json(out: Path, report: dict[str, Any], indent: int = 2) -> None:
    """`report` as JSON at `out` (its folder made if missing), and a line saying so."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=indent) + "\n")
    print(f"wrote {out}")
