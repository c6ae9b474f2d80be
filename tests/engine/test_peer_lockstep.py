"""Data-parallel peers (engine/peer_lockstep.py): two independent engines, each taking its own
requests, exchanging a Qwen3-MoE's experts. Each gives the tokens one engine holding every
expert gives (bf16: the exchange keeps one rank's bits), while the other rank idles or is
busy; one peer's shutdown stops the other at once."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from duet.engine import LLM, SamplingParams
from tests.engine.peer_rank import NEW_TOKENS, PROMPTS
from tests.net import free_port

SCRIPT = Path(__file__).with_name("peer_rank.py")
ROOT = Path(__file__).parents[2]


def run_peers(model: str, tmp_path: Path, scenario: str) -> list[dict]:
    port = free_port()
    outs = [tmp_path / f"peer{r}.pt" for r in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), model, str(r), str(port), str(outs[r]), scenario],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        for r in range(2)
    ]
    codes = [p.wait(timeout=240) for p in procs]
    assert codes == [0, -signal.SIGKILL if scenario == "kill" else 0]
    return [torch.load(o) if o.exists() else {} for o in outs]


def test_two_peers_each_serving_its_own_requests_give_one_engines_tokens(
    tiny_model_factory, tmp_path
):
    model = tiny_model_factory("qwen3_moe")
    peers = run_peers(model, tmp_path, "serve")
    llm = LLM(model, dtype="bfloat16", num_kv_blocks=64, load_progress=False)
    for rank, got in enumerate(peers):
        assert got["shared memory"]
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                  for n in NEW_TOKENS[rank]]  # fmt: skip
        want = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS[rank], params)]
        assert got["tokens"] == want, rank


def test_one_peer_stopping_stops_the_other(tiny_model_factory, tmp_path):
    model = tiny_model_factory("qwen3_moe")
    survivor, _ = run_peers(model, tmp_path, "stop")
    assert survivor["error"] == "EngineDeadError: peer0 stopped with a data-parallel peer"
    assert survivor["running"] is False
    assert survivor["seconds"] < 30  # at once, not after a collective's timeout


@pytest.mark.parametrize(
    ("shm", "says"),
    [
        ("1", r"shared-memory collective: rank 1 \(pid \d+\) is gone"),
        ("0", r"Connection (reset|closed) by peer"),
    ],  # gloo says either, by timing
)
def test_a_peer_killed_ends_the_others_stream_with_an_error_at_once(
    tiny_model_factory, tmp_path, monkeypatch, shm, says
):
    """A peer's process killed outright (no `Stop` to agree on): the other's next exchange
    fails on the dead rank, through shared memory (the waited-for pid is gone) or over gloo
    (the connection is reset or closed), instead of waiting out the group timeout (600 s); its stream
    ends with the engine's death and its engine stops (a served worker then exits, and the
    router retries its requests elsewhere)."""
    monkeypatch.setenv("DUET_SHM_COLLECTIVES", shm)
    model = tiny_model_factory("qwen3_moe")
    survivor, _ = run_peers(model, tmp_path, "kill")
    assert survivor["shared memory"] == (shm == "1")
    assert survivor["error"].startswith("EngineDeadError: ")
    assert re.search(says, survivor["error"]), survivor["error"]
    assert survivor["running"] is False
    assert survivor["seconds"] < 30
