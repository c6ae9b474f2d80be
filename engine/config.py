"""`EngineConfig`: the one dataclass every part of the engine reads."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

import torch

from duet.engine.device import resolve_device
from duet.engine.errors import InvalidInputError
from duet.engine.quant.config import QuantizationConfig
from duet.engine.spec_decode.config import SpeculativeConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
PREFILL_ATTENTIONS = ("auto", "triton", "sdpa")
SCHEDULING_POLICIES = ("fcfs", "priority")
LOAD_FORMATS = ("auto", "dummy")
CUDA_GRAPH_MODES = ("decode", "piecewise")


@dataclass
class EngineConfig:
    """Configuration of one engine instance. Unknown keys are an error (see `from_kwargs`)."""

    model: str | None = None
    """HF model directory, GGUF file, or hub id. None: the embedded SmolLM2-135M-Instruct."""
    tokenizer: str | None = None
    """Tokenizer path (tokenizer.json or its folder). None: taken from the model."""
    dtype: str = "auto"
    """Weights and KV dtype: auto (bf16 on GPUs and CPUs with native bf16, else fp32), float32, bfloat16, float16."""
    device: str = "auto"
    """auto (cuda when available), cpu or cuda."""
    block_size: int = 16
    """Tokens per KV block: the unit of allocation, prefix caching and transfer."""
    num_kv_blocks: int | None = None
    """KV blocks in the pool. None: derived from `kv_cache_memory_bytes`."""
    kv_cache_memory_bytes: int = 1 << 30
    """Memory budget of the KV pool when `num_kv_blocks` is None (CPU)."""
    gpu_memory_utilization: float = 0.9
    """On CUDA, when `num_kv_blocks` is None: fraction of the GPU's memory for weights,
    activations and the KV pool, which gets what a warm-up forward leaves."""
    enforce_eager: bool = False
    """Run every step eagerly. False: on CUDA with the Triton kernels, decode-only steps replay
    CUDA graphs captured at start-up per padded batch size (per rank with tensor parallelism,
    the all-reduces inside; their pool counted in the KV budget); the CPU and the torch
    backend run eagerly either way."""
    decodes: ClassVar[bool] = True
    """Whether the engine runs decode steps: a prefill worker's does not (its requests end at
    their first token), so it captures no decode graphs and reserves nothing for them (with
    `cuda_graph_mode` piecewise it captures the pieces its prompt chunks run in)."""
    cuda_graph_mode: str = "decode"
    """Which steps replay CUDA graphs (unless `enforce_eager`; CUDA and the Triton kernels
    only): decode (decode-only steps, whole) or piecewise (also every other step of up to 512
    tokens, e.g. a prefill chunk beside decodes or a speculative step, as graphs of the parts
    between the attention calls, which run eagerly: vLLM's piecewise graphs;
    engine/piecewise_graphs.py). Piecewise is not yet measured on a GPU."""
    max_num_batched_tokens: int = 2048
    """Token budget of one scheduler step (prefill chunks + decodes)."""
    max_num_seqs: int = 128
    """Most requests running at once."""
    max_model_len: int | None = None
    """Longest prompt + output. None: the model's context length."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prefixes (chained hashes of full blocks)."""
    deterministic: bool | None = None
    """A row's result does not depend on its batch (docs/determinism.md). On the CPU every
    matrix product runs on enough rows for that (costs single-stream decode time); on CUDA the
    linears, LM head and RMSNorms run as fixed-tile Triton kernels and decode attention without
    split-K. False: as few rows as the batch has, cuBLAS and split-K (faster; output may then
    depend on the batch). None: on for the CPU, off on CUDA, where it measured too costly to
    leave on (H100, Llama-8B shapes: prefill 1.7x, decode steps 1.15-1.25x the time)."""
    scheduling_policy: str = "fcfs"
    """fcfs, or priority (lower `priority` value runs first, ties by arrival)."""
    tensor_parallel_size: int = 1
    """Ranks one model is sharded across, 1 to the model's query heads (docs/parallelism.md): an
    engine started here runs rank 0 and starts the others as child processes."""
    pipeline_parallel_size: int = 1
    """Pipeline stages the model's layers are split into, 1 to its layers, each stage
    `tensor_parallel_size` ranks (docs/parallelism.md): an engine started here runs rank 0 and
    starts the other stages' ranks as child processes. Aggregated engines only, for now."""
    expert_parallel_size: int = 1
    """Ranks a mixture's routed experts are sharded over, whole (docs/parallelism.md): 1 (each
    rank holds a slice of every expert) or `tensor_parallel_size` (each rank holds 1/N of the
    experts, whole; attention stays tensor-parallel), as vLLM's `--enable-expert-parallel`;
    with `data_parallel_size` D > 1, D (the experts exchanged between the D ranks)."""
    data_parallel_size: int = 1
    """Ranks that each run attention on their own requests (own scheduler and KV cache) and
    exchange a mixture's routed experts by all-to-all (engine/data_parallel.py; vLLM's and
    SGLang's DP attention): 1, or D > 1 with `expert_parallel_size` D, at TP and PP 1, a
    mixture of experts; the offline `LLM` and `duet serve`, not the disaggregated workers."""
    num_threads: int | None = None
    """CPU threads for torch. None: torch's default."""
    seed: int = 0
    """Seeds the sampling seeds of requests that bring none (same engine seed and arrivals:
    same text)."""
    attention_backend: str = "auto"
    """auto (Triton kernels on CUDA, the C++ decode kernel on CPU), triton (on CPU only under
    TRITON_INTERPRET=1, for tests), or torch (the reference path)."""
    prefill_attention: str = "auto"
    """With the Triton backend: triton (the paged prefill kernel for every prompt chunk) or
    sdpa (a step whose chunks are all whole prompts with no cached prefix runs torch's
    scaled_dot_product_attention, FlashAttention on a GPU, on each prompt's own K/V; other
    steps as triton). sdpa is not batch-invariant with the decode kernel: not with
    `deterministic`. auto: sdpa on CUDA unless deterministic (the faster on the H200,
    2026-11-30: docs/gpu.md), else triton."""
    load_progress: bool = True
    """Show a progress bar while loading weights."""
    load_format: str = "auto"
    """auto: the checkpoint's weights (safetensors or GGUF); dummy: random weights made on the
    device from `model`'s config.json alone (a folder with one; no checkpoint needed), for
    benchmarks. Without a tokenizer.json there, a byte-level tokenizer (docs/engine.md)."""
    quantization: str | None = None
    """Weight-only quantization at load: int8 (per output channel), int4 (groups of
    `quantization_group_size`) or gguf (a GGUF file's own Q8_0/Q4_0/Q4_1/Q4_K/Q6_K tensors).
    None: full-precision weights (docs/quantization.md)."""
    quantization_group_size: int = 32
    """int4: input columns per scale: 32, 64 or 128."""
    quantization_symmetric: bool = False
    """int4: symmetric groups (a scale each) instead of asymmetric (a scale and an offset)."""
    quantize_lm_head: bool = False
    """Quantize the LM head as well as the projections (a tied embedding table with it)."""
    hf_overrides: dict[str, Any] = field(default_factory=dict)
    """Values that replace fields of the model's config.json (e.g. to shrink max_position_embeddings)."""
    speculative_config: dict[str, Any] | None = None
    """Speculative decoding, as vLLM spells it, e.g. {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5} (docs/speculative_decoding.md). None: off."""

    def __post_init__(self) -> None:
        self.quantization_config()  # validates the quantization fields
        if self.dtype not in DTYPES:
            raise InvalidInputError(
                "dtype", f"must be one of {', '.join(DTYPES)}; got {self.dtype!r}"
            )
        if self.device not in DEVICES:
            raise InvalidInputError(
                "device", f"must be one of {', '.join(DEVICES)}; got {self.device!r}"
            )
        _check_min("block_size", self.block_size, 1)
        if self.num_kv_blocks is not None:
            _check_min("num_kv_blocks", self.num_kv_blocks, 1)
        _check_min("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1)
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, int | float) or not 0 < util <= 1:
            raise InvalidInputError(
                "gpu_memory_utilization", f"must be a number in (0, 1]; got {util!r}"
            )
        if self.deterministic is not None and not isinstance(self.deterministic, bool):
            raise InvalidInputError(
                "deterministic", f"must be true, false or unset; got {self.deterministic!r}"
            )
        if not isinstance(self.enforce_eager, bool):
            raise InvalidInputError(
                "enforce_eager", f"must be true or false; got {self.enforce_eager!r}"
            )
        _check_min("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_min("max_num_seqs", self.max_num_seqs, 1)
        if self.max_model_len is not None:
            _check_min("max_model_len", self.max_model_len, 1)
        _check_min("tensor_parallel_size", self.tensor_parallel_size, 1)
        _check_min("pipeline_parallel_size", self.pipeline_parallel_size, 1)
        _check_min("expert_parallel_size", self.expert_parallel_size, 1)
        _check_min("data_parallel_size", self.data_parallel_size, 1)
        if self.data_parallel_size > 1:
            self._check_data_parallel()
        elif self.expert_parallel_size not in (1, self.tensor_parallel_size):
            raise InvalidInputError(
                "expert_parallel_size",
                f"must be 1 or tensor_parallel_size ({self.tensor_parallel_size}): the routed "
                f"experts are sharded over the tensor-parallel ranks; got {self.expert_parallel_size}",
            )
        if self.cuda_graph_mode not in CUDA_GRAPH_MODES:
            raise InvalidInputError(
                "cuda_graph_mode",
                f"must be one of {', '.join(CUDA_GRAPH_MODES)}; got {self.cuda_graph_mode!r}",
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise InvalidInputError(
                "attention_backend",
                f"must be one of {', '.join(ATTENTION_BACKENDS)}; got {self.attention_backend!r}",
            )
        if self.prefill_attention not in PREFILL_ATTENTIONS:
            raise InvalidInputError(
                "prefill_attention",
                f"must be one of {', '.join(PREFILL_ATTENTIONS)}; got {self.prefill_attention!r}",
            )
        if self.load_format not in LOAD_FORMATS:
            raise InvalidInputError(
                "load_format",
                f"must be one of {', '.join(LOAD_FORMATS)}; got {self.load_format!r}",
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise InvalidInputError(
                "scheduling_policy",
                f"must be one of {', '.join(SCHEDULING_POLICIES)}; got {self.scheduling_policy!r}",
            )

        self.speculative()  # a bad key or value names itself now, not at engine start

    def _check_data_parallel(self) -> None:
        dp = self.data_parallel_size
        if self.tensor_parallel_size != 1 or self.pipeline_parallel_size != 1:
            raise InvalidInputError(
                "data_parallel_size",
                f"runs each rank's attention whole: tensor_parallel_size and "
                f"pipeline_parallel_size must be 1 with it; got {dp} with "
                f"{self.tensor_parallel_size} and {self.pipeline_parallel_size}",
            )
        if self.expert_parallel_size != dp:
            raise InvalidInputError(
                "expert_parallel_size",
                f"must equal data_parallel_size ({dp}): the routed experts are exchanged "
                f"between the data-parallel ranks; got {self.expert_parallel_size}",
            )
        if self.speculative_config is not None:
            raise InvalidInputError(
                "data_parallel_size",
                f"must be 1 with speculative decoding (its extra forward passes would leave the "
                f"ranks' expert exchanges out of step); got {dp}",
            )
        # (a prefill worker captures no decode graphs, and no pieces under the exchange)
        if self.resolve_device().type == "cuda" and not self.enforce_eager and self.decodes:
            raise InvalidInputError(
                "data_parallel_size",
                f"needs enforce_eager on CUDA (a captured graph cannot hold the exchange's "
                f"varying all-to-all sizes); got {dp} without it",
            )

    def speculative(self) -> SpeculativeConfig | None:
        """`speculative_config` parsed and validated (None when off)."""
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.from_dict(self.speculative_config)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> Self:
        """Build a config, refusing keys that are not fields (never silently dropped)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise InvalidInputError(
                unknown[0], f"unknown config key; known keys are {', '.join(sorted(names))}"
            )
        return cls(**kwargs)

    def quantization_config(self) -> QuantizationConfig | None:
        """The quantization fields as one `QuantizationConfig` (None: not quantized)."""
        for name in ("quantization_symmetric", "quantize_lm_head"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidInputError(name, f"must be true or false; got {getattr(self, name)!r}")
        if self.quantization is None:
            return None
        return QuantizationConfig(
            self.quantization,
            self.quantization_group_size,
            self.quantization_symmetric,
            self.quantize_lm_head,
        )

    @property
    def num_ranks(self) -> int:
        """Ranks of one engine: tensor x pipeline x data parallel."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size

    def resolve_device(self, rank: int = 0) -> torch.device:
        """This rank's device (`rank`: its global rank, stage x TP + TP rank), indexed on CUDA
        (`engine.device`)."""
        return resolve_device(self.device, rank)

    def device_reservations(self, block_bytes: int, max_model_len: int) -> dict[str, int]:
        """GPU memory (name -> bytes) that the KV pool sized from free memory must leave for
        consumers the warm-up does not see. None for an engine on its own; the worker configs
        add KV transfer's staging buffers and NCCL communicators."""
        return {}

    def resolve_deterministic(self, device: torch.device) -> bool:
        """`deterministic`, or when unset: on for the CPU, off on CUDA."""
        if self.deterministic is not None:
            return self.deterministic
        return device.type != "cuda"

    def resolve_prefill_attention(self, device: torch.device, deterministic: bool) -> str:
        """`prefill_attention`, or for auto: sdpa on CUDA unless deterministic, else triton."""
        if self.prefill_attention != "auto":
            return self.prefill_attention
        return "sdpa" if device.type == "cuda" and not deterministic else "triton"

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype != "auto":
            return getattr(torch, self.dtype)
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def _check_min(name: str, value: int, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InvalidInputError(name, f"must be an integer >= {minimum}; got {value!r}")


@functools.cache
def cpuinfo_field(name: str) -> str:
    """The first `name: value` line's value in /proc/cpuinfo ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return ""


def cpu_has_native_bf16() -> bool:
    """True on CPUs with AVX512-BF16 or AMX, where bf16 matmuls are native."""
    flags = cpuinfo_field("flags").split()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_vendor() -> str:
    """The CPU's vendor id ("GenuineIntel", "AuthenticAMD"; "" where unknown)."""
    return cpuinfo_field("vendor_id")


def reports_deterministic(
    device: torch.device,
    linears_invariant: bool,
    cpu_prefill_kernel: bool,
    triton_attention: bool,
    tp_size: int,
    latent_attention: bool = False,
) -> bool:
    """What an engine reports as `deterministic` (docs/determinism.md). `linears_invariant`:
    the loader's verdict on the matrix products (CPU: probed invariant with padding; CUDA: the
    Triton matmuls and norms are in, deterministic mode, nothing quantized).
    - CPU: that, and the C++ prefill kernel runs (it shares the decode kernel's order).
    - CUDA: that, the Triton attention kernels (the torch path's SDPA is not invariant), and
      one rank (NCCL picks its all-reduce algorithm by message size, so a row's sum may
      depend on the batch's token count).
    `latent_attention`: a multi-head latent attention model, whose attention (the torch
    reference, engine/model/latent_attention.py) is batch-invariant by construction on any device."""
    if device.type == "cuda":
        return linears_invariant and (triton_attention or latent_attention) and tp_size == 1
    return linears_invariant and (cpu_prefill_kernel or latent_attention)
