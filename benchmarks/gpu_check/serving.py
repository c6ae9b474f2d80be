"""`make gpu-check`'s serving step: `duet serve` with a Llama-3.1-8B-shaped model of dummy
weights (config.json and a byte-level tokenizer written here: no checkpoint), driven by
`duet bench serve` at several concurrencies of fixed-length requests, and the one-stream
inter-token latency against the decode step's HBM roofline.

The same code serves a tiny model on the CPU in the tests (`ServeSettings.cpu_smoke`), so the
GPU run is the last step to run, not the first."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_check.processes import Child, StepTimeout, child_env, run_bounded
from duet.engine.dummy_weights import hf_weight_shapes, save_byte_level_tokenizer
from duet.engine.kv_cache_spec import kv_cache_spec
from duet.engine.model import ModelArchConfig

LLAMA_8B: dict[str, Any] = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    max_position_embeddings=131072, rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
)  # fmt: skip
"""Llama-3.1-8B's config.json, as far as the engine reads it."""
TINY: dict[str, Any] = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512, hidden_size=64,
    intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=2,
)  # fmt: skip


@dataclass(frozen=True)
class ServeSettings:
    """What the serving step runs."""

    config: dict[str, Any] = field(default_factory=lambda: dict(LLAMA_8B))
    concurrencies: tuple[int, ...] = (1, 16, 64)
    requests_per_stream: tuple[int, ...] = (8, 3, 2)
    """Requests per concurrency, as multiples of it (1 stream: 8 requests; 64: 128)."""
    input_len: int = 512
    output_len: int = 128
    serve_flags: tuple[str, ...] = ("--max-model-len", "2048", "--max-num-seqs", "64")
    request_timeout_s: float = 120.0
    piecewise: tuple[int, ...] = (16,)
    """Concurrencies run again on a second server with `--cuda-graph-mode piecewise` (the
    steps that take in a new prompt's chunk beside decodes in pieces; docs/gpu.md), at the
    same requests per stream; (): not run."""

    @classmethod
    def quick(cls) -> ServeSettings:
        return cls(concurrencies=(1, 16), requests_per_stream=(4, 2), piecewise=())

    @classmethod
    def cpu_smoke(cls) -> ServeSettings:
        """A tiny model on the CPU (tests): the same steps, numbers that mean nothing."""
        return cls(
            config=dict(TINY), concurrencies=(1, 4), requests_per_stream=(2, 1), input_len=16,
            output_len=6, request_timeout_s=60.0, piecewise=(4,),
            serve_flags=("--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "128",
                         "--max-num-seqs", "4"),
        )  # fmt: skip


def write_dummy_model(folder: Path, config: dict[str, Any]) -> Path:
    """config.json and the byte-level tokenizer (what `duet serve --load-format dummy` and
    `duet bench serve --tokenizer` read); no weights."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    save_byte_level_tokenizer(str(folder), int(config["vocab_size"]))
    return folder


def decode_bytes_per_step(config: dict[str, Any], context: int, dtype: torch.dtype) -> int:
    """Bytes one decode step of one request reads at least: every weight but the embedding
    table (looked up, not read whole; a tied one is read as the LM head), and the KV of
    `context` tokens."""
    arch = ModelArchConfig.from_hf_config(config)
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = 0
    for name, shape in hf_weight_shapes(arch):
        if name == "model.embed_tokens.weight" and not arch.tie_word_embeddings:
            continue
        size = 1
        for x in shape:
            size *= x
        numel += size
    spec = kv_cache_spec(arch, arch.num_key_value_heads)
    kv = context * arch.num_hidden_layers * spec.values_per_token()
    return (numel + kv) * itemsize


def copy_bandwidth_gbs(device: torch.device, num_bytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth (read + write bytes), as benchmarks.kernels.gpu
    measures it: the roofline's denominator."""
    seconds = _copy_seconds(device, num_bytes)  # its buffers are gone once it returns
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the server this step starts sizes its KV pool from free memory
    return 2 * num_bytes / seconds / 1e9


def _copy_seconds(device: torch.device, num_bytes: int) -> float:
    from benchmarks.kernels.gpu import timed

    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return timed(lambda: dst.copy_(src), device, iters=10)


