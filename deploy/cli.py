"""The `duet` command: generate, chat (serve and bench come with their issues)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="HF dir, .gguf file or hub id (default: embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--max-model-len", type=int, default=None)


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="duet", description="duet: disaggregated LLM serving")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt and print the result")
    _add_model_args(gen)
    _add_sampling_args(gen, max_tokens=128)
    gen.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the model's chat template"
    )
    gen.add_argument("prompt")

    chat = sub.add_parser("chat", help="interactive streaming chat in the terminal")
    _add_model_args(chat)
    _add_sampling_args(chat, max_tokens=512)
    chat.add_argument("--system", default=None, help="system prompt")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    from engine import InvalidInputError, ModelLoadError

    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "chat":
            return _chat(args)
    except (InvalidInputError, ModelLoadError) as e:
        print(f"duet: error: {e}", file=sys.stderr)
        return 2
    return 1


def _sampling(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from engine import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed,
    )  # fmt: skip


def _engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(dtype=args.dtype, device=args.device, max_model_len=args.max_model_len)


def _generate(args: argparse.Namespace) -> int:
    from engine import LLM

    params = _sampling(args)  # validate before the (slow) model load
    llm = LLM(args.model, **_engine_kwargs(args))
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate(args.prompt, params)[0]
    print(out.text)
    return 0


def _chat(args: argparse.Namespace) -> int:
    import asyncio

    from engine import AsyncEngine, EngineConfig

    params = _sampling(args)
    engine = AsyncEngine.from_config(EngineConfig(model=args.model, **_engine_kwargs(args)))
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


if __name__ == "__main__":
    sys.exit(main())
