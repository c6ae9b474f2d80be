"""`python -m benchmarks.serve.soak`: a long run of `duet serve --disaggregated --decode-workers 2`
under Poisson load with faults, counting what was lost or repeated (issue 47). Not a test.

The run: Redis (a `redis-server` child, AOF on) under the sessions and the work queue; the
server; its saturation measured first (closed loop, `--concurrency` streams for a while), then
`--minutes` of Poisson arrivals at `--load` of it (streamed completions, each with its own
id), while a Batch API job of `--batch-lines` lines runs through it all. Every `--kill-every`
minutes one decode worker process is killed (SIGKILL; Ray's supervision restarts it); once, at
`--redis-restart-at` minutes, Redis is stopped and started again. Only processes this script
started (and their descendants) are signalled.

Reported (JSON, and a plot with `--plot`): requests sent, completed, failed by cause,
duplicated (a stream with more than one finish or `[DONE]`: must be 0), lost (sent, neither
completed nor failed by the end: must be 0), p99 latency per minute, memory (RSS) per process
per minute, and the batch's line counts (each custom_id exactly once in its output)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx2
import psutil

from benchmarks.serve.soak_report import Outcome, Report, plot, read_stream

RESULTS = Path(__file__).resolve().parents[1] / "results"


async def one_request(client: httpx2.AsyncClient, body: dict[str, Any], outcome: Outcome,
                      start: float, timeout_s: float) -> None:  # fmt: skip
    try:
        async with client.stream("POST", "/v1/completions", json=body, timeout=timeout_s) as r:
            if r.status_code != 200:
                await r.aread()
                outcome.status, outcome.cause = "failed", f"http {r.status_code}"
                return
            lines = [line async for line in r.aiter_lines()]
        read_stream(lines, outcome)
        if outcome.status == "pending":
            outcome.status = "completed" if outcome.num_finishes else "failed"
            outcome.cause = "" if outcome.num_finishes else "no finish"
    except httpx2.HTTPError as e:
        outcome.status, outcome.cause = "failed", type(e).__name__
    finally:
        outcome.ended_s = time.monotonic() - start


def completion_body(rng: random.Random, vocab: int, max_tokens: int) -> dict[str, Any]:
    prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(16, 256))]
    return {"prompt": prompt, "max_tokens": rng.randint(8, max_tokens),
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip


async def saturation(url: str, concurrency: int, seconds: float, vocab: int,
                     max_tokens: int) -> float:  # fmt: skip
    """Requests per second with `concurrency` streams back to back for `seconds`."""
    rng = random.Random(1)
    done = 0
    start = time.monotonic()
    async with httpx2.AsyncClient(base_url=url) as client:

        async def loop() -> None:
            nonlocal done
            while time.monotonic() - start < seconds:
                o = Outcome(0.0)
                await one_request(client, completion_body(rng, vocab, max_tokens), o, start, 300)
                done += o.status == "completed"

        await asyncio.gather(*(loop() for _ in range(concurrency)))
    return done / (time.monotonic() - start)


async def poisson_load(url: str, rate: float, minutes: float, vocab: int, max_tokens: int,
                       report: Report, timeout_s: float) -> None:  # fmt: skip
    rng = random.Random(7)
    start = time.monotonic()
    tasks = []
    async with httpx2.AsyncClient(base_url=url) as client:
        while (now := time.monotonic() - start) < minutes * 60:
            outcome = Outcome(now)
            report.outcomes.append(outcome)
            body = completion_body(rng, vocab, max_tokens)
            tasks.append(asyncio.create_task(one_request(client, body, outcome, start, timeout_s)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.wait(tasks, timeout=timeout_s + 30)  # what is still pending is lost


def descendants(root: psutil.Process) -> list[psutil.Process]:
    try:
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def decode_worker(root: psutil.Process) -> psutil.Process | None:
    """One decode worker process among `root`'s descendants (a Ray actor's title names it)."""
    for proc in descendants(root):
        try:
            if "DecodeRankActor" in " ".join(proc.cmdline()):
                return proc
        except psutil.Error:
            continue
    return None


def sample_memory(roots: dict[str, psutil.Process]) -> dict[str, float]:
    rss: dict[str, float] = {}
    for name, root in roots.items():
        for proc in descendants(root):
            try:
                title = " ".join(proc.cmdline())[:60] or proc.name()
                rss[f"{name}:{proc.pid}:{title}"] = proc.memory_info().rss / 2**20
            except psutil.Error:
                continue
    return rss


class Redis:
    def __init__(self, folder: Path, port: int) -> None:
        self.folder, self.port = folder, port
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.folder), "--appendonly", "yes", "--save", ""]  # fmt: skip
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, start_new_session=True)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve.soak", description=__doc__)
    p.add_argument("--model", default=None, help="model dir (default: the embedded one)")
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--load", type=float, default=0.7, help="fraction of measured saturation")
    p.add_argument("--kill-every", type=float, default=4.0, help="minutes; 0: no kills")
    p.add_argument("--redis-restart-at", type=float, default=10.0, help="minute; <0: never")
    p.add_argument("--aggregated", action="store_true", help="plain duet serve (smoke tests)")
    p.add_argument("--no-redis", action="store_true", help="SQLite instead (smoke tests)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--saturation-s", type=float, default=60.0)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--vocab", type=int, default=49152, help="prompt ids are drawn below it")
    p.add_argument("--batch-lines", type=int, default=200)
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--port", type=int, default=18800)
    p.add_argument("--grpc-port", type=int, default=18801)
    p.add_argument("--redis-port", type=int, default=18802)
    p.add_argument("--out", type=Path, default=RESULTS / "soak.json")
    p.add_argument("--plot", action="store_true")
    return p.parse_args(argv)


async def start_batch(url: str, lines: int, vocab: int) -> str:
    rng = random.Random(3)
    jsonl = "\n".join(
        json.dumps(
            {
                "custom_id": f"line-{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {**completion_body(rng, vocab, 16), "stream": False},
            }
        )
        for i in range(lines)
    )
    async with httpx2.AsyncClient(base_url=url, timeout=60) as client:
        files = {"file": ("soak.jsonl", jsonl.encode(), "application/jsonl")}
        uploaded = await client.post("/v1/files", data={"purpose": "batch"}, files=files)
        uploaded.raise_for_status()
        batch = await client.post("/v1/batches", json={"input_file_id": uploaded.json()["id"],
                                  "endpoint": "/v1/completions", "completion_window": "24h"})  # fmt: skip
        batch.raise_for_status()
        return str(batch.json()["id"])


async def finish_batch(url: str, batch_id: str, lines: int, wait_s: float) -> dict[str, Any]:
    """The batch once it ends (or after `wait_s`): its counts, and each custom_id's number of
    result lines (exactly one each, or it lost or repeated one)."""
    async with httpx2.AsyncClient(base_url=url, timeout=60) as client:
        deadline = time.monotonic() + wait_s
        while True:
            batch = (await client.get(f"/v1/batches/{batch_id}")).json()
            if batch["status"] in ("completed", "failed", "expired", "cancelled"):
                break
            if time.monotonic() > deadline:
                return {"status": batch["status"], "request_counts": batch["request_counts"]}
            await asyncio.sleep(2)
        seen: Counter[str] = Counter()
        for key in ("output_file_id", "error_file_id"):
            if batch.get(key):
                text = (await client.get(f"/v1/files/{batch[key]}/content")).text
                seen.update(json.loads(line)["custom_id"] for line in text.splitlines() if line)
    expected = {f"line-{i}" for i in range(lines)}
    return {
        "status": batch["status"],
        "request_counts": batch["request_counts"],
        "duplicated": sum(n > 1 for n in seen.values()),
        "lost": len(expected - set(seen)),
    }


async def faults(server: psutil.Process, redis: Redis | None, args: argparse.Namespace,
                 report: Report, start: float) -> None:  # fmt: skip
    """Kill a decode worker every `--kill-every` minutes; restart Redis once."""
    next_kill = args.kill_every * 60 if args.kill_every > 0 else float("inf")
    redis_at = (
        args.redis_restart_at * 60
        if redis is not None and args.redis_restart_at >= 0
        else float("inf")
    )
    while (now := time.monotonic() - start) < args.minutes * 60:
        if now >= next_kill:
            victim = decode_worker(server)
            if victim is not None:
                victim.send_signal(signal.SIGKILL)
            report.faults.append(
                {"t_s": now, "what": f"SIGKILL decode worker {victim and victim.pid}"}
            )
            next_kill += args.kill_every * 60
        if now >= redis_at and redis is not None:
            redis.stop()
            redis.start()
            report.faults.append({"t_s": now, "what": "Redis stopped and started"})
            redis_at = float("inf")
        await asyncio.sleep(1)


async def sample(server: psutil.Process, redis: Redis | None, report: Report, start: float,
                 minutes: float, url: str, batch_id: str) -> None:  # fmt: skip
    """Every 10 s: each process's RSS (Redis as it is now: restarted, it is a new process)
    and the batch's line counts."""
    async with httpx2.AsyncClient(base_url=url) as client:
        while (now := time.monotonic() - start) < minutes * 60:
            roots = {"serve": server}
            if redis is not None and redis.proc is not None and redis.proc.poll() is None:
                roots["redis"] = psutil.Process(redis.proc.pid)
            report.memory.append({"t_s": now, "rss_mb": sample_memory(roots)})
            try:
                counts = (await client.get(f"/v1/batches/{batch_id}", timeout=5)).json()
                report.batch_progress.append({"t_s": now, **counts["request_counts"]})
            except (httpx2.HTTPError, KeyError, ValueError):
                pass  # a look that failed (Redis restarting): the next one counts
            await asyncio.sleep(10)


