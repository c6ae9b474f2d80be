"""`duet chat`: an interactive streaming chat in the terminal (`engine.AsyncEngine`)."""

from __future__ import annotations

import argparse

from duet.cli.engine_flags import add_engine_flags, build_config
from duet.cli.sampling_flags import add_sampling_flags, sampling_params


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = commands.add_parser(
        "chat", help="interactive streaming chat in the terminal"
    )
    parser.add_argument("--system", default=None, help="system prompt")
    add_sampling_flags(parser, max_tokens=512)
    add_engine_flags(parser)
    parser.set_defaults(run=run, command_parser=parser)
    return parser


def run(args: argparse.Namespace) -> int:
    import asyncio

    from duet.engine import AsyncEngine

    parser = args.command_parser
    params = sampling_params(parser, args)
    engine = AsyncEngine.from_config(build_config(parser, args))
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    print(f"duet chat with {engine.engine.model_name}. Ctrl-D or /exit to quit.", flush=True)

    async def reply(ids: list[int]) -> str:
        text = ""
        async for out in engine.generate(ids, params):
            delta = out.outputs[0].delta_text
            text += delta
            print(delta, end="", flush=True)
        print(flush=True)
        return text

    try:
        while True:
            try:
                line = input("> ")
            except EOFError:
                break
            if line.strip() in ("/exit", "/quit"):
                break
            if not line.strip():
                continue
            history.append({"role": "user", "content": line})
            ids = engine.engine.encode_chat(history)
            history.append({"role": "assistant", "content": asyncio.run(reply(ids))})
    except KeyboardInterrupt:
        print()
    finally:
        engine.shutdown()
    return 0
