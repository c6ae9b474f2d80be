"""`make gpu-check`'s one-device disaggregated step: a prefill worker and a decode worker as
plain processes (`python -m duet.prefill_worker`, `python -m duet.decode_worker`; no Ray) on
the same device, KV between them over the KV backend named by the check's `--kv-backend`, the
control plane's `ClusterEngine` (cluster/engine.py) in this process sending every prompt
through the prefill worker; greedy tokens of 16 prompts against the aggregated engine's on the
same dummy weights.

Which backend can move KV between two processes' caches on one GPU: `nixl` (kv_transfer/nixl/,
UCX's CUDA IPC), the default; not `torch_dist` (NCCL refuses two ranks of one communicator on
one device), not `tcp` (CPU caches only), not `local` (one process). Where a backend cannot run
(or is not installed) the step reports itself skipped with the reason. On the CPU the same
step runs over `tcp` and `nixl` (the tests)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_check.processes import Child, StepTimeout, child_env, run_bounded

DEFAULT_BACKEND = "nixl"
ONE_DEVICE_NOTE = (
    "only the nixl backend (kv_transfer/nixl/, UCX's CUDA IPC) moves CUDA KV between two "
    "processes on one device: torch_dist's NCCL refuses two ranks of one communicator on one "
    "GPU, tcp takes CPU caches only, local is in-process"
)


def backend_unavailable(backend: str, device: torch.device) -> str | None:
    """Why the step cannot run with `backend` on `device` (None: it can)."""
    from duet.kv_transfer.factory import available_backends

    if backend not in available_backends():
        return f"kv backend {backend!r} is not registered here ({', '.join(available_backends())}); {ONE_DEVICE_NOTE}"
    if device.type == "cuda" and backend in ("torch_dist", "tcp", "local"):
        return f"kv backend {backend!r} cannot pair two processes on one GPU: {ONE_DEVICE_NOTE}"
    return None


def prompts(num: int, vocab_size: int, seed: int = 7) -> list[list[int]]:
    """`num` prompts of 20 to 300 random token ids (a mix of one-chunk and longer prefills)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(20, 300, (num,), generator=g).tolist()
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]


def run_disaggregated(
    model: Path,
    engine: dict[str, Any],
    backend: str,
    workdir: Path,
    deadline: float,
    num_prompts: int = 16,
    max_tokens: int = 16,
    bandwidth_blocks: tuple[int, ...] = (),
) -> dict[str, Any]:
    """The step; `model` is a folder with config.json and tokenizer.json (dummy weights),
    `engine` the EngineConfig fields both workers and the aggregated reference share. With
    `bandwidth_blocks` and the nixl backend, once the tokens are checked: `kv_bandwidth`."""
    from duet.engine import LLM, SamplingParams

    device = torch.device(engine.get("device", "cuda"))
    reason = backend_unavailable(backend, device)
    report: dict[str, Any] = {"kv_backend": backend, "engine": engine}
    if reason is not None:
        return {**report, "outcome": "skipped", "detail": reason}
    config = json.loads((model / "config.json").read_text())
    batch = prompts(num_prompts, int(config["vocab_size"]))
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    started = time.monotonic()
    reference = LLM(str(model), load_format="dummy", load_progress=False, **engine)
    want = [list(o.outputs[0].token_ids) for o in reference.generate(batch, greedy)]
    del reference
    if device.type == "cuda":
        torch.cuda.empty_cache()
    report["aggregated_s"] = time.monotonic() - started
    workers: dict[str, Child] = {}
    try:
        fields = {"model": str(model), "load_format": "dummy", "load_progress": False,
                  "kv_backend": backend, **engine}  # fmt: skip
        for kind in ("prefill", "decode"):
            workers[kind] = Child(
                ["-m", f"duet.{kind}_worker", "--config", json.dumps(fields), "--name", kind],
                workdir / f"{kind}_worker.log",
            )
        addresses = {
            kind: w.wait_for_line(r"DUET_READY (\S+)", deadline)[1] for kind, w in workers.items()
        }
        report["workers_ready_s"] = time.monotonic() - started - report["aggregated_s"]
        got, transfers = asyncio.run(
            _through_workers(model, addresses, batch, greedy, deadline - time.monotonic())
        )
    finally:
        report["worker_exit_codes"] = {kind: w.stop() for kind, w in workers.items()}
        report["worker_log_tails"] = {kind: w.tail(1500) for kind, w in workers.items()}
    equal = [g == w for g, w in zip(got, want, strict=True)]
    first_diff = next((i for i, same in enumerate(equal) if not same), None)
    if bandwidth_blocks and backend == "nixl":
        report["kv_bandwidth"] = kv_bandwidth(workdir, deadline, device, bandwidth_blocks)
    return {
        **report,
        "outcome": "passed" if all(equal) and transfers.get("done") == num_prompts else "failed",
        "num_prompts": num_prompts,
        "num_equal": sum(equal),
        "transfers": transfers,
        "first_difference": None if first_diff is None else {
            "prompt": first_diff, "aggregated": want[first_diff], "disaggregated": got[first_diff]
        },
    }  # fmt: skip


