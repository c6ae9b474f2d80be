"""Where serving's throughput goes: one saturation workload through three layers of duet, in
one run, each in its own process.

    python -m benchmarks.serve.engine_paths [--dtype float32] [--num-requests 64]

1. offline: `LLMEngine.step` called on the process's main thread;
2. engine thread: `AsyncEngine` (the step loop on `EngineCore`'s thread, outputs assembled by
   asyncio readers on the main thread), no HTTP;
3. `duet serve`, driven by `duet bench serve` (every request at once, streamed
   /v1/completions), as `benchmarks.serve.vs_vllm`'s saturation run.

All three run the same requests: `--num-requests` prompts of `--input-len` random token ids
(a fresh seed per path, so no prefix-cache hits), `--output-len` greedy tokens with
`ignore_eos`. For the server it reads the CPU time of each of the server's threads from /proc
before and after the run: the main thread (uvicorn's event loop: HTTP, SSE, detokenization)
against the rest (the engine thread and torch's OpenMP workers), and the client's own CPU time,
which shares the machine's cores. JSON to `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common.machine import REPO_ROOT, write_record
from benchmarks.offline.smollm2_hf import export_hf_dir
from benchmarks.serve.vs_vllm import bench, running_server

PATHS = ("offline", "engine_thread", "serve")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=2 << 30)
    p.add_argument("--port", type=int, default=18432)
    p.add_argument("--path", choices=PATHS[:2], help=argparse.SUPPRESS)  # one in-process path
    p.add_argument(
        "--out", type=Path, default=REPO_ROOT / "benchmarks/results/serve_engine_paths.json"
    )
    return p.parse_args(argv)


def _engine_config(args: argparse.Namespace, model: Path):  # -> EngineConfig
    from duet.engine.config import EngineConfig

    return EngineConfig(
        model=str(model), dtype=args.dtype, max_num_seqs=args.max_num_seqs,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes, max_model_len=2048,
        load_progress=False,
    )  # fmt: skip


def _prompts(args: argparse.Namespace, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(100, 40000) for _ in range(args.input_len)] for _ in range(args.num_requests)
    ]


def run_in_process(args: argparse.Namespace, model: Path) -> dict:
    """Path 1 or 2 in this process: warm up on two short requests, then time the workload."""
    from duet.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    warm = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = _prompts(args, seed=1 if args.path == "offline" else 2)
    warm_prompts = _prompts(args, seed=3)[:2]
    if args.path == "offline":
        from duet.engine.llm_engine import LLMEngine

        engine = LLMEngine(_engine_config(args, model))

        def generate(batch: list[list[int]], p: SamplingParams, tag: str) -> int:
            for i, ids in enumerate(batch):
                engine.add_request(ids, p, f"{tag}{i}")
            n = 0
            while engine.has_unfinished_requests():
                n += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
            return n

        generate(warm_prompts, warm, "w")
        start = time.perf_counter()
        tokens = generate(prompts, params, "r")
        return {"output_tokens": tokens, "seconds": time.perf_counter() - start}

    from duet.engine.async_engine import AsyncEngine

    async def main() -> dict:
        engine = AsyncEngine.from_config(_engine_config(args, model))

        async def one(ids: list[int], p: SamplingParams) -> int:
            n = 0
            async for out in engine.generate(ids, p):
                n = len(out.outputs[0].token_ids)
            return n

        try:
            await asyncio.gather(*(one(ids, warm) for ids in warm_prompts))
            start = time.perf_counter()
            counts = await asyncio.gather(*(one(ids, params) for ids in prompts))
            return {"output_tokens": sum(counts), "seconds": time.perf_counter() - start}
        finally:
            engine.shutdown()

    return asyncio.run(main())


def _thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of `pid`, by thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def run_serve(args: argparse.Namespace, model: Path) -> dict:
    url = f"http://127.0.0.1:{args.port}"
    # `duet serve` as benchmarks.serve.vs_vllm starts it (same flags and environment)
    serve_args = argparse.Namespace(**vars(args), duet_args="")
    with (
        tempfile.TemporaryDirectory(prefix="duet-engine-paths-") as tmp,
        running_server("duet", model, serve_args, Path(tmp)) as (proc, _),
    ):
        before = _thread_cpu_s(proc.pid)
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        window = time.monotonic()
        summary = bench(url, model, args, Path(tmp) / "sat.json",
                        "--rate", "inf", "--num-requests", str(args.num_requests))  # fmt: skip
        after_children = resource.getrusage(resource.RUSAGE_CHILDREN)
        after = _thread_cpu_s(proc.pid)
        window = time.monotonic() - window
    used = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    main_s = used.pop(proc.pid, 0.0)
    client_s = (after_children.ru_utime + after_children.ru_stime) - (
        children.ru_utime + children.ru_stime
    )
    return {
        "output_tokens": summary["num_output_tokens"],
        "seconds": summary["duration_s"],
        "cpu_window_s": window,  # the client's whole run, its two warm-up requests included
        "server_main_thread_cpu_s": main_s,
        "server_other_threads_cpu_s": sum(used.values()),
        "client_cpu_s": client_s,
        "summary": summary,
    }


def table(results: dict[str, dict]) -> str:
    base = results["offline"]["output_tokens"] / results["offline"]["seconds"]
    lines = ["| path | output tok/s | vs offline |", "| --- | ---: | ---: |"]
    for path, r in results.items():
        rate = r["output_tokens"] / r["seconds"]
        lines.append(f"| {path} | {rate:.1f} | {rate / base:.2f}x |")
    s = results["serve"]
    lines.append(
        f"\nduet serve, {s['cpu_window_s']:.1f} s with the client's warm-up: server main "
        f"thread (event loop) "
        f"{s['server_main_thread_cpu_s']:.1f} CPU-s, the server's other threads "
        f"{s['server_other_threads_cpu_s']:.1f} CPU-s, the client {s['client_cpu_s']:.1f} CPU-s"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = export_hf_dir()
    if args.path is not None:  # a child: one in-process path, its result as JSON
        print(json.dumps(run_in_process(args, model)))
        return 0
    results: dict[str, dict] = {}
    for path in PATHS[:2]:
        child = [sys.executable, "-m", "benchmarks.serve.engine_paths", "--path", path,
                 *(argv if argv is not None else sys.argv[1:])]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        done = subprocess.run(child, check=True, capture_output=True, text=True, env=env)
        results[path] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{path}: {results[path]}", flush=True)
    results["serve"] = run_serve(args, model)
    print(table(results))
    write_record(args.out, "serve_engine_paths", args, results, ("engine", "router", "cli"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
