"""`duet serve`: the OpenAI-compatible REST API and gRPC in front of one engine in this
process, or, with `--disaggregated`, a Ray cluster of prefill and decode workers
(cli/serve_cluster.py)."""

from __future__ import annotations

import argparse
import logging
import math
import signal
from typing import TYPE_CHECKING

from duet.cli.engine_flags import add_engine_flags, build_config, given_engine_flags
from duet.cli.serve_cluster import add_cluster_arguments
from duet.engine.config import EngineConfig

if TYPE_CHECKING:
    from duet.router.server import RouterConfig


class ServeConfigError(ValueError):
    """A `duet serve` flag is unusable (bad port, unreadable key file); names the flag."""


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = commands.add_parser(
        "serve", help="serve the OpenAI-compatible REST API and gRPC"
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: %(default)s)"
    )
    parser.add_argument(
        "--port", type=int, default=8000, help="REST port, 0 for a free one (default: %(default)s)"
    )
    parser.add_argument(
        "--grpc-port",
        type=int,
        default=50051,
        help="gRPC port, 0 for a free one (logged at startup) (default: %(default)s)",
    )
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' (repeatable; visible in the process list, "
        "so prefer --api-key-file)",
    )
    parser.add_argument(
        "--api-key-file",
        default=None,
        metavar="FILE",
        help="file with accepted API keys, one per line (blank lines and # comments skipped)",
    )
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="model id(s) clients send; with several, any is accepted and responses carry the "
        "first (default: the model's)",
    )
    parser.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="sequences that may wait behind a full batch before new requests get 503 "
        "(default: as many as the measured drain rate starts within --max-queue-wait)",
    )
    parser.add_argument(
        "--max-queue-wait",
        type=float,
        default=None,
        metavar="S",
        help="with the default queue bound, refuse (503) a request whose estimated wait for "
        "a running slot exceeds this (default: 300; with --disaggregated, at most half of "
        "--request-timeout)",
    )
    parser.add_argument(
        "--session-store",
        default=None,
        metavar="URL",
        help="where sessions and shared rate-limit counters live: redis://host:6379/0 or "
        "sqlite:///path.db (default: an SQLite file in the user data dir)",
    )
    parser.add_argument(
        "--rate-limit-rpm",
        type=float,
        default=None,
        metavar="N",
        help="requests per minute per API key (default: unlimited)",
    )
    parser.add_argument(
        "--rate-limit-tpm",
        type=float,
        default=None,
        metavar="N",
        help="tokens (prompt + max_tokens) per minute per API key (default: unlimited)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=int,
        default=10,
        help="seconds Ctrl-C waits for in-flight requests before ending them with a retryable "
        "error (SSE error event, gRPC UNAVAILABLE)",
    )
    parser.add_argument(
        "--no-ui",
        dest="web_ui",
        action="store_false",
        help="do not serve the web chat at / and the cluster dashboard at /dashboard",
    )
    parser.add_argument(
        "--metrics-prefix",
        choices=("duet", "vllm"),
        default="duet",
        help="duet: metrics under duet: names; vllm: also under vLLM's vllm: names, for its "
        "Grafana dashboard and gateways that read them (default: %(default)s)",
    )
    parser.add_argument(
        "--metrics-open",
        action="store_true",
        help="serve GET /metrics without an API key (Prometheus scrapers and autoscalers send "
        "none); every other route still needs one",
    )
    parser.add_argument(
        "--otlp-endpoint",
        default=None,
        metavar="HOST:PORT",
        help="export each request's OpenTelemetry trace (router, prefill, KV transfer, decode) "
        "over OTLP/gRPC to this collector (default: no tracing)",
    )
    _add_queue_flags(parser)
    _add_http_limit_flags(parser)
    _add_chat_flags(parser)
    add_engine_flags(parser)
    add_cluster_arguments(parser)
    parser.set_defaults(run=run, command_parser=parser)
    return parser


def _add_http_limit_flags(parser: argparse.ArgumentParser) -> None:
    """What one REST client may cost (router/http_limits.py, docs/serving.md)."""
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        metavar="N",
        help="largest REST request body; larger ones get 413 unread (default: 1 MiB + 64 bytes "
        "per token of the model's context; file uploads have their own 32 MiB limit)",
    )
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="close a connection whose request headers take longer (default: %(default)s)",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="answer 408 to a request whose body takes longer after its headers "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=1024,
        metavar="N",
        help="open REST connections at most; more get 503 and are closed (default: %(default)s)",
    )


def _add_chat_flags(parser: argparse.ArgumentParser) -> None:
    """How chat replies are parsed into tool calls and reasoning (docs/tool_calling.md)."""
    parser.add_argument(
        "--tool-call-parser",
        default=None,
        choices=["hermes", "llama3_json", "mistral"],
        help="the model's tool-call format for tool_choice auto (default: inferred from the "
        "chat template: mistral for [TOOL_CALLS]/[INST], llama3_json for Llama 3 headers, "
        "hermes otherwise)",
    )
    parser.add_argument(
        "--reasoning-parser",
        default=None,
        choices=["qwen3", "deepseek_r1"],
        help="put <think>...</think> into reasoning_content (default: none, it stays in content)",
    )
    parser.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render a chat_template sent with a request (default: refused with a 400; a "
        "template runs on the server and can take unbounded time and memory)",
    )
    parser.add_argument(
        "--embedding-pooling",
        default="auto",
        choices=["auto", "last", "mean", "cls"],
        help="how POST /v1/embeddings pools a prompt's final hidden states: auto (default: what "
        "the model's sentence-transformers config declares, else the last token's, as vLLM "
        "pools decoder models), last, mean (every token's) or cls (the first token's)",
    )


