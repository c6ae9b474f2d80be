"""Tensor-parallel worker groups as processes on loopback (`python -m duet.prefill_worker` or
`duet.decode_worker`, one per rank, gloo between them) for the disaggregated TP tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

from tests.net import free_port


@dataclass
class Group:
    """A worker's ranks: rank 0 serves gRPC at `address`."""

    role: str
    procs: list[subprocess.Popen[str]]
    address: str = ""
    output: list[str] = field(default_factory=list)  # rank 0's lines up to DUET_READY

    def stop(self) -> None:
        """SIGTERM to rank 0, which stops the others (its Stop); any rank still running after
        30 s is killed."""
        if self.procs[0].poll() is None:
            self.procs[0].terminate()
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)


def start_groups(*specs: tuple[str, dict[str, Any], int, str]) -> list[Group]:
    """Start every (role, config, tp, name) worker's ranks at once (their model loads overlap)
    and wait for each rank 0 to serve (bounded by the ranks' model load: rank 0 prints its
    address once every rank joined). Raises AssertionError with rank 0's output when it exits
    first; every group started is stopped then."""
    groups = [_launch(*spec) for spec in specs]
    try:
        for group in groups:
            _wait_ready(group)
    except BaseException:
        for group in groups:
            group.stop()
        raise
    return groups


def _launch(role: str, config: dict[str, Any], tp: int, name: str) -> Group:
    init = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    body = json.dumps({**config, "tensor_parallel_size": tp})
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", f"duet.{role}_worker", "--config", body, "--name", name,
             "--tp-rank", str(rank), "--tp-init-method", init],
            env=env, stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
            stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(tp)
    ]  # fmt: skip
    return Group(role, procs)


def _wait_ready(group: Group) -> None:
    stdout = group.procs[0].stdout
    assert stdout is not None
    for line in stdout:  # ends when rank 0 exits
        group.output.append(line)
        if line.startswith("DUET_READY "):
            group.address = line.split()[1]
            return
    raise AssertionError(f"{group.role} rank 0 exited before serving:\n{''.join(group.output)}")
