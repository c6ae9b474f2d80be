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


def start_group(role: str, config: dict[str, Any], tp: int, name: str) -> Group:
    """Start the `tp` ranks of a `role` ("prefill" or "decode") worker and wait (bounded by
    each rank's model load: rank 0 prints its address once every rank joined) for rank 0 to
    serve. Raises AssertionError with rank 0's output when it exits first."""
    init = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    body = json.dumps({**config, "tensor_parallel_size": tp})
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                f"duet.{role}_worker",
                "--config",
                body,
                "--name",
                name,
                "--tp-rank",
                str(rank),
                "--tp-init-method",
                init,
            ],
            env=env,
            stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(tp)
    ]
    group = Group(role, procs)
    assert procs[0].stdout is not None
    for line in procs[0].stdout:  # ends when rank 0 exits
        group.output.append(line)
        if line.startswith("DUET_READY "):
            group.address = line.split()[1]
            return group
    group.stop()
    raise AssertionError(f"{role} rank 0 exited before serving:\n{''.join(group.output)}")
