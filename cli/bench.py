"""`duet bench serve`: the serving benchmark of `loadgen/` against a running server."""

from __future__ import annotations

import argparse

from duet.loadgen.args import add_arguments


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = commands.add_parser(
        "bench", help="benchmarks against a running server"
    )
    benchmarks = parser.add_subparsers(dest="bench_command", required=True)
    serve = benchmarks.add_parser(
        "serve",
        help="serving benchmark: Poisson arrivals over the REST API; TTFT, TPOT, ITL, "
        "throughput, goodput; JSON and PNG",
    )
    add_arguments(serve)
    serve.set_defaults(run=run, command_parser=serve)
    return parser


def run(args: argparse.Namespace) -> int:
    from duet.loadgen.benchmark import run_from_args

    return run_from_args(args)