BANDWIDTH_LAYOUT = "llama3-8b-bf16"  # benchmarks/kv/transfer_peers.py: 2 MiB per block


def kv_bandwidth(
    workdir: Path, deadline: float, device: torch.device, blocks: tuple[int, ...]
) -> dict[str, Any]:
    """`benchmarks.kv.transfer` on `device` (two processes, each with a Llama-3.1-8B-shaped
    cache there), nixl pulling and pushing `blocks` blocks against a copy of the same bytes on
    the device (on a GPU: device to device) and a raw NIXL write: GB/s per backend and size,
    and the data paths UCX chose (`UCX_PROTO_INFO`: `benchmarks/kv/ucx_protocols.py`; on the
    H200 a pull ran at 0.07 GB/s, #42). Block ids in no order first (64 descriptors a block:
    the worst case, as measured on 2026-11-30), then, with the time left, the most blocks as
    the engine's allocator hands them out after churn (`--block-order pool`: a few runs of
    consecutive ids, 64 descriptors each), which separates what each descriptor costs the
    transport from what its bytes do. Cut off by `deadline`, an order reports the timeout
    instead, with the data paths chosen by then."""
    report: dict[str, Any] = {"outcome": "measured", "layout": BANDWIDTH_LAYOUT, "rows": []}
    for order, sizes in (("random", blocks), ("pool", blocks[-1:])):
        got = _bandwidth_rows(workdir, deadline, device, sizes, order)
        report["rows"] += got.pop("rows", [])
        report.setdefault("ucx_data_paths", got.pop("ucx_data_paths"))
        if got["outcome"] != "measured":
            report["outcome" if order == "random" else f"{order}_outcome"] = got["outcome"]
            report.update({k: v for k, v in got.items() if k != "outcome"})
            break
    return report


def _bandwidth_rows(
    workdir: Path, deadline: float, device: torch.device, blocks: tuple[int, ...], order: str
) -> dict[str, Any]:
    out = workdir / f"kv_transfer_{order}.json"
    log = workdir / f"kv_transfer_{order}.log"
    args = ["-m", "benchmarks.kv.transfer", "--device", device.type, "--copy-baseline",
            "--layouts", BANDWIDTH_LAYOUT, "--backends", "nixl,nixl-push",
            "--blocks", ",".join(map(str, blocks)), "--block-order", order,
            "--reps", "3", "--warmup", "1", "--out", str(out)]  # fmt: skip
    try:
        code = run_bounded(args, deadline, log, child_env({"UCX_PROTO_INFO": "y"}))
    except StepTimeout as e:
        return {"outcome": "timed_out", "detail": str(e)[-1500:], "ucx_data_paths": _paths(log)}
    if code != 0 or not out.exists():
        return {"outcome": "failed", "exit_code": code, "ucx_data_paths": _paths(log)}
    rows = [
        {"backend": layout["backend"], "block_order": order, "blocks": r["num_blocks"],
         "bytes": r["bytes"], "nixl_gbs": r["duet_done_gbps"], "copy_gbs": r["raw_copy_gbps"],
         "of_copy": r["ratio_done_copy"], "raw_nixl_gbs": r["raw_nixl_gbps"]}
        for layout in json.loads(out.read_text())["layouts"]
        for r in layout["results"]
    ]  # fmt: skip
    return {"outcome": "measured", "rows": rows, "ucx_data_paths": _paths(log)}


def _paths(log: Path) -> list[dict[str, Any]]:
    from benchmarks.kv.ucx_protocols import data_paths

    return data_paths(log.read_text(errors="replace")) if log.exists() else []


async def _through_workers(
    model: Path,
    addresses: dict[str, str],
    batch: list[list[int]],
    greedy: Any,
    timeout_s: float,
) -> tuple[list[list[int]], dict[str, int]]:
    """Every prompt through the router's cluster engine, prefilled remotely (threshold 0)."""
    from duet.cluster.config import ClusterConfig
    from duet.cluster.engine import ClusterEngine

    cluster = ClusterEngine(
        str(model), ClusterConfig(local_prefill_threshold=0, poll_interval_s=0.05)
    )
    cluster.pool.set_workers({"prefill": addresses["prefill"]}, {"decode": addresses["decode"]})
    await cluster.start()
    try:
        if not await cluster.pool.wait_until_ready(max(1.0, min(30.0, timeout_s))):
            raise StepTimeout("the router saw no healthy decode worker")
        # With no healthy prefill worker the router would prefill on the decode worker.
        ready_by = time.monotonic() + min(30.0, timeout_s)
        while not cluster.pool.healthy_prefill():
            if time.monotonic() > ready_by:
                raise StepTimeout("the router saw no healthy prefill worker")
            await asyncio.sleep(0.05)

        async def run(prompt: list[int]) -> list[int]:
            last = None
            async for out in cluster.generate(prompt, greedy):
                last = out
            assert last is not None
            return list(last.outputs[0].token_ids)

        got = await asyncio.wait_for(asyncio.gather(*(run(p) for p in batch)), timeout_s)
        return got, dict(cluster.transfers.num_transfers)
    finally:
        await cluster.stop()
