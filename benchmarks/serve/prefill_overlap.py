"""Does starting the prefill call beside the decode worker's reservation cut TTFT?

    python -m benchmarks.serve.prefill_overlap                     # SmolLM2, 64 and 512 tokens
    python -m benchmarks.serve.prefill_overlap --prompt-lens 32 --reps 2 --background 0  # smoke

One `PrefillWorker` and one `DecodeWorker` (the embedded default model unless `--model`; KV
over `--kv-backend` on loopback) serve over gRPC in this process, and two `ClusterEngine`s drive
them, one per `ClusterConfig.prefill_with_reservation`:

- serial: the prefill call starts once the reservation answered (its KV address);
- beside: both calls start at once, the address from the decode worker's load report.

Every prompt goes to the prefill worker (`local_prefill_threshold=0`), whose prefix cache is
off, and each is fresh random tokens. Per prompt length, each rep sends one prompt through each
engine, the order alternating between reps, `max_tokens=2`, greedy; TTFT is from
`ClusterEngine.generate` to its first output with a token. `--background N` runs the
measurement again while N other requests decode on the decode worker (each reservation then
waits for the engine step in progress). The CPU time everything else on the machine used during
each cell is recorded (`other_cores`): on a shared machine, read the ratio, not the times.
Results: a table on stdout and benchmarks/results/prefill_overlap.json.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import secrets
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common.cpu_usage import CpuSnapshot
from benchmarks.common.machine import REPO_ROOT, cpu_info, git_commit
from benchmarks.kv.transfer import int_list
from duet.cluster.config import ClusterConfig
from duet.cluster.engine import ClusterEngine
from duet.decode_worker.config import DecodeWorkerConfig
from duet.decode_worker.server import start_decode_server
from duet.decode_worker.worker import DecodeWorker
from duet.engine import SamplingParams
from duet.prefill_worker.config import PrefillWorkerConfig
from duet.prefill_worker.server import start_prefill_server
from duet.prefill_worker.worker import PrefillWorker

DEFAULT_OUT = REPO_ROOT / "benchmarks/results/prefill_overlap.json"
MODES = ("serial", "beside")
READY_TIMEOUT_S = 60.0
BACKGROUND_PROMPT = 32
BACKGROUND_MAX_TOKENS = 512  # then it starts over, until the cell is measured


async def ttft(engine: ClusterEngine, prompt: list[int]) -> float:
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    first = 0.0
    async for out in engine.generate(prompt, params):
        if not first and out.outputs[0].token_ids:
            first = time.perf_counter()
    return first - start


async def background(engine: ClusterEngine, prompt: list[int], started: asyncio.Event) -> None:
    """One decoding request after another, until cancelled; `started` once the first streams."""
    params = SamplingParams(max_tokens=BACKGROUND_MAX_TOKENS, temperature=0, ignore_eos=True)
    while True:
        async for _ in engine.generate(prompt, params):
            started.set()


async def measure(
    engines: dict[str, ClusterEngine], vocab: int, args: argparse.Namespace
) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    for num_background in args.background:
        events = [asyncio.Event() for _ in range(num_background)]
        tasks = [
            asyncio.create_task(background(engines["serial"], [11 + i] * BACKGROUND_PROMPT, e))
            for i, e in enumerate(events)
        ]
        try:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), READY_TIMEOUT_S)
            for length in args.prompt_lens:
                times: dict[str, list[float]] = {m: [] for m in MODES}
                start_cpu = CpuSnapshot.take(time.process_time())
                start = time.perf_counter()
                for rep in range(args.warmup + args.reps):
                    for mode in MODES if rep % 2 == 0 else MODES[::-1]:
                        prompt = torch.randint(10, vocab, (length,), generator=gen).tolist()
                        got = await ttft(engines[mode], prompt)
                        if rep >= args.warmup:
                            times[mode].append(got)
                wall_s = time.perf_counter() - start
                usage = CpuSnapshot.take(time.process_time()).usage_since(start_cpu, wall_s)
                row: dict[str, Any] = {
                    "background": num_background,
                    "prompt_len": length,
                    **{
                        m: {"median_s": statistics.median(t), "ttft_s": t} for m, t in times.items()
                    },
                    "ratio": statistics.median(times["beside"])
                    / statistics.median(times["serial"]),
                    "paired_ratio": statistics.median(
                        b / s for b, s in zip(times["beside"], times["serial"], strict=True)
                    ),
                    **usage,
                }
                rows.append(row)
                print(format_row(row), flush=True)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return rows


def format_row(row: dict[str, Any]) -> str:
    return (
        f"{row['background']:>10} {row['prompt_len']:>6} | TTFT serial "
        f"{row['serial']['median_s'] * 1e3:7.1f} ms, beside {row['beside']['median_s'] * 1e3:7.1f}"
        f" ms | beside/serial {row['ratio']:.3f} (paired {row['paired_ratio']:.3f}) | others "
        f"{row['other_cores']:.2f} cores, stolen {row['stolen_cores']:.2f}"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.serve.prefill_overlap",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--prompt-lens", type=int_list(1, "prompt length"), default=[64, 512])
    p.add_argument("--background", type=int_list(0, "background requests"), default=[0, 4])
    p.add_argument("--reps", type=int, default=20, help="timed reps per mode and cell")
    p.add_argument("--warmup", type=int, default=2, help="untimed reps per mode and cell")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.add_argument("--kv-backend", default="auto", choices=["auto", "tcp", "torch_dist"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error(f"--reps: must be >= 1; got {args.reps}")
    if args.warmup < 0:
        p.error(f"--warmup: must be >= 0; got {args.warmup}")
    return args


async def run(args: argparse.Namespace) -> dict[str, Any]:
    engine: dict[str, Any] = dict(
        model=args.model, dtype=args.dtype, load_progress=False, num_threads=args.threads,
        kv_backend=args.kv_backend, max_num_batched_tokens=max(2048, max(args.prompt_lens)),
    )  # fmt: skip
    prefill = PrefillWorker(PrefillWorkerConfig(**engine, enable_prefix_caching=False))
    decode = DecodeWorker(DecodeWorkerConfig(**engine))
    servers = []
    engines: dict[str, ClusterEngine] = {}
    try:
        prefill_server, prefill_port = await start_prefill_server(prefill)
        decode_server, decode_port = await start_decode_server(decode)
        servers = [prefill_server, decode_server]
        for mode in MODES:
            config = ClusterConfig(
                local_prefill_threshold=0,
                poll_interval_s=0.2,
                prefill_with_reservation=mode == "beside",
            )
            cluster = engines[mode] = ClusterEngine(args.model, config)
            cluster.pool.set_workers(
                {"p0": f"127.0.0.1:{prefill_port}"}, {"d0": f"127.0.0.1:{decode_port}"}
            )
            await cluster.start()
            if not await cluster.pool.wait_until_ready(READY_TIMEOUT_S):
                raise RuntimeError("the decode worker did not report")
        vocab = prefill.engine.arch.vocab_size
        rows = await measure(engines, vocab, args)
        return {
            "model": prefill.engine.model_name,
            "dtype": str(prefill.engine.dtype).removeprefix("torch."),
            "kv_backend": prefill.kv_backend,
            "rows": rows,
        }
    finally:
        for cluster in engines.values():
            await cluster.stop()
        for server in servers:
            await server.stop(0)
        prefill.shutdown()
        decode.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # Workers and routers live in this process: a secret of its own signs their calls.
    os.environ.setdefault("DUET_CLUSTER_SECRET", "bench-" + secrets.token_hex(24))
    print("background prompt | TTFT medians | ratio (below 1: beside is faster) | machine")
    measured = asyncio.run(run(args))
    result = {
        "benchmark": "prefill_overlap",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": git_commit("cluster", "engine", "prefill_worker", "decode_worker", "benchmarks"),
        "machine": cpu_info(),
        "threads": torch.get_num_threads(),
        "reps": args.reps,
        **measured,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
