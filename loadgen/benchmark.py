"""`duet bench serve`: a serving benchmark against any OpenAI-compatible server.

Seeded random-token prompts of exact lengths, Poisson arrivals at each `--rate`, every request
streamed through the REST API and timed at the client: TTFT, TPOT, ITL and end-to-end latency
percentiles, request and token throughput, and goodput (requests/s that met `--slo-ttft-ms` and
`--slo-tpot-ms`). Writes a JSON of every request and the aggregates, and a PNG (latency CDFs,
goodput vs rate). Run the same command against two servers (say aggregated and disaggregated
`duet serve`) and they get the identical requests at the identical times; `--compare` draws
their result files into one figure.

    duet bench serve --url http://127.0.0.1:8000 --rate 1,2,4 --num-requests 64 \\
        --input-len-dist uniform:16:512 --output-len-dist uniform:16:256 \\
        --slo-ttft-ms 2000 --slo-tpot-ms 200 --label aggregated
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx2

    from duet.loadgen.client import Endpoint, RequestResult

DEFAULT_RESULTS_DIR = Path("benchmarks/results")
SERVER_CHECK_TIMEOUT_S = 10.0
"""Bound on the first `GET /v1/models`, which tells a server that is down from a slow one."""


class BenchError(Exception):
    """The benchmark cannot run (server down, bad flag combination); the message says why."""


def run_from_args(args: argparse.Namespace) -> int:
    """Run the benchmark the flags describe; 0 on success, 1 if a rate completed nothing, 2 for
    an unusable setup (printed without a traceback)."""
    try:
        if args.compare:
            return _compare(args)
        return asyncio.run(_run(args))
    except BenchError as e:
        print(f"duet bench serve: error: {e}", file=sys.stderr)
        return 2


def _require(module: str, why: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise BenchError(f"{why} needs {module}: pip install 'duet-serve[bench]'")


async def _run(args: argparse.Namespace) -> int:
    _require("httpx2", "sending requests")
    if not args.no_plot:
        _require("matplotlib", "the plot (or pass --no-plot)")
    import httpx2

    from duet.loadgen.batch_load import BatchLoadError, batch_lines, stop_batch, submit_batch
    from duet.loadgen.client import Endpoint
    from duet.loadgen.metrics import SLO, format_table, summarize
    from duet.loadgen.workload import allowed_token_ids, arrival_offsets, build_workload

    if args.endpoint == "chat" and args.prompt_format == "ids":
        raise BenchError("--prompt-format ids: chat messages are text; use --endpoint completions")
    text_prompts = args.endpoint == "chat" or args.prompt_format == "text"
    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms)
    limits = httpx2.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx2.Timeout(args.request_timeout_s)
    async with httpx2.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        model = await _check_server(client, args)  # before the slow tokenizer load
        tokenizer = _open_tokenizer(args.tokenizer)
        allowed = allowed_token_ids(tokenizer)
        endpoint = Endpoint(args.url, args.endpoint, model, args.api_key, args.temperature)

        def prompts_of(run_index: int) -> tuple[list[Any], list[list[int] | str]]:
            specs = build_workload(
                args.num_requests,
                args.seed,
                args.input_len_dist,
                args.output_len_dist,
                allowed,
                run_index,
            )
            prompts: list[list[int] | str] = [
                tokenizer.decode(s.prompt_ids) if text_prompts else s.prompt_ids for s in specs
            ]
            return specs, prompts

        await _warm_up(client, endpoint, prompts_of(-1), args.num_warmup, args.request_timeout_s)
        batch_id = None
        if args.with_batch is not None:
            data = batch_lines(args.with_batch, model, args.batch_output_len)
            try:
                batch_id = await submit_batch(client, args.url, args.api_key, data)
            except BatchLoadError as e:
                raise BenchError(f"--with-batch: {e}") from None
            print(f"batch {batch_id}: {args.with_batch} lines running beside the load", flush=True)
        runs: list[dict[str, Any]] = []
        for i, rate in enumerate(args.rate):
            specs, prompts = prompts_of(i)
            offsets = arrival_offsets(args.num_requests, rate, args.seed)
            print(f"rate {_rate_json(rate)} req/s: sending {len(specs)} requests", flush=True)
            results, duration_s = await _run_rate(
                client, endpoint, specs, prompts, offsets, args.request_timeout_s,
                args.max_concurrency,
            )  # fmt: skip
            summary = summarize(results, duration_s, slo)
            print(
                f"  {summary['completed']} completed, {summary['failed']} failed in {duration_s:.1f}s"
            )
            for error, count in summary["errors"].items():
                print(f"  {count} x {error}")
            runs.append(
                {
                    "rate": _rate_json(rate),
                    "summary": summary,
                    "requests": [r.to_json() for r in results],
                }
            )
        config = _config(args, model)
        if batch_id is not None:
            try:
                counts = await stop_batch(client, args.url, args.api_key, batch_id)
            except BatchLoadError as e:
                raise BenchError(f"--with-batch: {e}") from None
            config["batch"] = {"id": batch_id, "request_counts_at_end": counts}
            print(f"batch {batch_id}: {counts['completed']} lines done during the runs; cancelled")
    result: dict[str, Any] = {"benchmark": "serve", "config": config, "runs": runs}
    print(format_table(runs))
    _write_outputs(args, [(args.label, result)], result)
    return 0 if all(run["summary"]["completed"] for run in runs) else 1


def _open_tokenizer(path: str | None) -> Any:
    from duet.engine import ModelLoadError
    from duet.engine.tokenizer_export import open_tokenizer

    try:
        return open_tokenizer(path)
    except ModelLoadError as e:
        raise BenchError(f"--tokenizer: {e}") from e


async def _check_server(client: httpx2.AsyncClient, args: argparse.Namespace) -> str:
    """The model name to send; a clear BenchError when the server is down or refuses us."""
    import httpx2

    url = args.url.rstrip("/") + "/v1/models"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    deadline = time.monotonic() + args.wait_for_server_s
    while True:  # retried until --wait-for-server-s: a server may still be loading its model
        try:
            response = await client.get(url, headers=headers, timeout=SERVER_CHECK_TIMEOUT_S)
            if response.status_code != 503:
                break
            problem = f"{url} answered 503"
        except httpx2.HTTPError as e:
            problem = f"cannot reach {args.url} ({type(e).__name__}: {e})"
        if time.monotonic() >= deadline:
            waited = f" for {args.wait_for_server_s:g}s" if args.wait_for_server_s else ""
            raise BenchError(
                f"--url: {problem}{waited}; is `duet serve` running there? "
                "(--wait-for-server-s waits for one that is starting)"
            )
        await asyncio.sleep(1.0)
    if response.status_code in (401, 403):
        raise BenchError(f"--api-key: {url} answered {response.status_code}: {response.text[:200]}")
    if response.status_code != 200:
        raise BenchError(f"--url: {url} answered {response.status_code}: {response.text[:200]}")
    try:
        served = [m["id"] for m in response.json()["data"]]
    except (ValueError, KeyError, TypeError):
        raise BenchError(f"--url: {url} did not answer an OpenAI model list") from None
    if args.model is not None:
        if args.model not in served:
            raise BenchError(
                f"--model: {args.model!r} is not served at {args.url}; served: {served}"
            )
        return str(args.model)
    if not served:
        raise BenchError(f"--url: {args.url} serves no model")
    return str(served[0])


async def _warm_up(
    client: httpx2.AsyncClient,
    endpoint: Endpoint,
    workload: tuple[list[Any], list[list[int] | str]],
    num: int,
    timeout_s: float,
) -> None:
    """Requests before the timed runs (first-use kernel builds, allocator growth); the first
    failure stops the benchmark with the server's message, e.g. a prompt over the context."""
    from duet.loadgen.client import RequestResult, send_request

    specs, prompts = workload
    for i in range(min(num, len(specs))):
        result = RequestResult(i, specs[i].input_len, specs[i].output_len)
        await send_request(client, endpoint, prompts[i], result, time.perf_counter(), timeout_s)
        if result.error is not None:
            raise BenchError(f"warm-up request failed: {result.error}")


