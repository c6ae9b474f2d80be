"""The shared-memory collectives of CPU tensor-parallel ranks on one machine
(engine/shm_collectives.py): at two ranks every all-reduce equals gloo's bit for bit (fp32,
bf16, fp16, tensors chunked over several calls, an empty one); at three, every rank holds the
same bits, the sum in rank order; all-gathers stack every rank's tensor in rank order, and
broadcasts give rank 0's tensor or objects to all; a rank that is gone or late fails the call
within its timeout; tensors it does not take are left to gloo; `DUET_SHM_COLLECTIVES=0` keeps
gloo; no segment is left in /dev/shm."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.engine.shm_rank import CASES, case_tensor
from tests.net import free_port

SCRIPT = Path(__file__).with_name("shm_rank.py")
ROOT = Path(__file__).parents[2]


def run_ranks(world: int, scenario: str, tmp_path: Path, **env: str) -> list[dict]:
    port = free_port()
    outs = [tmp_path / f"rank{r}.pt" for r in range(world)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), str(r), str(world), str(port), scenario, str(outs[r])],
            env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        )
        for r in range(world)
    ]
    for p in procs:
        assert p.wait(timeout=120) == 0
    return [torch.load(o) if o.exists() else {} for o in outs]


def segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("duet-tp-*")}


def test_two_ranks_sum_as_gloo_does(tmp_path: Path) -> None:
    before = segments()
    results = run_ranks(2, "sums", tmp_path)
    for i, (name, shape, dtype) in enumerate(CASES):
        for r in results:
            assert r[name]["took"], name
            assert r[name]["shm"].dtype == dtype and r[name]["shm"].shape == shape
            assert torch.equal(r[name]["shm"], r[name]["gloo"]), name
        # and the sum itself: one add in the type (widened, added, rounded)
        a, b = (case_tensor(r, i, shape, dtype) for r in range(2))
        assert torch.equal(results[0][name]["shm"], (a.float() + b.float()).to(dtype)), name
    for r in results:
        strided = r["strided"]
        assert (strided["took"], strided["gathered"], strided["broadcast"]) == (False, None, False)
        assert not r["int64"]["took"]  # not summed here; gathered as bytes
        assert torch.equal(r["int64"]["gathered"], torch.arange(5)[None] * torch.tensor([[1], [2]]))
        assert r["objects"] == [{"rank": 0, "text": "é" * 70_000}]
    assert results[0]["reports"] == [{"rank": r, "outputs": list(range(r * 300_000))}
                                     for r in range(2)]  # fmt: skip
    assert results[1]["reports"] is None  # gathered to rank 0 only
    assert segments() == before


def test_three_ranks_hold_the_same_bits(tmp_path: Path) -> None:
    results = run_ranks(3, "sums", tmp_path)
    for i, (name, shape, dtype) in enumerate(CASES):
        want = case_tensor(0, i, shape, dtype)
        for r in (1, 2):  # in rank order, rounded to the type after each add
            want = (want.float() + case_tensor(r, i, shape, dtype).float()).to(dtype)
        every = torch.stack([case_tensor(r, i, shape, dtype) for r in range(3)])
        for r in results:
            assert torch.equal(r[name]["shm"], want), name
            assert torch.equal(r[name]["gathered"], every), name
            assert torch.equal(r[name]["broadcast"], every[0]), name


@pytest.mark.parametrize("scenario", ["dies", "late"])
def test_a_missing_rank_fails_the_call(scenario: str, tmp_path: Path) -> None:
    results = run_ranks(2, scenario, tmp_path)
    error, seconds = results[0]["error"], results[0]["seconds"]
    if scenario == "dies":
        assert error.startswith("shared-memory collective: rank 1 (pid ") and error.endswith(
            ") is gone"
        ), error
        assert seconds < 1.0  # before the timeout
    else:
        assert error.startswith("shared-memory collective: rank 1 did not arrive in 1 s")
        assert 1.0 <= seconds < 3.0


def test_the_setting_keeps_gloo(tmp_path: Path) -> None:
    results = run_ranks(2, "off", tmp_path, DUET_SHM_COLLECTIVES="0")
    assert [r["made"] for r in results] == [False, False]
