"""The soak's accounting (benchmarks/serve/soak.py): each request's outcome, the per-minute
summaries (latency, requests, memory, the batch's progress), the stream reading that counts
finishes, and the plot."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Outcome:
    """One request: when it was sent and ended (seconds from the start), and how."""

    sent_s: float
    ended_s: float | None = None
    status: str = "pending"  # completed | failed | pending (lost if still pending)
    cause: str = ""
    num_finishes: int = 0
    num_done: int = 0


@dataclass
class Report:
    outcomes: list[Outcome] = field(default_factory=list)
    memory: list[dict[str, Any]] = field(default_factory=list)  # {t_s, rss_mb: {name: mb}}
    faults: list[dict[str, Any]] = field(default_factory=list)  # {t_s, what}
    batch_progress: list[dict[str, Any]] = field(default_factory=list)  # {t_s, completed, ...}

    def summary(self) -> dict[str, Any]:
        sent = len(self.outcomes)
        causes = Counter(o.cause for o in self.outcomes if o.status == "failed")
        return {
            "sent": sent,
            "completed": sum(o.status == "completed" for o in self.outcomes),
            "failed": dict(causes),
            "duplicated": sum(o.num_finishes > 1 or o.num_done > 1 for o in self.outcomes),
            "lost": sum(o.status == "pending" for o in self.outcomes),
            "p99_latency_s_per_minute": p99_per_minute(self.outcomes),
            "requests_per_minute": requests_per_minute(self.outcomes),
            "rss_mb_per_minute": rss_per_minute(self.memory),
            "batch_lines_done_per_minute": batch_per_minute(self.batch_progress),
            "faults": self.faults,
        }


def requests_per_minute(outcomes: list[Outcome]) -> dict[int, dict[str, float]]:
    """Per minute of the run: requests sent in it, and of those that ended in it how many
    completed and failed, with their median latency."""
    out: dict[int, dict[str, float]] = {}
    latencies: dict[int, list[float]] = {}
    for o in outcomes:
        out.setdefault(int(o.sent_s // 60), {"sent": 0, "completed": 0, "failed": 0})["sent"] += 1
        if o.ended_s is None or o.status == "pending":
            continue
        minute = out.setdefault(int(o.ended_s // 60), {"sent": 0, "completed": 0, "failed": 0})
        minute[o.status] += 1
        if o.status == "completed":
            latencies.setdefault(int(o.ended_s // 60), []).append(o.ended_s - o.sent_s)
    for minute, values in latencies.items():
        values.sort()
        out[minute]["p50_s"] = values[(len(values) - 1) // 2]
    return dict(sorted(out.items()))


def batch_per_minute(progress: list[dict[str, Any]]) -> dict[int, int]:
    """The batch's lines done (completed + failed) at the last look in each minute."""
    out: dict[int, int] = {}
    for look in progress:
        out[int(look["t_s"] // 60)] = look["completed"] + look["failed"]
    return out


def p99_per_minute(outcomes: list[Outcome]) -> dict[int, float]:
    """The 99th percentile latency of the requests completed in each minute of the run."""
    by_minute: dict[int, list[float]] = {}
    for o in outcomes:
        if o.status == "completed" and o.ended_s is not None:
            by_minute.setdefault(int(o.ended_s // 60), []).append(o.ended_s - o.sent_s)
    out = {}
    for minute, latencies in sorted(by_minute.items()):
        latencies.sort()
        out[minute] = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    return out


def rss_per_minute(samples: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Each process's largest RSS (MB) sampled in each minute."""
    out: dict[int, dict[str, float]] = {}
    for sample in samples:
        minute = out.setdefault(int(sample["t_s"] // 60), {})
        for name, mb in sample["rss_mb"].items():
            minute[name] = max(minute.get(name, 0.0), mb)
    return out


def read_stream(lines: list[str], outcome: Outcome) -> None:
    """Count a streamed completion's finishes and `[DONE]`s, and an error event as a failure."""
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            outcome.num_done += 1
            continue
        event = json.loads(data)
        if "error" in event:
            outcome.status, outcome.cause = "failed", f"stream error: {event['error'].get('type')}"
            continue
        outcome.num_finishes += sum(bool(c.get("finish_reason")) for c in event["choices"])


ROLES = (("DecodeRankActor", "decode worker"), ("PrefillRankActor", "prefill worker"),
         ("RouterActor", "router"), ("redis-server", "redis"), ("duet.cli.main serve", "duet serve"))  # fmt: skip


def role_of(name: str) -> str:
    """A process's role from its `root:pid:title` name; Ray's own processes are "ray"."""
    title = name.split(":", 2)[-1]
    return next((role for needle, role in ROLES if needle in title), "ray")


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (lat, mem) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    p99 = result["p99_latency_s_per_minute"]
    lat.plot(list(p99), list(p99.values()), marker="o", label="p99 latency")
    per_minute = result.get("requests_per_minute", {})
    p50 = {m: v["p50_s"] for m, v in per_minute.items() if "p50_s" in v}
    lat.plot(list(p50), list(p50.values()), marker=".", label="p50 latency")
    lat.set_ylabel("latency (s)")
    lat.legend(loc="upper left", fontsize=7)
    batch = result.get("batch_lines_done_per_minute", {})
    if batch:
        done = lat.twinx()
        done.plot(list(batch), list(batch.values()), color="gray", linestyle="--")
        done.set_ylabel("batch lines done (dashed)")
    for fault in result["faults"]:
        for ax in (lat, mem):
            ax.axvline(fault["t_s"] / 60, color="red", alpha=0.3)
    rss = result["rss_mb_per_minute"]
    names = sorted({n for m in rss.values() for n in m})
    seen: set[str] = set()
    for name in names:
        role = role_of(name)
        if role == "ray" or name.endswith(".info"):
            continue  # Ray's helpers are flat and small; `.info` is a title for a moment
        color = f"C{[r for _, r in ROLES].index(role)}"
        mem.plot(list(rss), [m.get(name, float("nan")) for m in rss.values()], color=color,
                 label=None if role in seen else role)  # fmt: skip
        seen.add(role)
    mem.set_ylabel("RSS (MB), one line per process")
    mem.set_xlabel("minute (red: a decode worker killed, or Redis restarted)")
    mem.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
