"""The flags of `duet bench serve`: argparse types that reject a bad value with a message
argparse prints after the flag's name."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from duet.loadgen.workload import DIST_HELP, LengthDist, parse_rates


def _flag_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse `type` whose ValueError message argparse prints after the flag's name."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


def _bounded(kind: type, low: float, inclusive: bool = True) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise ValueError(f"{text!r} is not a {kind.__name__}") from None
        ok = value >= low if inclusive else value > low
        if not ok or (kind is float and not math.isfinite(value)):
            raise ValueError(f"must be {'>=' if inclusive else '>'} {low:g}; got {text}")
        return value

    return _flag_type(parse)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `duet bench serve`."""
    p.add_argument(
        "--url", default="http://127.0.0.1:8000", help="server root (default: %(default)s)"
    )
    p.add_argument(
        "--endpoint",
        choices=["completions", "chat"],
        default="completions",
        help="/v1/completions or /v1/chat/completions (default: %(default)s)",
    )
    p.add_argument(
        "--prompt-format",
        choices=["ids", "text"],
        default=None,
        help="completions prompts as token ids (exact lengths; the default) or as the decoded "
        "text (what the server re-tokenizes may differ slightly); chat is always text",
    )
    p.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="tokenizer to draw prompt tokens from: an HF model or tokenizer dir, or a .gguf "
        "(default: the embedded SmolLM2-135M-Instruct, duet serve's default)",
    )
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument(
        "--rate",
        type=_flag_type(parse_rates),
        default=[1.0],
        metavar="R[,R...]",
        help="Poisson arrival rate(s) in requests/s; several (1,2,4) sweep them in one run, "
        "inf sends all requests at once (default: 1)",
    )
    p.add_argument(
        "--num-requests", type=_bounded(int, 1), default=64, help="per rate (default: %(default)s)"
    )
    for which, default in (("input", "uniform:16:512"), ("output", "uniform:16:256")):
        p.add_argument(
            f"--{which}-len-dist",
            type=_flag_type(LengthDist.parse),
            default=LengthDist.parse(default),
            metavar="DIST",
            help=f"{which} tokens per request: {DIST_HELP} (default: {default})",
        )
    p.add_argument("--seed", type=int, default=0, help="workload and arrivals seed (default: 0)")
    p.add_argument(
        "--slo-ttft-ms", type=_bounded(float, 0), default=None, help="goodput: TTFT bound"
    )
    p.add_argument(
        "--slo-tpot-ms", type=_bounded(float, 0), default=None, help="goodput: TPOT bound"
    )
    p.add_argument("--temperature", type=_bounded(float, 0), default=0.0, help="(default: greedy)")
    p.add_argument(
        "--request-timeout-s",
        type=_bounded(float, 0, inclusive=False),
        default=600.0,
        help="bound on one request, from send to its last event (default: %(default)s)",
    )
    p.add_argument(
        "--wait-for-server-s",
        type=_bounded(float, 0),
        default=0.0,
        help="keep retrying the first request to the server for up to this long, e.g. right "
        "after starting `duet serve` (default: one try, bounded at 10 s)",
    )
    p.add_argument(
        "--max-concurrency",
        type=_bounded(int, 1),
        default=None,
        metavar="N",
        help="at most N requests in flight; 1 measures one stream (default: no bound)",
    )
    p.add_argument(
        "--num-warmup",
        type=_bounded(int, 0),
        default=1,
        help="requests sent one by one before the timed runs, not measured (default: %(default)s)",
    )
    p.add_argument(
        "--with-batch",
        type=_bounded(int, 1),
        default=None,
        metavar="N",
        help="before the timed runs, submit an N-line batch (Batch API, --batch-output-len "
        "tokens per line) that runs beside them; cancelled at the end (default: none)",
    )
    p.add_argument(
        "--batch-output-len",
        type=_bounded(int, 1),
        default=128,
        metavar="TOKENS",
        help="tokens each --with-batch line generates (default: %(default)s)",
    )
    p.add_argument(
        "--label", default="", help="name of this server/mode in the table, plot and file names"
    )
    p.add_argument(
        "--result-json",
        type=Path,
        default=None,
        help="default: benchmarks/results/serve[_LABEL].json",
    )
    p.add_argument("--plot", type=Path, default=None, help="PNG; default: the JSON path with .png")
    p.add_argument("--no-plot", action="store_true", help="write no PNG")
    p.add_argument(
        "--compare",
        nargs="+",
        type=Path,
        default=None,
        metavar="JSON",
        help="send nothing: draw these result files into one --plot and print their tables",
    )
