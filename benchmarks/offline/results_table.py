"""The offline-throughput run's comparison: each system's agreement with the reference's greedy
tokens, duet's tok/s ratios to the baselines, and the printed table."""

from __future__ import annotations

from typing import Any

from benchmarks.offline.systems import SystemResult

NOISY_OTHER_CORES = 0.2
"""Cores used by other processes during a timed call above which it counts as disturbed."""


def agreement(result: SystemResult, reference: SystemResult) -> dict[str, Any]:
    """Exact greedy matches with the reference, and the mean fraction of each output that
    agrees before the first differing token."""
    num_exact, prefix_fractions = 0, []
    for ours, theirs in zip(result.token_ids, reference.token_ids, strict=True):
        num_exact += ours == theirs
        common = next(
            (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), len(ours)
        )
        prefix_fractions.append(common / max(len(theirs), 1))
    return {
        "reference": reference.name,
        "num_exact": num_exact,
        "mean_prefix_fraction": sum(prefix_fractions) / len(prefix_fractions),
    }


def ratios(results: list[SystemResult]) -> dict[str, float]:
    """duet tokens/s over each baseline's at the same dtype."""
    out: dict[str, float] = {}
    for duet in (r for r in results if r.system == "duet"):
        for base in (r for r in results if r.system != "duet" and r.dtype == duet.dtype):
            key = f"duet/{base.system}" + (f"-{base.variant}" if base.system == "vllm" else "")
            out[f"{key} {duet.dtype}"] = duet.output_tokens_per_s / base.output_tokens_per_s
    return out


def print_table(results: list[SystemResult], ratio: dict[str, float]) -> None:
    header = (
        f"{'system':<6} {'dtype':<9} {'variant':<10} {'load s':>7} {'wall s':>8} "
        f"{'tok/s':>8} {'computed tok/s':>14} {'others':>6} {'stolen':>6}  match ref"
    )
    print("\n" + header + "\n" + "-" * len(header))
    for r in results:
        match = r.details.get("agreement")
        match_text = (
            f"{match['num_exact']}/{len(r.token_ids)} ({match['mean_prefix_fraction']:.0%})"
            if match
            else "-"
        )
        print(
            f"{r.system:<6} {r.dtype:<9} {r.variant:<10} {r.load_s:7.1f} {r.wall_s:8.1f} "
            f"{r.output_tokens_per_s:8.1f} {r.num_computed_tokens / r.wall_s:14.1f} "
            f"{r.details['cpu']['other_cores']:6.2f} {r.details['cpu']['stolen_cores']:6.2f}  "
            f"{match_text}"
        )
    for name, value in ratio.items():
        print(f"{name:<28} {value:6.2f}x")
    print(
        "others/stolen: average cores used by other processes / stolen by the hypervisor during "
        "the timed call; match ref: outputs equal to the reference's greedy tokens "
        "(mean agreeing prefix)"
    )
    noisy = [r.name for r in results if r.details["cpu"]["other_cores"] > NOISY_OTHER_CORES]
    if noisy:
        print(f"WARNING: other processes competed for the CPU during: {', '.join(noisy)}")