START_UP_PATTERNS = {
    "load_s": r"loaded \S+ \(.*?\) in ([\d.]+)s",
    "kv_blocks": r"KV pool (\d+) blocks x",
    "graph_capture_s": r"CUDA graphs: decode batches of [\d,]+ requests captured in ([\d.]+) s",
    "graph_pool_gib": r"graph pool ([\d.]+) GiB",
    "graph_pool_reserved_gib": r"GPU memory: .*cuda_graphs ([\d.]+)",
    "piecewise_capture_s": r"pieces, \d+ sizes captured in ([\d.]+) s",
    "piecewise_pool_gib": r"pieces, .* graph pool ([\d.]+) GiB",
}


def start_up_facts(log: str) -> dict[str, float | None]:
    """What `duet serve`'s start-up log says about loading, the KV pool and the CUDA graphs
    (None: not logged, e.g. no graphs on the CPU)."""
    facts: dict[str, float | None] = {}
    for key, pattern in START_UP_PATTERNS.items():
        match = re.search(pattern, log)
        facts[key] = float(match[1]) if match else None
    return facts


ENGINE_COUNTERS = {"steps": "duet:engine_steps_total",
                   "step_s": "duet:engine_step_seconds_total",
                   "execute_s": "duet:engine_execute_seconds_total"}  # fmt: skip
"""The engine's step counters on `/metrics` (docs/observability.md)."""


def engine_counters(metrics: str) -> dict[str, float]:
    """`ENGINE_COUNTERS`' values in a `/metrics` text (a missing one: 0)."""
    out = {}
    for key, name in ENGINE_COUNTERS.items():
        match = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", metrics, re.MULTILINE)
        out[key] = float(match.group(1)) if match else 0.0
    return out


