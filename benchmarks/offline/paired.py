"""Paired rounds: duet and a vLLM engine both stay loaded, and their timed calls alternate.

A full offline-throughput run takes ~25 minutes with the systems one after another, and a
2-core VM drifts by +-15% within that (benchmarks/README.md), which then reads as a ratio.
Here each round times one generate of the same workload on each engine, back to back, in
alternating order (duet first in even rounds, vLLM first in odd ones), so slow drift hits
both alike, and the ratio is taken within each round. Both prefix caches are emptied before
every timed call. `python -m benchmarks.offline.throughput --paired-rounds N` runs this.
"""

from __future__ import annotations

import json
import secrets
import statistics
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import Any

from benchmarks.common.cpu_usage import wait_for_idle
from benchmarks.offline.systems import (
    VLLM_RUNNER,
    RunConfig,
    load_duet,
    time_duet,
    vllm_env,
    vllm_job,
)
from benchmarks.offline.workload import Workload

READY_TIMEOUT_S = 900.0  # vLLM's torch.compile load takes minutes on 2 cores
CALL_TIMEOUT_S = 1800.0


@dataclass
class Timed:
    wall_s: float
    cpu: dict[str, float]
    token_ids: list[list[int]]
    counters: dict[str, float] = field(default_factory=dict)
    """duet's: engine steps, and with several ranks rank 0's time in collectives."""


class DuetEngine:
    """duet's `LLM` in this process, loaded once."""

    def __init__(self, workload: Workload, dtype: str, cfg: RunConfig) -> None:
        self.workload = workload
        self.llm, self.load_s, self.warmup_s = load_duet(dtype, cfg)

    def timed(self) -> Timed:
        wall_s, cpu, token_ids, counters = time_duet(self.llm, self.workload)
        return Timed(wall_s, cpu, token_ids, counters)

    def close(self) -> None:
        self.llm.shutdown()  # a tensor-parallel engine's other ranks
        del self.llm


class VllmEngine:
    """`benchmarks/offline/vllm_runner.py` in serve mode under vLLM's own interpreter: loaded once,
    one timed call per `timed()`."""

    def __init__(
        self, workload: Workload, dtype: str, enforce_eager: bool, python: Path, cfg: RunConfig
    ) -> None:
        authkey = secrets.token_bytes(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=authkey)
        self._tmp = tempfile.TemporaryDirectory(prefix="duet-vllm-")
        job_path, self.log_path = Path(self._tmp.name) / "job", Path(self._tmp.name) / "log"
        host, port = self._listener.address
        job = {
            **vllm_job(workload, dtype, enforce_eager, cfg),
            "serve": {"address": [host, port], "authkey": authkey.hex()},
        }
        job_path.write_text(json.dumps(job))
        self._log = self.log_path.open("w")
        self._proc = subprocess.Popen(
            [str(python), str(VLLM_RUNNER), str(job_path)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=vllm_env(cfg),
        )
        self._conn: Connection | None = None
        try:
            self._conn = self._accept(READY_TIMEOUT_S)
            self.info: dict[str, Any] = self._reply(READY_TIMEOUT_S)
        except BaseException:
            self.close()
            raise
        self.load_s, self.warmup_s = self.info["load_s"], self.info["warmup_s"]

    def _accept(self, timeout_s: float) -> Connection:
        """The runner's connection; fails early when the runner exits first. (`accept` has no
        timeout of its own: it runs in a thread, and `close` unblocks it.)"""
        accepted: list[Connection] = []
        thread = threading.Thread(
            target=lambda: accepted.append(self._listener.accept()), daemon=True
        )
        thread.start()
        deadline = time.monotonic() + timeout_s
        while thread.is_alive():
            thread.join(1.0)
            if self._proc.poll() is not None and not accepted:
                raise RuntimeError(f"vllm runner exited:\n{self._log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm runner did not connect in {timeout_s:.0f} s")
        if not accepted:
            raise RuntimeError(f"vllm runner's connection failed:\n{self._log_tail()}")
        return accepted[0]

    def _reply(self, timeout_s: float) -> Any:
        assert self._conn is not None
        if not self._conn.poll(timeout_s):
            raise RuntimeError(f"vllm runner silent for {timeout_s:.0f} s:\n{self._log_tail()}")
        try:
            return self._conn.recv()
        except EOFError:
            raise RuntimeError(f"vllm runner exited:\n{self._log_tail()}") from None

    def _log_tail(self) -> str:
        return "".join(self.log_path.read_text().splitlines(keepends=True)[-30:])

    def timed(self) -> Timed:
        assert self._conn is not None
        self._conn.send("go")
        result = self._reply(CALL_TIMEOUT_S)
        return Timed(result["wall_s"], result["cpu"], result["token_ids"])

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.send("stop")
            except OSError:
                pass
            self._conn.close()
        try:
            self._proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._listener.close()
        self._log.close()
        self._tmp.cleanup()


def round_order(round_index: int, names: list[str]) -> list[str]:
    """Who goes first alternates: `names` in even rounds, reversed in odd ones."""
    return list(names) if round_index % 2 == 0 else list(reversed(names))


def run_rounds(
    engines: dict[str, Any],
    workload: Workload,
    rounds: int,
    idle_wait_s: float = 0.0,
    log: Any = print,
) -> dict[str, Any]:
    """`rounds` rounds of one timed call per engine (the first engine is duet, the second the
    baseline). Per round: output tokens/s of each, the ratio first/second, CPU figures; over
    the rounds: the median, min and max ratio, and whether every call produced the same
    tokens as that engine's first (per engine, and all of them)."""
    names = list(engines)
    first_tokens: dict[str, list[list[int]]] = {}
    consistent = dict.fromkeys(names, True)
    records = []
    for k in range(rounds):
        record: dict[str, Any] = {"order": round_order(k, names)}
        for name in record["order"]:
            if idle_wait_s > 0 and (busy := wait_for_idle(idle_wait_s)) is not None:
                log(f"note: machine still busy ({busy:.2f} cores); going on")
            t = engines[name].timed()
            tok_s = workload.num_output_tokens / t.wall_s
            record[name] = {"wall_s": t.wall_s, "tok_s": tok_s, "cpu": t.cpu, **t.counters}
            consistent[name] &= first_tokens.setdefault(name, t.token_ids) == t.token_ids
            log(
                f"  round {k + 1} {name}: {tok_s:.1f} tok/s "
                f"(other processes {t.cpu['other_cores']:.2f} cores)"
            )
        record["ratio"] = record[names[0]]["tok_s"] / record[names[1]]["tok_s"]
        records.append(record)
    ratios = [r["ratio"] for r in records]
    return {
        "engines": names,
        "rounds": records,
        "median_ratio": statistics.median(ratios),
        "min_ratio": min(ratios),
        "max_ratio": max(ratios),
        "same_tokens_every_round": all(consistent.values()),
        "same_tokens_every_round_by_engine": consistent,
        "token_ids": first_tokens,
    }