async def _run_rate(
    client: httpx2.AsyncClient,
    endpoint: Endpoint,
    specs: Sequence[Any],
    prompts: Sequence[list[int] | str],
    offsets: Sequence[float],
    timeout_s: float,
    max_concurrency: int | None = None,
) -> tuple[list[RequestResult], float]:
    """Send request i at `offsets[i]` (one task each, so a slow server does not delay later
    arrivals), or, with `max_concurrency`, once fewer than that many are in flight (as
    vLLM's `bench serve --max-concurrency`; latencies count from the actual send). Every
    request is bounded by `timeout_s`, so this ends."""
    from duet.loadgen.client import RequestResult, send_request

    start = time.perf_counter()
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def send(prompt: list[int] | str, result: RequestResult) -> RequestResult:
        if slots is None:
            return await send_request(client, endpoint, prompt, result, start, timeout_s)
        async with slots:
            return await send_request(client, endpoint, prompt, result, start, timeout_s)

    tasks = []
    for i, (spec, prompt, offset) in enumerate(zip(specs, prompts, offsets, strict=True)):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        result = RequestResult(i, spec.input_len, spec.output_len)
        tasks.append(asyncio.create_task(send(prompt, result)))
    results = list(await asyncio.gather(*tasks))
    return results, time.perf_counter() - start


