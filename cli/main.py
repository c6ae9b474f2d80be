"""`duet`: the parser of every subcommand, and the dispatch to the one given."""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path

from duet.cli import bench, chat, generate, plan, serve, tokenizer

SUBCOMMANDS = (generate, chat, serve, bench, plan, tokenizer)


def _version() -> str:
    """The installed distribution's version, or the tree's own where duet runs from a checkout
    on PYTHONPATH without being installed (a lent GPU machine: docs/gpu.md)."""
    try:
        return importlib.metadata.version("duet-serve")
    except importlib.metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        return str(tomllib.loads(pyproject.read_text())["project"]["version"])


def build_parser() -> argparse.ArgumentParser:
    """The `duet` parser; each parsed subcommand carries `run` (its handler) and
    `command_parser` (the subparser that reports its errors)."""
    parser = argparse.ArgumentParser(prog="duet", description="duet: disaggregated LLM serving")
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument(
        "-V",
        "--version",
        action="version",
        version=f"duet {_version()}",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS:
        module.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose or args.command == "serve" else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    from duet.cluster_auth import MissingSecretError
    from duet.engine import InvalidInputError, ModelLoadError

    try:
        return int(args.run(args))
    except (InvalidInputError, ModelLoadError, MissingSecretError, serve.ServeConfigError) as e:
        print(f"duet: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