def engine_share(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """One level's engine steps: how many, and per step the wall time, the model runner's
    share (on a GPU with its wait for the device) and the engine's host work besides."""
    steps = after["steps"] - before["steps"]
    if steps <= 0:
        return {"steps": 0}
    step_s = after["step_s"] - before["step_s"]
    execute_s = after["execute_s"] - before["execute_s"]
    return {"steps": int(steps), "step_ms": step_s / steps * 1e3,
            "execute_ms": execute_s / steps * 1e3,
            "host_ms": (step_s - execute_s) / steps * 1e3}  # fmt: skip


def _scrape(url: str, wait_s: float = 30.0) -> dict[str, float]:
    """The engine counters on the server's `/metrics`; a refused connection (its REST starts
    after the gRPC line the step waits for) is retried for `wait_s`, as `duet bench serve`
    waits for the server."""
    give_up = time.monotonic() + wait_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
                return engine_counters(reply.read().decode())
        except urllib.error.URLError:
            if time.monotonic() > give_up:
                raise
            time.sleep(0.2)


def level_summary(result: dict[str, Any]) -> dict[str, Any]:
    """The numbers the report keeps from one `duet bench serve` result JSON (one rate)."""
    s = result["runs"][0]["summary"]
    return {
        "completed": s["completed"], "failed": s["failed"], "errors": s["errors"],
        "duration_s": s["duration_s"], "output_tok_s": s["output_throughput"],
        "ttft_ms_p50": s["ttft_ms"]["p50"], "ttft_ms_p99": s["ttft_ms"]["p99"],
        "itl_ms_p50": s["itl_ms"]["p50"], "itl_ms_p99": s["itl_ms"]["p99"],
        "tpot_ms_p50": s["tpot_ms"]["p50"],
    }  # fmt: skip


def run_serving(
    settings: ServeSettings, workdir: Path, deadline: float, port: int, device: torch.device
) -> dict[str, Any]:
    """Start `duet serve` on `port`, bench it at every concurrency, stop it; then, for
    `settings.piecewise`, the same with `--cuda-graph-mode piecewise`. Returns the step's
    report; raises `StepTimeout` when `deadline` (monotonic) passes."""
    model = write_dummy_model(workdir / "model", settings.config)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    bandwidth = copy_bandwidth_gbs(device, (1 << 30) if device.type == "cuda" else (64 << 20))
    report: dict[str, Any] = {"settings": asdict(settings), "copy_bandwidth_gbs": bandwidth}
    per_stream = dict(zip(settings.concurrencies, settings.requests_per_stream, strict=True))
    served = _serve_and_bench(settings, model, workdir, deadline, port, per_stream, ())
    levels = served.pop("levels", [])
    report.update(served, levels=levels)
    one = next((lv for lv in levels if lv["concurrency"] == 1), None)
    if one is not None and one["itl_ms_p50"]:
        context = settings.input_len + settings.output_len // 2  # the mean over the outputs
        roofline_ms = (
            decode_bytes_per_step(settings.config, context, dtype) / (bandwidth * 1e9) * 1e3
        )
        report["one_stream"] = {
            "roofline_step_ms": roofline_ms, "mean_context": context,
            "itl_ms_p50": one["itl_ms_p50"], "roofline_fraction": roofline_ms / one["itl_ms_p50"],
        }  # fmt: skip
    failed = sum(lv["failed"] for lv in levels)
    report["ok"] = failed == 0 and len(levels) == len(settings.concurrencies)
    if settings.piecewise:
        wanted = {n: per_stream.get(n, 2) for n in settings.piecewise}
        try:
            pieces = _serve_and_bench(
                settings, model, workdir / "piecewise", deadline, port, wanted,
                ("--cuda-graph-mode", "piecewise"),
            )  # fmt: skip
        except StepTimeout as e:  # the first server's numbers stay in the report
            pieces = {"levels": [], "error": f"timed out: {e}"[-3000:]}
        pieces["ok"] = (
            "error" not in pieces
            and len(pieces["levels"]) == len(wanted)
            and not sum(lv["failed"] for lv in pieces["levels"])
        )
        report["piecewise"] = pieces
        report["ok"] = report["ok"] and pieces["ok"]
    return report


def _serve_and_bench(
    settings: ServeSettings,
    model: Path,
    workdir: Path,
    deadline: float,
    port: int,
    per_stream: dict[int, int],
    extra_flags: tuple[str, ...],
) -> dict[str, Any]:
    """One server (`settings.serve_flags` and `extra_flags`) benched at each concurrency of
    `per_stream` (concurrency -> requests per stream), then stopped: its start-up facts,
    `levels`, exit code and log tail. A failure (the server's start, a bench run) raises for
    the first server (`extra_flags` empty); for the second it is its report's `error`."""
    workdir.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{port}"
    args = ["-m", "duet.cli", "serve", "--model", str(model), "--load-format", "dummy",
            "--port", str(port), "--grpc-port", "0", "--no-ui", "--no-load-progress",
            "--session-store", f"sqlite:///{workdir / 'sessions.db'}", *settings.serve_flags,
            *extra_flags]  # fmt: skip
    started = time.monotonic()
    server = Child(args, workdir / "serve.log")
    report: dict[str, Any] = {"flags": list(extra_flags), "levels": []}
    try:
        server.wait_for_line(r"gRPC API \(duet\.v1\.Duet\) on", deadline)
        report["start_up_s"] = time.monotonic() - started
        report["start_up"] = start_up_facts(server.text())
        for i, (streams, per) in enumerate(per_stream.items()):
            out = workdir / f"bench_{streams}.json"
            bench = ["-m", "duet.cli", "bench", "serve", "--url", url, "--tokenizer", str(model),
                     "--rate", "inf", "--max-concurrency", str(streams),
                     "--num-requests", str(streams * per),
                     "--input-len-dist", f"fixed:{settings.input_len}",
                     "--output-len-dist", f"fixed:{settings.output_len}",
                     "--num-warmup", "1" if i == 0 else "0", "--seed", str(i),
                     "--request-timeout-s", str(settings.request_timeout_s),
                     "--wait-for-server-s", "30", "--result-json", str(out), "--no-plot",
                     "--label", f"gpu_check_{streams}"]  # fmt: skip
            before = _scrape(url)
            code = run_bounded(bench, deadline, workdir / f"bench_{streams}.log", child_env())
            if code != 0 or not out.exists():
                log = (workdir / f"bench_{streams}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"duet bench serve at {streams} streams exited {code}:\n{log}")
            summary = level_summary(json.loads(out.read_text()))
            engine = engine_share(before, _scrape(url))
            report["levels"].append({"concurrency": streams, **summary, "engine": engine})
    except RuntimeError as e:  # the second server's failure is its own finding
        if not extra_flags:
            raise
        report["error"] = str(e)[-3000:]
    finally:
        report["server_exit_code"] = server.stop()
        report["server_log_tail"] = server.tail(2000)
    return report


__all__ = ["ServeSettings", "StepTimeout", "run_serving"]