def _rate_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def _config(args: argparse.Namespace, model: str) -> dict[str, Any]:
    return {
        "label": args.label,
        "url": args.url,
        "endpoint": args.endpoint,
        "model": model,
        "tokenizer": args.tokenizer or "embedded SmolLM2-135M-Instruct",
        "prompt_format": "text" if args.endpoint == "chat" else args.prompt_format or "ids",
        "rates": [_rate_json(r) for r in args.rate],
        "num_requests": args.num_requests,
        "input_len_dist": str(args.input_len_dist),
        "output_len_dist": str(args.output_len_dist),
        "seed": args.seed,
        "slo_ttft_ms": args.slo_ttft_ms,
        "slo_tpot_ms": args.slo_tpot_ms,
        "temperature": args.temperature,
        "request_timeout_s": args.request_timeout_s,
        "num_warmup": args.num_warmup,
        "max_concurrency": args.max_concurrency,
        "with_batch": args.with_batch,
        "batch_output_len": args.batch_output_len if args.with_batch else None,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
    }


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def _write_outputs(
    args: argparse.Namespace,
    plotted: Sequence[tuple[str, dict[str, Any]]],
    result: dict[str, Any] | None,
) -> None:
    stem = "serve" + (f"_{args.label}" if args.label else "")
    json_path = args.result_json or DEFAULT_RESULTS_DIR / f"{stem}.json"
    if result is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {json_path}")
    if not args.no_plot:
        from duet.loadgen.plot import plot_results

        plot_path = args.plot or (json_path.with_suffix(".png") if result else Path(f"{stem}.png"))
        print(f"wrote {plot_results(plotted, plot_path)}")


def _compare(args: argparse.Namespace) -> int:
    from duet.loadgen.metrics import format_table

    loaded = []
    for path in args.compare:
        try:
            res = json.loads(path.read_text())
            label = res["config"].get("label") or path.stem
            runs = res["runs"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise BenchError(
                f"--compare: {path} is not a `duet bench serve` result ({type(e).__name__}: {e})"
            ) from None
        print(f"{label} ({path}):\n{format_table(runs)}\n")
        loaded.append((label, res))
    _warn_if_workloads_differ(loaded)
    if args.no_plot:
        return 0
    if args.plot is None:
        raise BenchError("--compare: give --plot PATH for the combined figure (or --no-plot)")
    _require("matplotlib", "the plot")
    _write_outputs(args, loaded, None)
    return 0


# What must agree for two result files to be a fair comparison (the plot's title shows the first).
_WORKLOAD_KEYS = (
    "endpoint",
    "prompt_format",
    "num_requests",
    "input_len_dist",
    "output_len_dist",
    "seed",
    "slo_ttft_ms",
    "slo_tpot_ms",
    "temperature",
)


def _warn_if_workloads_differ(loaded: Sequence[tuple[str, dict[str, Any]]]) -> None:
    configs = [res["config"] for _, res in loaded]
    differ = [k for k in _WORKLOAD_KEYS if len({json.dumps(c.get(k)) for c in configs}) > 1]
    if differ:
        print(
            f"duet bench serve: warning: the results ran different workloads ({', '.join(differ)}); "
            "the plot's title describes the first",
            file=sys.stderr,
        )
