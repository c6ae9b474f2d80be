"""The sampling flags of `duet generate` and `duet chat` (the engine's `--seed` makes sampling
reproducible; see cli/engine_flags.py)."""

from __future__ import annotations

import argparse

from duet.engine.errors import InvalidInputError
from duet.engine.sampling_params import SamplingParams

SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k")


def add_sampling_flags(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument(
        "--max-tokens",
        type=int,
        default=max_tokens,
        help="tokens to generate (default: %(default)s)",
    )
    group.add_argument(
        "--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)"
    )
    group.add_argument("--top-p", type=float, default=1.0, help="(default: %(default)s)")
    group.add_argument("--top-k", type=int, default=-1, help="-1: off (default: %(default)s)")


def sampling_params(parser: argparse.ArgumentParser, args: argparse.Namespace) -> SamplingParams:
    """The flags as `SamplingParams`; a refused value exits through `parser.error`."""
    try:
        return SamplingParams(**{name: getattr(args, name) for name in SAMPLING_FLAGS})
    except InvalidInputError as e:
        flag = "--" + e.field.replace("_", "-") if e.field in SAMPLING_FLAGS else e.field
        parser.error(f"{flag}: {e.message}")
