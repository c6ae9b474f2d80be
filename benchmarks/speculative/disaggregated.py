"""Where a disaggregated deployment computes the draft model's prompt KV: on the decode worker
(`draft_prefill: decode`, its shadow catches up with the whole prompt at the first proposal)
against the prefill worker (`draft_prefill: prefill`, prefilled beside the target and shipped in
the same transfer), in one run.

    python -m benchmarks.speculative.disaggregated       # SmolLM2-135M, a 2-layer cut as draft
    python -m benchmarks.speculative.disaggregated --model T --draft D --prompt-lens 64 \\
        --reps 1 --max-tokens 8                          # smoke

Two deployments stay loaded, each a `PrefillWorker` and a `DecodeWorker` in this process (KV
over `--kv-backend` on loopback, tcp on CPU), one per choice, with the same target, draft and
`num_speculative_tokens`. The target defaults to the embedded SmolLM2-135M-Instruct (exported
once to an HF directory) and the draft to its first `--draft-layers` layers
(`truncated_draft.py`). For each prompt length, each rep sends one fresh random prompt through
both deployments, the order alternating between reps, greedy with `--max-tokens` output
tokens, the prefix cache off; the tokens of the two must be identical. Two scenarios:

- alone: the request is the only one;
- beside a decode: the decode worker is already generating another request (a 64-token
  prompt); what the new request's draft prefill costs the running one shows as that one's
  longest gap between outputs while the new request is served, and its tokens/s then.

Per request: TTFT (reserve to the first token out of the decode worker; a draft prefilled on
the decode worker runs in the iteration that streams the first token, so it counts here on
either side), the mean time per output token after the first (TPOT), the end-to-end time and
output tokens/s over it. Medians; ratios are prefill/decode (below 1 for times: the prefill
worker's choice is faster). Results: a table on stdout and
benchmarks/results/speculative_disaggregated.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import secrets
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common.machine import REPO_ROOT, cpu_info, git_commit
from benchmarks.kv.transfer import int_list
from duet.decode_worker.config import DecodeWorkerConfig
from duet.decode_worker.worker import DecodeWorker
from duet.engine import SamplingParams
from duet.prefill_worker.config import PrefillWorkerConfig
from duet.prefill_worker.worker import PrefillWorker

DEFAULT_OUT = REPO_ROOT / "benchmarks/results/speculative_disaggregated.json"
CHOICES = ("decode", "prefill")
BACKGROUND_PROMPT = 64
BACKGROUND_WARM_OUTPUTS = 8  # outputs the running request streams before the new one comes
BACKGROUND_MAX_TOKENS = 4096  # (or the context's room): it is cancelled once the new one is done


class Deployment:
    """One prefill and one decode worker whose draft is prefilled where `choice` says."""

    def __init__(self, choice: str, engine: dict[str, Any], spec: dict[str, Any]) -> None:
        spec = {**spec, "draft_prefill": choice}
        self.choice = choice
        self.prefill = PrefillWorker(
            PrefillWorkerConfig(**engine, speculative_config=spec), name=f"prefill-{choice}"
        )
        self.decode = DecodeWorker(
            DecodeWorkerConfig(**engine, speculative_config=spec), name=f"decode-{choice}"
        )

    async def stream(
        self, request_id: str, prompt: list[int], params: SamplingParams, stamps: list[float]
    ) -> list[int]:
        """What the router does (reserve on decode, prefill towards it, stream from decode);
        appends the time of each output token to `stamps` (an output of several tokens: the
        same time for each). Returns the tokens."""
        remote = await self.decode.reserve(request_id, prompt, params)
        tokens: list[int] = []
        async with remote:
            prefill = asyncio.ensure_future(
                self.prefill.prefill(request_id, prompt, params, remote.reservation.kv_address)
            )
            try:
                async for out in remote:
                    now = time.perf_counter()
                    stamps += [now] * (len(out.token_ids) - len(tokens))
                    tokens = list(out.token_ids)
            finally:
                result = await prefill
        if result.status.value != "done":
            raise RuntimeError(f"{request_id}: {result}")
        return tokens

    def close(self) -> None:
        self.prefill.shutdown()
        self.decode.shutdown()


async def one_request(
    dep: Deployment, request_id: str, prompt: list[int], params: SamplingParams, background: bool
) -> dict[str, Any]:
    """Timings of one request, alone or beside a running one (whose stream is cancelled once
    the request is done)."""
    bg_stamps: list[float] = []
    bg_task = None
    if background:
        engine = dep.decode.engine
        room = min(BACKGROUND_MAX_TOKENS, engine.max_model_len - BACKGROUND_PROMPT)
        bg_params = SamplingParams(max_tokens=room, temperature=0, ignore_eos=True)
        vocab = engine.arch.vocab_size
        bg_prompt = [(7 * i) % (vocab - 10) + 10 for i in range(BACKGROUND_PROMPT)]
        bg_task = asyncio.ensure_future(
            dep.stream(f"{request_id}-bg", bg_prompt, bg_params, bg_stamps)
        )
        while len(bg_stamps) < BACKGROUND_WARM_OUTPUTS:
            if bg_task.done():  # it failed (or ended before the new request came)
                bg_task.result()
                raise RuntimeError("the running request ended before the new one came")
            await asyncio.sleep(0.005)
    stamps: list[float] = []
    start = time.perf_counter()
    tokens = await dep.stream(request_id, prompt, params, stamps)
    end = time.perf_counter()
    row: dict[str, Any] = {
        "ttft_s": stamps[0] - start,
        "tpot_s": (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1),
        "e2e_s": end - start,
        "out_tok_s": len(tokens) / (end - start),
        "tokens": tokens,
    }
    if bg_task is not None:
        bg_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await bg_task
        window = [t for t in bg_stamps if start <= t <= end]
        gaps = [b - a for a, b in zip([start, *window], [*window, end], strict=True)]
        row["bg_max_gap_s"] = max(gaps)
        row["bg_tok_s"] = len(window) / (end - start)
    return row


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


METRICS = ("ttft_s", "tpot_s", "e2e_s", "out_tok_s")
BG_METRICS = ("bg_max_gap_s", "bg_tok_s")


def measure(deps: dict[str, Deployment], args: argparse.Namespace) -> list[dict[str, Any]]:
    vocab = deps["decode"].decode.engine.arch.vocab_size
    gen = torch.Generator().manual_seed(args.seed)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    rows = []
    scenarios = ["alone", "beside a decode"] if args.background else ["alone"]
    for scenario in scenarios:
        for length in args.prompt_lens:
            reps: dict[str, list[dict[str, Any]]] = {c: [] for c in CHOICES}
            same = True
            for rep in range(args.warmup + args.reps):
                prompt = torch.randint(10, vocab, (length,), generator=gen).tolist()
                order = CHOICES if rep % 2 == 0 else CHOICES[::-1]
                got = {}
                for choice in order:
                    request_id = f"{scenario[0]}{length}-{rep}-{choice}"
                    got[choice] = asyncio.run(
                        one_request(deps[choice], request_id, prompt, params, scenario != "alone")
                    )
                same = same and got["decode"]["tokens"] == got["prefill"]["tokens"]
                if rep >= args.warmup:
                    for choice in CHOICES:
                        reps[choice].append({k: v for k, v in got[choice].items() if k != "tokens"})
            row: dict[str, Any] = {"scenario": scenario, "prompt_len": length, "same": same}
            keys = METRICS + (BG_METRICS if scenario != "alone" else ())
            for choice in CHOICES:
                row[choice] = {key: _median(reps[choice], key) for key in keys}
                row[choice]["reps"] = reps[choice]
            row["ratio"] = {key: row["prefill"][key] / row["decode"][key] for key in keys}
            rows.append(row)
            print(format_row(row), flush=True)
    return rows


def format_row(row: dict[str, Any]) -> str:
    d, p, r = row["decode"], row["prefill"], row["ratio"]
    text = (
        f"{row['scenario']:>15} {row['prompt_len']:>6} | TTFT {d['ttft_s'] * 1e3:7.1f} "
        f"{p['ttft_s'] * 1e3:7.1f} ms ({r['ttft_s']:.2f}x) | TPOT {d['tpot_s'] * 1e3:6.1f} "
        f"{p['tpot_s'] * 1e3:6.1f} ms ({r['tpot_s']:.2f}x) | e2e {d['e2e_s']:6.2f} "
        f"{p['e2e_s']:6.2f} s ({r['e2e_s']:.2f}x) | out {d['out_tok_s']:6.1f} "
        f"{p['out_tok_s']:6.1f} tok/s ({r['out_tok_s']:.2f}x)"
    )
    if "bg_max_gap_s" in d:
        text += (
            f" | running: max gap {d['bg_max_gap_s'] * 1e3:7.1f} {p['bg_max_gap_s'] * 1e3:7.1f} "
            f"ms ({r['bg_max_gap_s']:.2f}x), {d['bg_tok_s']:5.1f} {p['bg_tok_s']:5.1f} tok/s "
            f"({r['bg_tok_s']:.2f}x)"
        )
    return text + ("" if row["same"] else " | TOKENS DIFFER")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.speculative.disaggregated",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=None, help="target (default: SmolLM2-135M as HF dir)")
    p.add_argument("--draft", default=None, help="draft (default: --draft-layers of the target)")
    p.add_argument("--draft-layers", type=int, default=2)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--prompt-lens", type=int_list(1, "prompt length"), default=[128, 512, 2048])
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    p.add_argument("--reps", type=int, default=4, help="timed reps per choice and length")
    p.add_argument("--warmup", type=int, default=1, help="untimed reps per choice and length")
    p.add_argument("--no-background", dest="background", action="store_false",
                   help="skip the scenario beside a running decode")  # fmt: skip
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.add_argument("--kv-backend", default="auto", choices=["auto", "tcp", "torch_dist"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    for name in ("reps", "max_tokens", "draft_layers", "num_speculative_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be >= 1; got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup: must be >= 0; got {args.warmup}")
    if args.max_tokens < 2:
        p.error(f"--max-tokens: must be >= 2 (a token after the first); got {args.max_tokens}")
    return args


def resolve_models(args: argparse.Namespace) -> tuple[str, str]:
    """The target and draft paths: the given ones, or SmolLM2 and its first layers."""
    from benchmarks.offline.smollm2_hf import DEFAULT_CACHE_DIR, export_hf_dir
    from benchmarks.speculative.truncated_draft import truncated_draft

    target = args.model or str(export_hf_dir())
    if args.draft is not None:
        return target, args.draft
    out = DEFAULT_CACHE_DIR.parent / f"{Path(target).name}-first{args.draft_layers}"
    return target, str(truncated_draft(Path(target), args.draft_layers, out))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # Both deployments live in this process: a secret of its own proves each KV channel.
    os.environ.setdefault("DUET_CLUSTER_SECRET", "bench-" + secrets.token_hex(24))
    target, draft = resolve_models(args)
    block_size = 16
    longest = max(args.prompt_lens) + args.max_tokens + BACKGROUND_PROMPT + BACKGROUND_MAX_TOKENS
    engine = dict(
        model=target, dtype=args.dtype, load_progress=False, block_size=block_size,
        num_kv_blocks=2 * (-(-longest // block_size)) + 16, enable_prefix_caching=False,
        max_num_batched_tokens=max(2048, max(args.prompt_lens)), num_threads=args.threads,
        kv_backend=args.kv_backend,
    )  # fmt: skip
    spec = {"method": "draft_model", "model": draft,
            "num_speculative_tokens": args.num_speculative_tokens}  # fmt: skip
    deps = {choice: Deployment(choice, engine, spec) for choice in CHOICES}
    try:
        print("scenario prompt | decode prefill (prefill/decode) per metric, medians")
        rows = measure(deps, args)
        first = deps["decode"].decode.engine
        stats = {c: deps[c].decode.engine.stats.spec_decode for c in CHOICES}
        backend = deps["decode"].prefill.kv_backend
    finally:
        for dep in deps.values():
            dep.close()
    result = {
        "benchmark": "speculative_disaggregated",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(
            "engine", "kv_transfer", "prefill_worker", "decode_worker", "benchmarks"
        ),
        "machine": cpu_info(),
        "target": first.model_name if args.model else "SmolLM2-135M-Instruct (HF export)",
        "draft": draft if args.draft else f"the target's first {args.draft_layers} layers",
        "dtype": str(first.dtype).removeprefix("torch."),
        "kv_backend": backend,
        "threads": torch.get_num_threads(),
        "num_speculative_tokens": args.num_speculative_tokens,
        "max_tokens": args.max_tokens,
        "reps": args.reps,
        "acceptance_rate": {c: s.acceptance_rate if s else 0.0 for c, s in stats.items()},
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
