"""Child processes of `make gpu-check`: started with their output in a log file, waited for
with a deadline, stopped with SIGTERM and then SIGKILL. Every wait here is bounded."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STOP_GRACE_S = 20.0
"""How long a child may take to stop after SIGTERM before it is killed."""


class StepTimeout(Exception):
    """A step ran out of its share of the check's time."""


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a child that imports this tree's duet: the tree first on
    PYTHONPATH, never the Triton interpreter (it would run the "GPU" kernels on the CPU), and
    the cluster secret every worker and router needs (made here once if unset)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if "DUET_CLUSTER_SECRET" not in os.environ:
        os.environ["DUET_CLUSTER_SECRET"] = "gpu-check-" + os.urandom(24).hex()
    env["DUET_CLUSTER_SECRET"] = os.environ["DUET_CLUSTER_SECRET"]
    return {**env, **(extra or {})}


class Child:
    """A child process writing stdout and stderr to `log` (one file: the order is kept)."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.log = log
        self._file = open(log, "wb")  # closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, *args], cwd=ROOT, env=env or child_env(),
            stdout=self._file, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self, num_chars: int = 3000) -> str:
        return self.text()[-num_chars:]

    def wait_for_line(self, pattern: str, deadline: float) -> re.Match[str]:
        """The first match of `pattern` in the log, polled until `deadline` (monotonic);
        raises `StepTimeout`, or RuntimeError if the child exits first."""
        regex = re.compile(pattern)
        while True:
            match = regex.search(self.text())
            if match is not None:
                return match
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.args[:2]} exited with {self.proc.returncode} before logging "
                    f"{pattern!r}:\n{self.tail()}"
                )
            if time.monotonic() > deadline:
                raise StepTimeout(f"no {pattern!r} from {self.args[:2]} in time:\n{self.tail()}")
            time.sleep(0.2)

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after `STOP_GRACE_S`; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=STOP_GRACE_S)
        self._file.close()
        return self.proc.returncode


def run_bounded(
    args: list[str], deadline: float, log: Path, env: dict[str, str] | None = None
) -> int:
    """Run `python args...` to completion or `deadline`: at the deadline SIGINT (pytest then
    still writes its report), then SIGKILL after `STOP_GRACE_S`. Returns the exit code; raises
    `StepTimeout` when the deadline cut it short."""
    child = Child(args, log, env)
    try:
        child.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        child.proc.send_signal(signal.SIGINT)
        try:
            child.proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait(timeout=STOP_GRACE_S)
        child.stop()
        raise StepTimeout(f"{args[:3]} ran past its deadline:\n{child.tail()}") from None
    return child.stop() or 0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no socket held a moment ago (released before it is used,
    so another process may take it first: fine for one check on a machine of its own)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