def serve_argv(args: argparse.Namespace, store: str) -> list[str]:
    argv = [sys.executable, "-m", "duet.cli.main", "serve", "--port", str(args.port),
            "--grpc-port", str(args.grpc_port), "--session-store", store]  # fmt: skip
    if args.model:
        argv += ["--model", args.model]
    if not args.aggregated:
        argv += ["--disaggregated", "--decode-workers", "2"]
    return argv


async def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    url = f"http://127.0.0.1:{args.port}"
    redis = None if args.no_redis else Redis(workdir, args.redis_port)
    store = (
        f"sqlite:///{workdir}/store.db" if redis is None else f"redis://127.0.0.1:{args.redis_port}"
    )
    if redis is not None:
        redis.start()
    log = open(workdir / "serve.log", "wb")
    server = subprocess.Popen(serve_argv(args, store), stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)  # fmt: skip
    report = Report()
    try:
        async with httpx2.AsyncClient(base_url=url) as client:
            deadline = time.monotonic() + 600
            while True:
                try:
                    if (await client.get("/ready", timeout=2)).status_code == 200:
                        break
                except httpx2.HTTPError:
                    pass
                if server.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    tail = (workdir / "serve.log").read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"duet serve did not become ready (exit code "
                                       f"{server.poll()}); its log ends:\n{tail}")  # fmt: skip
                await asyncio.sleep(1)
        sat = await saturation(
            url, args.concurrency, args.saturation_s, args.vocab, args.max_tokens
        )
        rate = max(0.01, args.load * sat)
        batch_id = await start_batch(url, args.batch_lines, args.vocab)
        serve = psutil.Process(server.pid)
        start = time.monotonic()
        await asyncio.gather(
            poisson_load(
                url, rate, args.minutes, args.vocab, args.max_tokens, report, args.timeout_s
            ),
            faults(serve, redis, args, report, start),
            sample(serve, redis, report, start, args.minutes, url, batch_id),
        )
        batch = await finish_batch(url, batch_id, args.batch_lines, args.timeout_s)
        return {"saturation_rps": sat, "rate_rps": rate, **report.summary(), "batch": batch,
                "args": {k: str(v) for k, v in vars(args).items()}}  # fmt: skip
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
        if redis is not None:
            redis.stop()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    workdir = args.out.parent / f"{args.out.stem}-work"
    workdir.mkdir(parents=True, exist_ok=True)
    result = asyncio.run(run(args, workdir))
    args.out.write_text(json.dumps(result, indent=2, default=str))
    if args.plot:
        plot(result, args.out.with_suffix(".png"))
    print(json.dumps({k: result[k] for k in ("sent", "completed", "failed", "duplicated", "lost",
                                             "batch")}, default=str))  # fmt: skip
    return result


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
