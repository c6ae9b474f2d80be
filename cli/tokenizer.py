"""`duet tokenizer save DIR`: the model's tokenizer as an HF tokenizer directory
(engine/tokenizer_export.py), for load generators and other tools."""

from __future__ import annotations

import argparse
import sys


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = commands.add_parser(
        "tokenizer", help="the model's tokenizer for other tools"
    )
    actions = parser.add_subparsers(dest="tokenizer_command", required=True)
    save = actions.add_parser(
        "save",
        help="write the tokenizer as an HF tokenizer dir (tokenizer.json, tokenizer_config.json "
        "with the chat template) that transformers.AutoTokenizer loads, e.g. for aiperf",
    )
    save.add_argument(
        "--model",
        default=None,
        help="HF dir, .gguf file or hub id (default: embedded SmolLM2-135M-Instruct)",
    )
    save.add_argument("out_dir", help="directory to write (created)")
    save.set_defaults(run=run, command_parser=save)
    return parser


def run(args: argparse.Namespace) -> int:
    from duet.engine.tokenizer_export import save_tokenizer

    try:
        print(save_tokenizer(args.model, args.out_dir))
    except OSError as e:
        print(f"duet: error: out_dir: cannot write {args.out_dir}: {e}", file=sys.stderr)
        return 2
    return 0
