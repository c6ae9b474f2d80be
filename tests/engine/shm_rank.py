"""One rank of test_shm_collectives.py: python shm_rank.py RANK WORLD PORT SCENARIO OUT.
Joins a gloo group, makes the group's `LocalCollectives`, and per SCENARIO:
- `sums`: reduces the case tensors (seeded, equal shapes on every rank, this rank's values)
  through it and through gloo, saves both and whether it took each to OUT; then all-gathers
  and broadcasts them, broadcasts a list of objects from rank 0 and gathers one object of
  each rank's to rank 0;
- `dies`: rank 1 exits without reducing, the others reduce and save the error to OUT;
- `late`: rank 1 sleeps 4 s before its call (the others' timeout is 1 s), then exits;
- `off`: saves whether the group made one (DUET_SHM_ALL_REDUCE=0 in the environment)."""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

from duet.engine.shm_collectives import SLOT_BYTES, LocalCollectives
from duet.engine.tp_group import exit_rank

CASES = [  # (name, shape, dtype)
    ("decode rows fp32", (8, 576), torch.float32),
    ("decode rows bf16", (8, 576), torch.bfloat16),
    ("fp16", (3, 100), torch.float16),
    ("chunked fp32", (SLOT_BYTES // 4 * 2 + 7,), torch.float32),  # three calls
    ("chunked bf16", (SLOT_BYTES // 2 + 1,), torch.bfloat16),
    ("empty", (0, 576), torch.float32),
]


def case_tensor(rank: int, index: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * index + rank)
    return (torch.randn(shape, generator=g) * (1 + rank)).to(dtype)


def main() -> int:
    rank, world, port, scenario, out = sys.argv[1:6]
    rank, world = int(rank), int(world)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    local = LocalCollectives.create(dist.group.WORLD, rank, world, timeout_s=1.0)
    if scenario == "off":
        torch.save({"made": local is not None}, out)
        return 0
    assert local is not None
    if scenario == "sums":
        results = {}
        for i, (name, shape, dtype) in enumerate(CASES):
            ours = case_tensor(rank, i, shape, dtype)
            gloo = ours.clone()
            took = local.all_reduce(ours)
            dist.all_reduce(gloo)
            gathered = local.all_gather(case_tensor(rank, i, shape, dtype))
            sent = case_tensor(rank, i, shape, dtype)
            local.broadcast(sent)
            results[name] = {
                "shm": ours, "gloo": gloo, "took": took, "gathered": gathered, "broadcast": sent
            }  # fmt: skip
        strided = case_tensor(rank, 99, (4, 8), torch.float32).t()
        results["strided"] = {
            "took": local.all_reduce(strided), "gathered": local.all_gather(strided),
            "broadcast": local.broadcast(strided),
        }  # fmt: skip
        ids = torch.arange(5, dtype=torch.int64) * (rank + 1)
        results["int64"] = {"took": local.all_reduce(ids), "gathered": local.all_gather(ids)}
        commands = [{"rank": rank, "text": "é" * 70_000}] if rank == 0 else None
        results["objects"] = local.broadcast_object(commands)  # 140 KB: one call
        # reports of different lengths per rank, rank 1's over a slot (1 MiB): chunked
        report = {"rank": rank, "outputs": list(range(rank * 300_000))}
        results["reports"] = local.gather_object(report)
        torch.save(results, out)
        dist.barrier()
        return 0
    if scenario in ("dies", "late") and rank == 1:
        if scenario == "late":
            time.sleep(4.0)
        os._exit(0)  # no teardown: as a killed rank
    start = time.monotonic()
    try:
        local.all_reduce(torch.ones(8, 576))
        error = None
    except RuntimeError as e:
        error = str(e)
    torch.save({"error": error, "seconds": time.monotonic() - start}, out)
    os._exit(0)


if __name__ == "__main__":
    exit_rank(main())
