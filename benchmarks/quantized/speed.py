"""Single-stream decode and batch throughput of each weight format, in one run: every engine
loaded at once, timed calls alternating between them round by round (this machine is shared,
so only ratios measured in one run mean anything)."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.quantized.bandwidth import gguf_streamed_bytes, streamed_bytes_per_token
from benchmarks.quantized.llama_cpp import LlamaCppRunner
from benchmarks.quantized.methods import engine_kwargs, label
from duet.engine import LLM, SamplingParams


@dataclass
class SpeedResult:
    system: str  # "duet-bf16", "duet-int4", "llama.cpp-Q4_1", ...
    weight_bytes: int | None
    single_stream_tok_s: list[float] = field(default_factory=list)  # one per round
    batch_tok_s: list[float] = field(default_factory=list)
    streamed_bytes_per_token: int | None = None  # what one single-stream step reads
    tokens: list[list[int]] = field(default_factory=list)  # greedy outputs: single, then batch

    def summary(self) -> dict[str, Any]:
        out = asdict(self)
        del out["tokens"]
        out["single_stream_median"] = single = _median(self.single_stream_tok_s)
        out["batch_median"] = _median(self.batch_tok_s)
        out["single_stream_gbs"] = (
            single * self.streamed_bytes_per_token / 1e9
            if single and self.streamed_bytes_per_token
            else None
        )
        return out


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    high = min(vocab_size, 32000) - 1
    return [[rng.randrange(100, high) for _ in range(length)] for _ in range(count)]


def run_speed(
    model: str | None,
    methods: list[str],
    group_size: int,
    llama_cpp_files: dict[str, str],
    prompt_tokens: int,
    new_tokens: int,
    batch: int,
    rounds: int,
    threads: int | None,
    log: Callable[[str], None] = print,
    lm_head: bool = False,
    dtype: str = "bfloat16",
) -> list[SpeedResult]:
    engines: dict[str, LLM] = {}
    results: dict[str, SpeedResult] = {}
    context = prompt_tokens + new_tokens / 2  # a single-stream step's mean context
    kv_per_token = 0
    for method in methods:
        llm = LLM(model, load_progress=False, num_threads=threads, max_num_seqs=max(batch, 1),
                  enable_prefix_caching=False,
                  **engine_kwargs(method, group_size, lm_head, dtype))  # fmt: skip
        name = label(method, dtype)
        engines[name] = llm
        streamed = streamed_bytes_per_token(llm, context)
        kv_per_token = streamed - streamed_bytes_per_token(llm, 0)
        results[name] = SpeedResult(
            name, llm.engine.weight_bytes, streamed_bytes_per_token=streamed
        )
        log(f"loaded {name}: {llm.engine.weight_bytes / 2**20:.1f} MiB of weights")
    runners = {
        f"llama.cpp-{q}": LlamaCppRunner(path, threads) for q, path in llama_cpp_files.items()
    }
    for q, path in llama_cpp_files.items():  # its f16 KV: the size of duet's bf16 one
        name = f"llama.cpp-{q}"
        results[name] = SpeedResult(
            name, None, streamed_bytes_per_token=gguf_streamed_bytes(path) + kv_per_token
        )
    vocab = next(iter(engines.values())).engine.arch.vocab_size
    single = random_prompts(1, prompt_tokens, vocab, seed=0)
    batched = random_prompts(batch, prompt_tokens, vocab, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for llm in engines.values():  # warm-up: first calls build caches and pick kernels
        llm.generate(single, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    order = [*engines, *runners]
    for r in range(rounds):
        for name in order if r % 2 == 0 else reversed(order):
            if name in engines:
                llm = engines[name]
                elapsed, tokens = _timed(llm, single, params)
                results[name].single_stream_tok_s.append(new_tokens / elapsed)
                if batch > 0:
                    elapsed, more = _timed(llm, batched, params)
                    results[name].batch_tok_s.append(batch * new_tokens / elapsed)
                    tokens += more
                results[name].tokens = tokens
            else:
                elapsed = runners[name].decode(single[0], new_tokens)
                results[name].single_stream_tok_s.append(new_tokens / elapsed)
            log(f"round {r + 1} {name}: {results[name].single_stream_tok_s[-1]:.1f} tok/s")
    return list(results.values())


def _timed(
    llm: LLM, prompts: list[list[int]], params: SamplingParams
) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)  # type: ignore[arg-type]
    elapsed = time.perf_counter() - start
    return elapsed, [list(o.outputs[0].token_ids) for o in outputs]


def greedy_agreement(results: list[SpeedResult]) -> dict[str, dict[str, float]]:
    """Each duet format's greedy outputs against full precision's, over the same prompts (the
    single stream's and the batch's): the mean share of each output before the first token
    that differs, and the share of outputs equal throughout."""
    by_name = {r.system: r for r in results}
    dense = next((n for n in ("duet-bf16", "duet-fp32") if n in by_name), None)
    out: dict[str, dict[str, float]] = {}
    if dense is None or not by_name[dense].tokens:
        return out
    base = by_name[dense].tokens
    for name, r in by_name.items():
        if not name.startswith("duet-") or name == dense or len(r.tokens) != len(base):
            continue
        prefixes = []
        for ours, theirs in zip(r.tokens, base, strict=True):
            same = next(
                (i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None
            )
            prefixes.append((len(theirs) if same is None else same) / max(1, len(theirs)))
        equal = sum(p == 1.0 for p in prefixes)
        out[f"{name}/{dense}"] = {"prefix_agreement": sum(prefixes) / len(prefixes),
                                  "equal_outputs": equal, "outputs": len(prefixes)}  # fmt: skip
    return out


def ratios(results: list[SpeedResult]) -> dict[str, float]:
    """Median-over-rounds ratios: each duet format against full precision (bf16 or fp32), and
    int4/int8 against the llama.cpp GGUF of the matching type."""
    by_name = {r.system: r.summary() for r in results}
    out: dict[str, float] = {}
    dense = next((n for n in ("duet-bf16", "duet-fp32") if n in by_name), None)
    for name, summary in by_name.items():
        if dense is not None and name.startswith("duet-") and name != dense:
            base = by_name[dense]
            for key in ("single_stream_median", "batch_median"):
                if summary[key] and base[key]:
                    out[f"{name}/{dense} {key}"] = summary[key] / base[key]
    for duet, llama in (("duet-int4", "llama.cpp-Q4_1"), ("duet-gguf", "llama.cpp-Q4_1"),
                        ("duet-int8", "llama.cpp-Q8_0")):  # fmt: skip
        if duet in by_name and llama in by_name:
            key = "single_stream_median"
            out[f"{duet}/{llama} {key}"] = by_name[duet][key] / by_name[llama][key]
    return out
