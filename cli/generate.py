"""`duet generate PROMPT`: complete one prompt offline (`engine.LLM`) and print the text."""

from __future__ import annotations

import argparse
import dataclasses

from duet.cli.engine_flags import add_engine_flags, build_config
from duet.cli.sampling_flags import add_sampling_flags, sampling_params


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = commands.add_parser(
        "generate", help="complete one prompt and print the result"
    )
    parser.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the model's chat template"
    )
    parser.add_argument("prompt")
    add_sampling_flags(parser, max_tokens=128)
    add_engine_flags(parser)
    parser.set_defaults(run=run, command_parser=parser)
    return parser


def run(args: argparse.Namespace) -> int:
    from duet.engine import LLM

    parser = args.command_parser
    params = sampling_params(parser, args)  # everything is checked before the (slow) load
    config = build_config(parser, args)
    llm = LLM(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate(args.prompt, params)[0]
    print(out.text)
    return 0
