"""KV-transfer throughput: duet's `torch_dist`, `tcp` and `nixl` backends against the raw
limits of gloo and of NIXL, on loopback.

    python -m benchmarks.kv.transfer                     # all layouts, 1/16/256 blocks, 10 reps
    python -m benchmarks.kv.transfer --layouts smollm2-135m-bf16 --reps 5 --backends tcp,nixl

A receiver (decode side) and a sender (prefill side) run in two spawned processes, each with
its own paged cache, as the workers do. Per layout, backend and block count, rep by rep and
alternating
which goes first (so that the shared machine's noise hits both alike):

- duet: from `sender.send(...)` until the receiver's `poll()` reports DONE (the blocks are
  gathered, sent, received and written into the reserved blocks: "done"), and until the
  sender's `poll()` sees the acknowledgement ("ack"). Both poll every 1 ms, as the workers do.
- raw: `dist.send` / `dist.recv` of one contiguous tensor of the same byte size between the
  same two processes (a 2-rank gloo world), buffers allocated and touched beforehand: the
  limit of the transport.
- raw NIXL (where NIXL is installed; `--no-raw-nixl` leaves it out): a NIXL WRITE over UCX of
  one contiguous registered buffer of the same bytes, from the sender's start to the
  receiver seeing its notification (`raw_nixl.py`): the limit of what the `nixl` backend
  rides on (on one host's CPUs: UCX's CMA, one kernel copy).
- copy (`--copy-baseline`; on by default with `--device cuda`): a copy of the same bytes
  between two buffers on the receiver's device, timed in that process. With
  `--device cuda` (both peers' caches on one GPU, nixl over UCX's CUDA IPC: `make gpu-check`
  runs it) this is the device-to-device copy the KV transfer is compared with.

The ratio is raw time / duet time (= duet bytes/s over raw bytes/s); the targets at 256
blocks: torch_dist and tcp >= 0.8 of the gloo send; nixl >= 0.8 of the raw NIXL write, and
faster than tcp in the same run (the `nixl` rows pull, `nixl-push` rows push). Every rep records how many cores other processes used meanwhile, and a
checked rep (the first and the last) verifies that the receiver's blocks hold the sender's
data. Results: a table on stdout and benchmarks/results/kv_transfer.json.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.common.machine import cpu_info, git_commit, write_json
from benchmarks.kv.raw_nixl import nixl_installed
from benchmarks.kv.transfer_measure import (
    NOISY_OTHER_CORES,
    default_pool_blocks,
    measure_layout,
    pool_problem,
)
from benchmarks.kv.transfer_peers import BACKENDS, LAYOUTS, POLL_INTERVAL_S, LayoutSpec
from duet.cli.engine_flags import parse_bytes
from duet.kv_transfer.staging import check_staging_bytes
from duet.kv_transfer.tcp.stripes import MAX_STRIPES

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "benchmarks/results/kv_transfer.json"
TARGET_RATIO = 0.8
TARGET_BLOCKS = 256
DEFAULT_BACKENDS = ("torch_dist", "tcp", "nixl")


def _mem_available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def memory_needed_bytes(spec: LayoutSpec, block_counts: list[int], pool: int) -> int:
    """Both pools, plus per side up to two staging buffers (kept for reuse) and the raw gloo
    and NIXL ones."""
    return 2 * pool * spec.block_bytes + 8 * max(block_counts) * spec.block_bytes


def format_table(layouts: list[dict[str, Any]]) -> str:
    head = (
        f"{'layout':<18} {'backend':<10} {'blocks':>6} {'MB':>8} {'raw GB/s':>9} {'done GB/s':>10} "
        f"{'ratio':>6} {'ack GB/s':>9} {'ratio':>6} {'nixl GB/s':>9} {'ratio':>6} "
        f"{'copy GB/s':>9} {'ratio':>6} {'msgs':>5} "
        f"{'send() ms':>9} {'CPU ms duet/raw':>15} {'load':>5} {'others':>6}"
    )
    lines = [head, "-" * len(head)]
    for layout in layouts:
        for r in layout["results"]:
            nixl = (
                f"{r['raw_nixl_gbps']:>9.2f} {r['ratio_done_nixl']:>6.2f}"
                if r["raw_nixl_gbps"] is not None
                else f"{'-':>9} {'-':>6}"
            )
            copied = (
                f"{r['raw_copy_gbps']:>9.2f} {r['ratio_done_copy']:>6.2f}"
                if r.get("raw_copy_gbps") is not None
                else f"{'-':>9} {'-':>6}"
            )
            lines.append(
                f"{layout['layout']['name']:<18} {layout['backend']:<10} {r['num_blocks']:>6} "
                f"{r['bytes'] / 1e6:>8.2f} "
                f"{r['raw_gbps']:>9.2f} {r['duet_done_gbps']:>10.2f} {r['ratio_done']:>6.2f} "
                f"{r['duet_ack_gbps']:>9.2f} {r['ratio_ack']:>6.2f} {nixl} {copied} {r['chunks']:>5g} "
                f"{r['send_call_s']['median'] * 1e3:>9.1f} "
                f"{r['duet_cpu_s'] * 1e3:>7.1f}/{r['raw_cpu_s'] * 1e3:<7.1f} "
                f"{r['load_avg_before'][0]:>5.2f} "
                f"{r['other_cores_median']:>6.2f}{' busy' if r['busy'] else ''}"
            )
    return "\n".join(lines)


def check_targets(layouts: list[dict[str, Any]]) -> dict[str, bool]:
    """Per measured `layout/backend` at `TARGET_BLOCKS`: whether it met its target. torch_dist
    and tcp: done ratio >= `TARGET_RATIO` against the gloo send; nixl (either mode): against
    the raw NIXL write (not met without one), and more done GB/s than tcp's on the same layout
    where tcp was measured."""
    at_target = {
        (layout["layout"]["name"], layout["backend"]): r
        for layout in layouts
        for r in layout["results"]
        if r["num_blocks"] == TARGET_BLOCKS
    }
    met = {}
    for (name, backend), r in at_target.items():
        if not backend.startswith("nixl"):
            met[f"{name}/{backend}"] = r["ratio_done"] >= TARGET_RATIO
            continue
        ratio = r["ratio_done_nixl"]
        tcp = at_target.get((name, "tcp"))
        faster = tcp is None or r["duet_done_gbps"] > tcp["duet_done_gbps"]
        met[f"{name}/{backend}"] = ratio is not None and ratio >= TARGET_RATIO and faster
    return met


def int_list(minimum: int, what: str) -> Callable[[str], list[int]]:
    """An argparse type: a comma list of integers, each >= `minimum` (`what` names them)."""

    def parse(value: str) -> list[int]:
        try:
            items = [int(v) for v in value.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r}: a comma list of integers") from None
        if not items or any(n < minimum for n in items):
            raise argparse.ArgumentTypeError(f"{value!r}: every {what} must be >= {minimum}")
        return items

    return parse


def _layout_names(value: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in LAYOUTS]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"{value!r}: choose from {', '.join(LAYOUTS)}")
    return items


def _backend_names(value: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items or any(v not in BACKENDS for v in items):
        raise argparse.ArgumentTypeError(f"{value!r}: choose from {', '.join(BACKENDS)}")
    return items


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--layouts", type=_layout_names, default=list(LAYOUTS), help="comma list")
    p.add_argument(
        "--backends",
        type=_backend_names,
        default=None,
        help=f"comma list of {', '.join(BACKENDS)} (nixl-push: nixl writing instead of "
        f"reading; default: {','.join(DEFAULT_BACKENDS)}, nixl where NIXL is installed)",
    )
    p.add_argument(
        "--raw-nixl",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="measure the raw NIXL write beside every backend (default: where NIXL is installed)",
    )
    p.add_argument(
        "--kv-staging-memory",
        type=parse_bytes,
        default=None,
        metavar="BYTES",
        help="both sides' staging pool (torch_dist, tcp; default: the workers' 256 MiB)",
    )
    p.add_argument("--blocks", type=int_list(1, "block count"), default=[1, 16, TARGET_BLOCKS])
    p.add_argument("--reps", type=int, default=10, help="timed reps per size (after warm-up)")
    p.add_argument("--warmup", type=int, default=2, help="untimed reps per size")
    p.add_argument(
        "--pool-blocks", type=int, default=None, help="default: largest + 44; with pool: 4x largest"
    )
    p.add_argument("--poll-interval-ms", type=float, default=POLL_INTERVAL_S * 1e3)
    p.add_argument(
        "--malloc",
        choices=("default", "engine"),
        default="engine",
        help="engine: the glibc settings CPU workers run with (engine/cpu_runtime.py)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads in each peer: 1 gives each of the two processes one of 2 cores",
    )
    p.add_argument(
        "--tcp-stripes",
        type=int,
        default=2,
        help="connections per tcp channel (1: one stream, as before striping)",
    )
    p.add_argument("--idle-wait-s", type=float, default=0.0, help="wait for an idle machine")
    p.add_argument("--timeout-s", type=float, default=60.0, help="per transfer and start-up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--block-order",
        choices=("random", "runs", "pool"),
        default="random",
        help="block ids in no order (random: the worst case), as a fresh pool hands them out "
        "(runs of consecutive ids), or as duet's allocator hands them out after churn (pool)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where both peers' caches live (cuda: two processes on one GPU, nixl only)",
    )
    p.add_argument(
        "--copy-baseline",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="time a copy of the same bytes on --device beside every transfer (default: on "
        "with cuda, where it is the device-to-device copy)",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.copy_baseline is None:
        args.copy_baseline = args.device == "cuda"
    if not 1 <= args.tcp_stripes <= MAX_STRIPES:
        p.error(f"--tcp-stripes: must be in [1, {MAX_STRIPES}]")
    installed = nixl_installed()
    if args.backends is None:
        args.backends = [b for b in DEFAULT_BACKENDS if installed or not b.startswith("nixl")]
    needs_nixl = [b for b in args.backends if b.startswith("nixl")]
    if (needs_nixl or args.raw_nixl) and not installed:
        what = f"--backends {','.join(needs_nixl)}" if needs_nixl else "--raw-nixl"
        p.error(f"{what}: needs NIXL (pip install nixl-cu12, or make install)")
    if args.raw_nixl is None:
        args.raw_nixl = installed
    if args.device == "cuda":
        if not torch.cuda.is_available():
            p.error(f"--device cuda: no CUDA device here (torch {torch.__version__})")
        if cpu_only := [b for b in args.backends if not b.startswith("nixl")]:
            p.error(f"--backends {','.join(cpu_only)}: with --device cuda only nixl and "
                    "nixl-push pair two processes' caches on one GPU")  # fmt: skip
    if args.kv_staging_memory is not None:
        try:
            check_staging_bytes("--kv-staging-memory", args.kv_staging_memory)
        except ValueError as e:
            p.error(str(e))
    for name in ("reps", "warmup", "pool_blocks", "threads"):
        value = getattr(args, name)
        if value is not None and value < (1 if name != "warmup" else 0):
            p.error(f"--{name.replace('_', '-')}: must be >= {1 if name != 'warmup' else 0}")
    if not 0 < args.poll_interval_ms <= 100:
        p.error("--poll-interval-ms: must be in (0, 100]")
    if args.pool_blocks is not None and (
        problem := pool_problem(args.pool_blocks, args.blocks, args.block_order)
    ):
        p.error(problem)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    layouts = []
    for name in args.layouts:
        spec = LAYOUTS[name]
        pool = args.pool_blocks or default_pool_blocks(args.blocks, args.block_order)
        need, have = memory_needed_bytes(spec, args.blocks, pool), _mem_available_bytes()
        if args.device == "cpu" and have is not None and need > 0.8 * have:
            print(f"skipping {name}: needs ~{need / 2**30:.1f} GiB, {have / 2**30:.1f} available")
            continue
        print(
            f"{name}: {spec.block_bytes} bytes per block, pool of {pool} blocks per side",
            flush=True,
        )
        for backend in args.backends:
            layouts.append(
                measure_layout(
                    spec,
                    args.blocks,
                    args.reps,
                    args.warmup,
                    pool_blocks=pool,
                    seed=args.seed,
                    timeout_s=args.timeout_s,
                    poll_interval_s=args.poll_interval_ms / 1e3,
                    engine_malloc=args.malloc == "engine",
                    num_threads=args.threads,
                    idle_wait_s=args.idle_wait_s,
                    backend=backend,
                    block_order=args.block_order,
                    tcp_stripes=args.tcp_stripes,
                    raw_nixl=args.raw_nixl,
                    staging_bytes=args.kv_staging_memory,
                    device=args.device,
                    copy_baseline=args.copy_baseline,
                )
            )
    print()
    print(format_table(layouts))
    target = check_targets(layouts)
    busy = any(r["busy"] for layout in layouts for r in layout["results"])
    print(
        f"\nratio = raw time / duet time (medians); done: blocks written at the receiver, ack: "
        f"the sender saw the acknowledgement; nixl: against the raw NIXL write; msgs: the "
        f"sender's messages per transfer. Targets at {TARGET_BLOCKS} blocks: done ratio >= "
        f"{TARGET_RATIO} (nixl: against the NIXL write, and faster than tcp): "
        f"{target or 'not measured'}"
    )
    if busy:
        print(
            f"WARNING: other processes used > {NOISY_OTHER_CORES} cores during some sizes "
            "('busy'); rerun on a quiet machine before comparing."
        )
    report = {
        "benchmark": "kv_transfer",
        "command": " ".join(["python", "-m", "benchmarks.kv.transfer", *(argv or sys.argv[1:])]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git_commit": git_commit("kv_transfer", "benchmarks"),
        "machine": {"platform": platform.platform(), **cpu_info()},
        "config": {
            "reps": args.reps,
            "warmup": args.warmup,
            "poll_interval_ms": args.poll_interval_ms,
            "malloc": args.malloc,
            "tcp_stripes": args.tcp_stripes,
            "threads": args.threads,
            "timeout_s": args.timeout_s,
            "seed": args.seed,
            "block_order": args.block_order,
            "raw_nixl": args.raw_nixl,
            "kv_staging_bytes": args.kv_staging_memory,
            "device": args.device,
            "device_name": torch.cuda.get_device_name() if args.device == "cuda" else None,
            "copy_baseline": args.copy_baseline,
        },
        "target": {"ratio": TARGET_RATIO, "num_blocks": TARGET_BLOCKS, "met": target},
        "busy": busy,
        "layouts": layouts,
    }
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
