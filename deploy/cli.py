"""The `duet` command: generate, chat, serve, bench serve, tokenizer save."""

from __future__ import annotations

import argparse
import logging
import math
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine import SamplingParams
    from router.server import RouterConfig


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

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible REST API and gRPC")
    _add_model_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    serve.add_argument(
        "--port", type=int, default=8000, help="REST port, 0 for a free one (default: %(default)s)"
    )
    serve.add_argument(
        "--grpc-port",
        type=int,
        default=50051,
        help="gRPC port, 0 for a free one (logged at startup) (default: %(default)s)",
    )
    serve.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' (repeatable; visible in the process list, "
        "so prefer --api-key-file)",
    )
    serve.add_argument(
        "--api-key-file",
        default=None,
        metavar="FILE",
        help="file with accepted API keys, one per line (blank lines and # comments skipped)",
    )
    serve.add_argument(
        "--served-model-name", default=None, help="model id clients send (default: the model's)"
    )
    serve.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="sequences that may wait behind a full batch before new requests get 503",
    )
    serve.add_argument(
        "--session-store",
        default=None,
        metavar="URL",
        help="where sessions and shared rate-limit counters live: redis://host:6379/0 or "
        "sqlite:///path.db (default: an SQLite file in the user data dir)",
    )
    serve.add_argument(
        "--rate-limit-rpm",
        type=float,
        default=None,
        metavar="N",
        help="requests per minute per API key (default: unlimited)",
    )
    serve.add_argument(
        "--rate-limit-tpm",
        type=float,
        default=None,
        metavar="N",
        help="tokens (prompt + max_tokens) per minute per API key (default: unlimited)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=int,
        default=10,
        help="seconds Ctrl-C waits for in-flight requests before ending them with a retryable "
        "error (SSE error event, gRPC UNAVAILABLE)",
    )
    serve.add_argument(
        "--max-num-seqs", type=int, default=None, help="sequences an engine runs at once"
    )
    serve.add_argument(
        "--num-kv-blocks", type=int, default=None, help="KV blocks per engine (default: sized)"
    )
    from deploy.serve_cluster import add_cluster_arguments

    add_cluster_arguments(serve)

    from benchmarks.serve import add_arguments as add_bench_serve_arguments

    bench = sub.add_parser("bench", help="benchmarks against a running server")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    add_bench_serve_arguments(
        bench_sub.add_parser(
            "serve",
            help="serving benchmark: Poisson arrivals over the REST API; TTFT, TPOT, ITL, "
            "throughput, goodput; JSON and PNG",
        )
    )

    tokenizer = sub.add_parser("tokenizer", help="the model's tokenizer for other tools")
    tokenizer_sub = tokenizer.add_subparsers(dest="tokenizer_command", required=True)
    save = tokenizer_sub.add_parser(
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose or args.command == "serve" else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    from engine import InvalidInputError, ModelLoadError

    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "chat":
            return _chat(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "bench":
            from benchmarks.serve import run_from_args

            return run_from_args(args)
        if args.command == "tokenizer":
            from deploy.tokenizer_export import save_tokenizer

            try:
                print(save_tokenizer(args.model, args.out_dir))
            except OSError as e:
                print(f"duet: error: out_dir: cannot write {args.out_dir}: {e}", file=sys.stderr)
                return 2
            return 0
    except (InvalidInputError, ModelLoadError, ServeConfigError) as e:
        print(f"duet: error: {e}", file=sys.stderr)
        return 2
    return 1


def _sampling(args: argparse.Namespace) -> SamplingParams:
    from engine import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed,
    )  # fmt: skip


def _engine_kwargs(args: argparse.Namespace) -> dict:
    kwargs = dict(dtype=args.dtype, device=args.device, max_model_len=args.max_model_len)
    for name in ("max_num_seqs", "num_kv_blocks"):  # serve's engine flags
        if getattr(args, name, None) is not None:
            kwargs[name] = getattr(args, name)
    return kwargs


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


class ServeConfigError(ValueError):
    """A `duet serve` flag is unusable (bad port, unreadable key file)."""


def _read_api_keys(args: argparse.Namespace) -> list[str]:
    keys = [k for k in args.api_key if k]
    if len(keys) != len(args.api_key):
        raise ServeConfigError("--api-key: must not be empty")
    if args.api_key_file:
        try:
            with open(args.api_key_file) as f:
                lines = [line.strip() for line in f]
        except OSError as e:
            raise ServeConfigError(f"--api-key-file: cannot read {args.api_key_file}: {e}") from e
        file_keys = [line for line in lines if line and not line.startswith("#")]
        if not file_keys:
            raise ServeConfigError(f"--api-key-file: no keys in {args.api_key_file}")
        keys += file_keys
    return keys


def _router_config(args: argparse.Namespace, api_keys: list[str]) -> RouterConfig:
    from router.api_server import DEFAULT_MAX_QUEUED_REQUESTS
    from router.server import RouterConfig
    from session_store import RateLimits, open_session_store

    rates = (("--rate-limit-rpm", args.rate_limit_rpm), ("--rate-limit-tpm", args.rate_limit_tpm))
    for flag, value in rates:
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ServeConfigError(f"{flag}: must be > 0 (omit it for no limit); got {value}")
    max_queued = args.max_queued_requests
    try:
        config = RouterConfig(
            host=args.host,
            port=args.port,
            grpc_port=args.grpc_port,
            api_keys=tuple(api_keys),
            max_queued_requests=DEFAULT_MAX_QUEUED_REQUESTS if max_queued is None else max_queued,
            session_store_url=args.session_store,
            rate_limits=RateLimits(args.rate_limit_rpm, args.rate_limit_tpm),
            shutdown_timeout_s=args.shutdown_timeout,
        )
        open_session_store(config.session_store_url)  # a bad URL fails here, naming the flag
    except ValueError as e:
        raise ServeConfigError(str(e)) from e
    return config


def _serve(args: argparse.Namespace) -> int:
    # Everything that can be wrong with the flags fails before the (slow) model load.
    config = _router_config(args, _read_api_keys(args))
    if args.disaggregated:
        from deploy.serve_cluster import serve_disaggregated

        try:
            return serve_disaggregated(args, config, _engine_kwargs(args))
        except ValueError as e:
            raise ServeConfigError(str(e)) from e
    from engine import AsyncEngine, EngineConfig
    from engine.heap import freeze_startup_heap
    from router.server import RouterServer, bind_rest_socket, check_grpc_port

    try:
        check_grpc_port(config.host, config.grpc_port)
        rest_socket = bind_rest_socket(config.host, config.port)
    except OSError as e:
        raise ServeConfigError(str(e)) from e
    log = logging.getLogger("duet.serve")
    # uvicorn handles SIGINT/SIGTERM with a graceful shutdown, then re-raises the signal through
    # the handler that was installed before it: make SIGTERM, like SIGINT, an exception here so
    # both end in the `finally` below (also while the model is still loading).
    previous_sigterm = signal.signal(signal.SIGTERM, _raise_terminated)
    engine = None
    try:
        engine = AsyncEngine.from_config(EngineConfig(model=args.model, **_engine_kwargs(args)))
        name = args.served_model_name or engine.engine.model_name
        server = RouterServer(engine, name, config, rest_socket)
        freeze_startup_heap()
        server.run()
    except (KeyboardInterrupt, _Terminated):
        pass  # both servers have shut down gracefully (or the model was still loading)
    finally:
        rest_socket.close()
        if engine is not None:
            engine.shutdown()
            log.info("engine stopped")
        signal.signal(signal.SIGTERM, previous_sigterm)
    return 0


class _Terminated(Exception):
    """SIGTERM, raised in the main thread."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated()


if __name__ == "__main__":
    sys.exit(main())
