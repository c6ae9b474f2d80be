"""Aggregates of one serving run: latency percentiles, throughputs and goodput under an SLO."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from duet.loadgen.client import RequestResult

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


@dataclass(frozen=True)
class SLO:
    """Latency targets a request must meet to count towards goodput (None: no bound)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def is_set(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def met_by(self, r: RequestResult) -> bool:
        if not r.success or r.ttft_s is None:
            return False
        if self.ttft_ms is not None and r.ttft_s * 1e3 > self.ttft_ms:
            return False
        tpot = r.tpot_s  # None for a one-token output: no time per output token to miss
        return self.tpot_ms is None or tpot is None or tpot * 1e3 <= self.tpot_ms


def latency_stats(values_s: Sequence[float]) -> dict[str, float | None]:
    """Mean and p50/p90/p99 in milliseconds (None when there are no values)."""
    if not values_s:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    stats: dict[str, float | None] = {"mean": float(ms.mean())}
    stats.update({f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES})
    return stats


def summarize(results: Sequence[RequestResult], duration_s: float, slo: SLO) -> dict[str, Any]:
    """The run's aggregates. Throughputs count completed requests only, over `duration_s` (first
    send to last response); goodput counts those that also met `slo` (None when no SLO is set)."""
    ok = [r for r in results if r.success]
    num_prompt = sum(r.prompt_tokens if r.prompt_tokens is not None else r.input_len for r in ok)
    num_output = sum(r.output_tokens for r in ok)
    num_good = sum(slo.met_by(r) for r in ok)
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    return {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": dict(Counter(r.error for r in results if r.error is not None)),
        "duration_s": duration_s,
        "num_prompt_tokens": num_prompt,
        "num_output_tokens": num_output,
        "request_throughput": len(ok) * per_s,
        "output_throughput": num_output * per_s,
        "total_token_throughput": (num_prompt + num_output) * per_s,
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
        "num_good": num_good if slo.is_set else None,
        "goodput": num_good * per_s if slo.is_set else None,
        "ttft_ms": latency_stats([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": latency_stats([t for r in ok if (t := r.tpot_s) is not None]),
        "itl_ms": latency_stats([gap for r in ok for gap in r.itl_s]),
        "e2e_ms": latency_stats([r.e2e_s for r in ok if r.e2e_s is not None]),
    }


def format_table(runs: Sequence[dict[str, Any]]) -> str:
    """One column per rate: counts, throughputs, goodput, then each latency's mean and
    percentiles."""
    headers = ["rate (req/s)"] + [_rate_str(run["rate"]) for run in runs]
    sums = [run["summary"] for run in runs]
    rows: list[list[str]] = [
        ["completed / failed"] + [f"{s['completed']} / {s['failed']}" for s in sums],
        ["duration (s)"] + [f"{s['duration_s']:.2f}" for s in sums],
        ["request throughput (req/s)"] + [f"{s['request_throughput']:.3f}" for s in sums],
        ["output throughput (tok/s)"] + [f"{s['output_throughput']:.1f}" for s in sums],
        ["total throughput (tok/s)"] + [f"{s['total_token_throughput']:.1f}" for s in sums],
        ["goodput (req/s)"] + [_num(s["goodput"], ".3f") for s in sums],
    ]
    for name in LATENCIES:
        for stat in ("mean", *(f"p{p}" for p in PERCENTILES)):
            rows.append([f"{name} {stat}"] + [_num(s[name][stat], ".1f") for s in sums])
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]
    lines = [_row(headers, widths), "  ".join("-" * w for w in widths)]
    lines += [_row(row, widths) for row in rows]
    return "\n".join(lines)


def _row(cells: Sequence[str], widths: Sequence[int]) -> str:
    """The label left-aligned, the numbers right-aligned."""
    out = [cells[0].ljust(widths[0])]
    out += [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
    return "  ".join(out)


def _rate_str(rate: float | str) -> str:
    return "inf" if rate in ("inf", float("inf")) else f"{float(rate):g}"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)