def _add_queue_flags(parser: argparse.ArgumentParser) -> None:
    """The durable work queue behind the Batch API (docs/queue.md)."""
    parser.add_argument(
        "--queue-url",
        default=None,
        metavar="URL",
        help="where the work queue lives: redis://host:6379/0 or sqlite:///path.db "
        "(default: the --session-store backend)",
    )
    parser.add_argument(
        "--queue-lease",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds a router holds a task without renewing before another router takes it "
        "over (default: 60)",
    )
    parser.add_argument(
        "--queue-max-deliveries",
        type=int,
        default=3,
        metavar="N",
        help="deliveries without a result before a task is dead-lettered (default: 3)",
    )
    parser.add_argument(
        "--queue-event-ttl",
        type=float,
        default=24 * 3600.0,  # session_store.DEFAULT_EVENT_TTL_S (importing it loads redis)
        metavar="S",
        help="seconds a background request's event log (what its stream replays) lives after "
        "its last event (default: 86400)",
    )
    parser.add_argument(
        "--queue-retention",
        type=float,
        default=30 * 24 * 3600.0,  # session_store.DEFAULT_RETENTION_S
        metavar="S",
        help="seconds the work queue keeps results, dead letters, batches, and files that name "
        "no expiry of their own, after their last write (default: 2592000, 30 days)",
    )


def run(args: argparse.Namespace) -> int:
    # Everything that can be wrong with the flags fails before the (slow) model load.
    parser = args.command_parser
    router = _router_config(args, _read_api_keys(args))
    if args.disaggregated:  # the workers' configs are checked instead, each with its role's
        # parallel sizes (check_worker_configs)
        from duet.cli.serve_cluster import check_worker_configs, serve_disaggregated

        engine = given_engine_flags(args)
        try:
            spec = check_worker_configs(parser, args, router, engine)
            return serve_disaggregated(args, spec)
        except ValueError as e:
            raise ServeConfigError(str(e)) from e
    return _serve_here(args, router, build_config(parser, args))


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
    from duet.router.admission import DEFAULT_MAX_QUEUE_WAIT_S
    from duet.router.server import RouterConfig
    from duet.session_store import RateLimits, open_session_store

    rates = (("--rate-limit-rpm", args.rate_limit_rpm), ("--rate-limit-tpm", args.rate_limit_tpm))
    for flag, value in rates:
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ServeConfigError(f"{flag}: must be > 0 (omit it for no limit); got {value}")
    max_queue_wait = args.max_queue_wait
    if max_queue_wait is None:
        max_queue_wait = DEFAULT_MAX_QUEUE_WAIT_S
        if args.disaggregated:  # the wait must leave time for the request itself
            max_queue_wait = min(max_queue_wait, args.request_timeout / 2)
    try:
        config = RouterConfig(
            host=args.host,
            port=args.port,
            grpc_port=args.grpc_port,
            api_keys=tuple(api_keys),
            max_queued_requests=args.max_queued_requests,
            max_queue_wait_s=max_queue_wait,
            session_store_url=args.session_store,
            rate_limits=RateLimits(args.rate_limit_rpm, args.rate_limit_tpm),
            shutdown_timeout_s=args.shutdown_timeout,
            queue_url=args.queue_url,
            queue_lease_s=args.queue_lease,
            queue_max_deliveries=args.queue_max_deliveries,
            queue_event_ttl_s=args.queue_event_ttl,
            queue_retention_s=args.queue_retention,
            tool_call_parser=args.tool_call_parser,
            embedding_pooling=args.embedding_pooling,
            reasoning_parser=args.reasoning_parser,
            trust_request_chat_template=args.trust_request_chat_template,
            web_ui=args.web_ui,
            metrics_prefix=args.metrics_prefix,
            metrics_open=args.metrics_open,
            otlp_endpoint=args.otlp_endpoint,
            max_body_bytes=args.max_body_bytes,
            header_timeout_s=args.header_timeout,
            body_timeout_s=args.body_timeout,
            max_connections=args.max_connections,
        )
        open_session_store(config.session_store_url)  # a bad URL fails here, naming the flag
    except ValueError as e:
        raise ServeConfigError(str(e)) from e
    return config


def _serve_here(args: argparse.Namespace, router: RouterConfig, config: EngineConfig) -> int:
    """One engine in this process behind the REST and gRPC servers, until Ctrl-C or SIGTERM."""
    from duet.engine import AsyncEngine
    from duet.engine.heap import freeze_startup_heap
    from duet.router.server import RouterServer, bind_rest_socket, check_grpc_port

    try:
        check_grpc_port(router.host, router.grpc_port)
        rest_socket = bind_rest_socket(router.host, router.port)
    except OSError as e:
        raise ServeConfigError(str(e)) from e
    log = logging.getLogger("duet.serve")
    # uvicorn handles SIGINT/SIGTERM with a graceful shutdown, then re-raises the signal through
    # the handler that was installed before it: make SIGTERM, like SIGINT, an exception here so
    # both end in the `finally` below (also while the model is still loading).
    previous_sigterm = signal.signal(signal.SIGTERM, _raise_terminated)
    engine = None
    try:
        engine = AsyncEngine.from_config(config)
        names = args.served_model_name or [engine.engine.model_name]
        server = RouterServer(engine, names, router, rest_socket)
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
