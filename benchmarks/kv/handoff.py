"""Prefill-to-decode hand-off: layer-wise KV sending against sending whole requests.

    python -m benchmarks.kv.handoff                       # SmolLM2, prompts of 512 and 2048
    python -m benchmarks.kv.handoff --prompt-lens 256 --reps 3

A `PrefillWorker` and a `DecodeWorker` (KV over `--kv-backend` on loopback, as in a
disaggregated deployment; default `auto`: tcp on CPU) run on the embedded default model unless
`--model` names another. Each rep sends
one prompt through both, as the router does (reserve on decode, prefill towards it, stream from
decode), alternating the two ways of sending so that the machine's noise hits both alike:

- layerwise: the transfer opens before the pass that completes the prompt; each layer leaves
  as soon as the pass wrote it; the first token follows as a trailer;
- whole: every layer is gathered and sent after the pass (`kv_layerwise=False`).

Per rep it records the time to the first token streamed by the decode worker (TTFT: prefill +
hand-off) and the hand-off lag: from the prefill worker holding its first token (the pass and
the sampling done) to that token coming out of the decode worker. The lag is what layer-wise
sending shortens; on a CPU it competes with the pass for the same cores. Results: a table on
stdout and benchmarks/results/kv_handoff.json.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common.machine import cpu_info, git_commit
from benchmarks.kv.transfer import int_list
from duet.decode_worker.config import DecodeWorkerConfig
from duet.decode_worker.worker import DecodeWorker
from duet.engine import SamplingParams
from duet.prefill_worker.config import PrefillWorkerConfig
from duet.prefill_worker.worker import PrefillWorker

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "benchmarks/results/kv_handoff.json"
MODES = ("layerwise", "whole")


class Handoff:
    """The two workers, and the moment each request's first token left the prefill side."""

    def __init__(
        self,
        model: str | None,
        dtype: str,
        max_len: int,
        threads: int | None,
        kv_backend: str = "auto",
    ) -> None:
        engine: dict[str, Any] = dict(
            model=model,
            dtype=dtype,
            load_progress=False,
            max_num_batched_tokens=max(2048, max_len),
            num_threads=threads,
            kv_backend=kv_backend,
        )
        self.prefill = PrefillWorker(PrefillWorkerConfig(**engine))
        self.decode = DecodeWorker(DecodeWorkerConfig(**engine))
        self.shipped_at: dict[str, float] = {}
        ship = self.prefill.role.ship

        def timed_ship(done: Any) -> None:
            self.shipped_at[done.request_id] = time.perf_counter()
            ship(done)

        self.prefill.role.ship = timed_ship  # type: ignore[method-assign]

    def set_mode(self, mode: str) -> None:
        """What `kv_layerwise` decides at start-up, switched between reps."""
        self.prefill.engine.prefill_stream = self.prefill.role if mode == "layerwise" else None

    async def request(self, request_id: str, prompt: list[int]) -> dict[str, float]:
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        remote = await self.decode.reserve(request_id, prompt, params)
        first_at = 0.0
        async with remote:
            prefill = asyncio.ensure_future(
                self.prefill.prefill(request_id, prompt, params, remote.reservation.kv_address)
            )
            async for _ in remote:
                first_at = first_at or time.perf_counter()
            result = await prefill
        if result.status.value != "done":
            raise RuntimeError(f"{request_id}: {result}")
        return {
            "ttft_s": first_at - start,
            "handoff_s": first_at - self.shipped_at.pop(request_id),
        }

    def close(self) -> None:
        self.prefill.shutdown()
        self.decode.shutdown()


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure(
    handoff: Handoff, prompt_lens: list[int], reps: int, warmup: int, seed: int
) -> list[dict[str, Any]]:
    vocab = handoff.prefill.engine.arch.vocab_size
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for length in prompt_lens:
        reps_by_mode: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
        for rep in range(warmup + reps):
            order = MODES if rep % 2 == 0 else MODES[::-1]
            for mode in order:
                # a fresh prompt each time: no prefix-cache hit on either side
                prompt = torch.randint(10, vocab, (length,), generator=gen).tolist()
                handoff.set_mode(mode)
                got = asyncio.run(handoff.request(f"{mode}-{length}-{rep}", prompt))
                if rep >= warmup:
                    reps_by_mode[mode].append(got)
        row: dict[str, Any] = {"prompt_len": length}
        for mode in MODES:
            row[mode] = {
                key: _stats([r[key] for r in reps_by_mode[mode]]) for key in ("ttft_s", "handoff_s")
            }
            row[mode]["reps"] = reps_by_mode[mode]
        row["handoff_ratio"] = (
            row["whole"]["handoff_s"]["median"] / row["layerwise"]["handoff_s"]["median"]
        )
        row["ttft_ratio"] = row["whole"]["ttft_s"]["median"] / row["layerwise"]["ttft_s"]["median"]
        rows.append(row)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "prompt | TTFT layerwise | TTFT whole | hand-off layerwise | hand-off whole | "
        "whole/layerwise (hand-off, TTFT)",
    ]
    for row in rows:
        lw, wh = row["layerwise"], row["whole"]
        lines.append(
            f"{row['prompt_len']:>6} | {lw['ttft_s']['median'] * 1e3:>11.1f} ms "
            f"| {wh['ttft_s']['median'] * 1e3:>7.1f} ms "
            f"| {lw['handoff_s']['median'] * 1e3:>15.1f} ms "
            f"| {wh['handoff_s']['median'] * 1e3:>11.1f} ms "
            f"| {row['handoff_ratio']:.2f}x, {row['ttft_ratio']:.2f}x"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--prompt-lens", type=int_list(2, "prompt length"), default=[512, 2048])
    p.add_argument("--reps", type=int, default=6, help="timed reps per mode and length")
    p.add_argument("--warmup", type=int, default=1, help="untimed reps per mode and length")
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    handoff = Handoff(args.model, args.dtype, max(args.prompt_lens), args.threads, args.kv_backend)
    try:
        rows = measure(handoff, args.prompt_lens, args.reps, args.warmup, args.seed)
        dtype = str(handoff.prefill.engine.dtype).removeprefix("torch.")
        model = handoff.prefill.engine.model_name
        backend = handoff.prefill.kv_backend
    finally:
        handoff.close()
    print(f"{model} ({dtype}), KV over {backend}, {args.reps} reps per cell, medians")
    print(format_table(rows))
    result = {
        "benchmark": "kv_handoff",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(
            "engine", "kv_transfer", "prefill_worker", "decode_worker", "benchmarks"
        ),
        "machine": cpu_info(),
        "model": model,
        "dtype": dtype,
        "kv_backend": backend,
        "threads": torch.get_num_threads(),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
