"""`duet serve` against vLLM's OpenAI server, same weights, dtype, threads and client, one run.

    python -m benchmarks.serve.vs_vllm [--dtype bfloat16] [--input-len 256] [--output-len 128]

Each server runs alone (the other is stopped), on the embedded SmolLM2-135M-Instruct exported
to one HF directory (benchmarks/offline/smollm2_hf.py), and is driven by `duet bench serve`
(loadgen/) over streamed /v1/completions with token-id prompts and `ignore_eos`, so both
compute exactly the same token counts. Three measurements per server, vLLM first:

- one stream: requests one after another (`--max-concurrency 1`): inter-token latency;
- saturation: every request sent at once: output tokens/s and requests/s;
- half load: Poisson arrivals at half of vLLM's saturation requests/s: inter-token latency.

vLLM runs from its own virtualenv (`--vllm-python`, default .venv-bench/bin/python; set-up in
benchmarks/README.md) with its OpenMP threads bound to cores 0..threads-1; duet with as many
torch threads. The JSON (default benchmarks/results/serve_vs_vllm.json) keeps every request.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from benchmarks.common.machine import REPO_ROOT, write_record
from benchmarks.offline.smollm2_hf import export_hf_dir

START_TIMEOUT_S = 900.0  # vLLM compiles its graphs at start-up


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--one-stream-requests", type=int, default=8)
    p.add_argument("--saturation-requests", type=int, default=64)
    p.add_argument("--half-load-requests", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=2 << 30)
    p.add_argument("--systems", default="vllm,duet", help="comma list, vllm first")
    p.add_argument("--vllm-python", type=Path, default=REPO_ROOT / ".venv-bench/bin/python")
    p.add_argument("--enforce-eager", action="store_true", help="vLLM without torch.compile")
    p.add_argument(
        "--duet-args", default="", help="extra `duet serve` flags, e.g. '--no-deterministic'"
    )
    p.add_argument("--port", type=int, default=18431)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks/results/serve_vs_vllm.json")
    return p.parse_args(argv)


def server_command(system: str, model: Path, args: argparse.Namespace) -> list[str]:
    common = [
        "--port", str(args.port), "--dtype", args.dtype,
        "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", "2048",
        "--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes),
    ]  # fmt: skip
    if system == "duet":
        extra = shlex.split(args.duet_args)
        return [sys.executable, "-m", "duet.cli", "serve", "--model", str(model), *common, *extra]
    cmd = [str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server"]
    cmd += ["--model", str(model), *common, "--disable-uvicorn-access-log"]
    return cmd + (["--enforce-eager"] if args.enforce_eager else [])


def server_env(system: str, args: argparse.Namespace) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    if system == "vllm":
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{args.threads - 1}"
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    else:
        env["OMP_NUM_THREADS"] = str(args.threads)
    return env


def wait_until_up(proc: subprocess.Popen[bytes], url: str, log: Path) -> float:
    """Seconds until GET /v1/models answers; raises if the server exits or takes too long."""
    start = time.monotonic()
    while time.monotonic() - start < START_TIMEOUT_S:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as reply:
                if reply.status == 200:
                    return time.monotonic() - start
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"server not up within {START_TIMEOUT_S:g}s:\n{log.read_text()[-3000:]}")


def bench(url: str, model: Path, args: argparse.Namespace, out: Path, *flags: str) -> dict:
    """One `duet bench serve` run; its summary."""
    cmd = [
        sys.executable, "-m", "duet.cli", "bench", "serve", "--url", url, "--tokenizer", str(model),
        "--input-len-dist", f"fixed:{args.input_len}",
        "--output-len-dist", f"fixed:{args.output_len}",
        "--num-warmup", "2", "--request-timeout-s", "900", "--no-plot",
        "--result-json", str(out), *flags,
    ]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    result = json.loads(out.read_text())
    summary = result["runs"][0]["summary"]
    if summary["failed"]:
        raise RuntimeError(f"{summary['failed']} requests failed: {summary['errors']}")
    return summary


@contextmanager
def running_server(
    system: str, model: Path, args: argparse.Namespace, tmp: Path
) -> Iterator[tuple[subprocess.Popen[bytes], float]]:
    """`system`'s server (`server_command`, `server_env`, its log in `tmp`), once it answers:
    (the process, seconds it took to come up). Stopped (SIGINT, then killed) on leaving."""
    log = tmp / "server.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(
            server_command(system, model, args),
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=server_env(system, args),
            cwd=REPO_ROOT,
        )
    try:
        start_s = wait_until_up(proc, f"http://127.0.0.1:{args.port}", log)
        print(f"{system}: up in {start_s:.0f}s", flush=True)
        yield proc, start_s
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def run_system(system: str, model: Path, args: argparse.Namespace, half_rate: float | None):
    url = f"http://127.0.0.1:{args.port}"
    with (
        tempfile.TemporaryDirectory(prefix=f"duet-vs-{system}-") as tmp,
        running_server(system, model, args, Path(tmp)) as (_, start_s),
    ):
        one = bench(url, model, args, Path(tmp) / "one.json", "--rate", "inf",
                    "--num-requests", str(args.one_stream_requests), "--max-concurrency", "1")  # fmt: skip
        sat = bench(url, model, args, Path(tmp) / "sat.json", "--rate", "inf",
                    "--num-requests", str(args.saturation_requests))  # fmt: skip
        rate = half_rate if half_rate is not None else sat["request_throughput"] / 2
        half = bench(url, model, args, Path(tmp) / "half.json", "--rate", f"{rate:.4f}",
                     "--num-requests", str(args.half_load_requests))  # fmt: skip
    return {"start_s": start_s, "one_stream": one, "saturation": sat,
            "half_load": {**half, "rate": rate}}  # fmt: skip


def table(results: dict[str, dict]) -> str:
    rows = [
        ("one stream: ITL p50 (ms)", lambda r: r["one_stream"]["itl_ms"]["p50"], False),
        ("one stream: output tok/s", lambda r: r["one_stream"]["output_throughput"], True),
        ("saturation: output tok/s", lambda r: r["saturation"]["output_throughput"], True),
        ("saturation: requests/s", lambda r: r["saturation"]["request_throughput"], True),
        ("half load: ITL p50 (ms)", lambda r: r["half_load"]["itl_ms"]["p50"], False),
        ("half load: ITL p90 (ms)", lambda r: r["half_load"]["itl_ms"]["p90"], False),
        ("half load: TTFT p50 (ms)", lambda r: r["half_load"]["ttft_ms"]["p50"], False),
    ]
    names = list(results)
    lines = [
        "| metric | " + " | ".join(names) + " | duet/vLLM |",
        "| --- |" + " ---: |" * (len(names) + 1),
    ]
    for label, get, higher_better in rows:
        values = {n: get(results[n]) for n in names}
        ratio = ""
        if "duet" in values and "vllm" in values and values["vllm"]:
            ratio = f"{values['duet'] / values['vllm']:.2f}x" + (
                "" if higher_better else " (lower is better)"
            )
        lines.append(
            f"| {label} | " + " | ".join(f"{values[n]:.2f}" for n in names) + f" | {ratio} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    systems = args.systems.split(",")
    model = export_hf_dir()
    results: dict[str, dict] = {}
    half_rate = None
    for system in systems:
        results[system] = run_system(system, model, args, half_rate)
        if system == "vllm":
            half_rate = results[system]["half_load"]["rate"]
    print(table(results))
    write_record(args.out, "serve_vs_vllm", args, results, ("engine", "router", "decode_worker"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
