"""The serving benchmark's PNG: CDFs of TTFT, TPOT and ITL for every run, and goodput and
request throughput against the offered rate when a sweep ran several rates (else the
end-to-end latency CDF). Several result files (say aggregated and disaggregated) share one
figure, one colour each."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


def _rate(run: dict[str, Any]) -> float:
    return math.inf if run["rate"] == "inf" else float(run["rate"])


def _values_ms(run: dict[str, Any], key: str) -> list[float]:
    ok = [r for r in run["requests"] if r["error"] is None]
    if key == "itl_s":
        return [gap * 1e3 for r in ok for gap in r["itl_s"]]
    return [r[key] * 1e3 for r in ok if r[key] is not None]


def _cdf(ax: Any, values: Sequence[float], label: str, **style: Any) -> None:
    if not values:
        return
    xs = np.sort(np.asarray(values))
    ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=label, **style)


def plot_results(results: Sequence[tuple[str, dict[str, Any]]], path: str | Path) -> Path:
    """Write the figure for `results` ((label, result JSON) pairs) to `path` as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display here; must precede pyplot's import
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    panels = [("ttft_s", "TTFT (ms)"), ("tpot_s", "TPOT (ms)"), ("itl_s", "ITL (ms)")]
    sweep = any(len(res["runs"]) > 1 for _, res in results)
    if not sweep:
        panels.append(("e2e_s", "end-to-end latency (ms)"))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, title) in zip(axes.flat, panels, strict=False):
        for i, (label, res) in enumerate(results):
            runs = res["runs"]
            for j, run in enumerate(runs):
                name = " ".join(filter(None, [label, f"{_rate_label(run)} req/s"]))
                # One colour per result file; a sweep's rates fade from light to dark.
                alpha = 0.35 + 0.65 * (j + 1) / len(runs)
                _cdf(ax, _values_ms(run, key), name, color=colours[i % len(colours)], alpha=alpha)
        _style(ax, title, "fraction of requests" if key != "itl_s" else "fraction of gaps")
        _slo_line(ax, key, results)
    if sweep:
        _goodput_panel(axes.flat[3], results, colours)
    fig.suptitle(_title(results), fontsize="medium")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _rate_label(run: dict[str, Any]) -> str:
    rate = _rate(run)
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _style(ax: Any, xlabel: str, ylabel: str) -> None:
    lo, hi = ax.dataLim.x0, ax.dataLim.x1
    if lo > 0 and hi / lo > 20:  # a long tail (stalls behind prefills) would squash the rest
        ax.set_xscale("log")
        xlabel += ", log scale"
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")


def _slo_line(ax: Any, key: str, results: Sequence[tuple[str, dict[str, Any]]]) -> None:
    slo_key = {"ttft_s": "slo_ttft_ms", "tpot_s": "slo_tpot_ms"}.get(key)
    limits = {res["config"].get(slo_key) for _, res in results} if slo_key else set()
    for limit in limits - {None}:
        ax.axvline(limit, color="red", linestyle="--", linewidth=1)


def _goodput_panel(
    ax: Any, results: Sequence[tuple[str, dict[str, Any]]], colours: Sequence[str]
) -> None:
    """Goodput (solid) and request throughput (dotted) against the offered rate; an offered
    rate of inf is drawn at the largest finite rate's next doubling."""
    finite = [_rate(run) for _, res in results for run in res["runs"] if math.isfinite(_rate(run))]
    inf_x = 2 * max(finite) if finite else 1.0
    for i, (label, res) in enumerate(results):
        runs = sorted(res["runs"], key=_rate)
        xs = [inf_x if math.isinf(_rate(run)) else _rate(run) for run in runs]
        good = [run["summary"]["goodput"] for run in runs]
        done = [run["summary"]["request_throughput"] for run in runs]
        colour = colours[i % len(colours)]
        if all(g is not None for g in good):
            ax.plot(xs, good, "o-", color=colour, label=" ".join(filter(None, [label, "goodput"])))
        ax.plot(xs, done, "s:", color=colour, label=" ".join(filter(None, [label, "throughput"])))
    ax.set_xlabel("offered rate (req/s; inf drawn at 2x the largest)")
    ax.set_ylabel("requests/s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def _title(results: Sequence[tuple[str, dict[str, Any]]]) -> str:
    config = results[0][1]["config"]
    slo = [
        f"TTFT <= {config['slo_ttft_ms']:g} ms" if config.get("slo_ttft_ms") is not None else "",
        f"TPOT <= {config['slo_tpot_ms']:g} ms" if config.get("slo_tpot_ms") is not None else "",
    ]
    slo_text = " and ".join(s for s in slo if s) or "no SLO"
    return (
        f"duet bench serve: {config['model']}, {config['num_requests']} requests/rate, "
        f"input {config['input_len_dist']}, output {config['output_len_dist']}; "
        f"goodput: {slo_text}"
    )
