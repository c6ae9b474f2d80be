"""`ModelRunner`: owns the model and its KV cache; turns a `SchedulerOutput` into one forward
pass and a sample per request that reached the end of its tokens."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import AttentionMetadata, to_device
from engine.cuda_graphs import DecodeGraphs
from engine.errors import InvalidInputError
from engine.kernels.cpu import load_cpu_kernels
from engine.kernels.triton_runtime import triton_unusable_reason
from engine.kv_cache_manager import KVCacheManager
from engine.model import LlamaForCausalLM
from engine.sampler import Sampler, SamplerOutput
from engine.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


def kv_cache_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


def num_kv_blocks_for_gpu_memory(
    model: LlamaForCausalLM,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    gpu_memory_utilization: float,
    max_num_batched_tokens: int,
    use_triton: bool,
) -> int:
    """KV blocks that fit in `gpu_memory_utilization` of the GPU's memory once the weights (already
    loaded), memory held by other processes, and the peak activations of a warm-up forward of
    one `max_num_batched_tokens`-token prompt are accounted for. CUDA only."""
    cfg = model.config
    num_tokens = max_num_batched_tokens
    warm_blocks = -(-num_tokens // block_size)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    caches = [
        torch.zeros(
            (2, warm_blocks, block_size, model.num_kv_heads, cfg.head_dim),
            dtype=dtype,
            device=device,
        )
        for _ in range(cfg.num_hidden_layers)
    ]
    warm_cache_bytes = sum(c.numel() * c.element_size() for c in caches)
    meta = AttentionMetadata.build(
        [num_tokens],
        [num_tokens],
        [list(range(warm_blocks))],
        block_size,
        device,
        triton_num_kv_heads=model.num_kv_heads if use_triton else None,
    )
    with torch.inference_mode():
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        positions = torch.arange(num_tokens, device=device) % cfg.max_position_embeddings
        hidden = model(ids, positions, caches, meta)
        model.compute_logits(hidden)  # every row: an upper bound on a step's logits
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - warm_cache_bytes
    del caches, hidden, meta
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    others = total - free - torch.cuda.memory_reserved(device)  # other processes, CUDA context
    budget = int(total * gpu_memory_utilization) - others - peak
    block_bytes = kv_cache_bytes_per_block(
        cfg.num_hidden_layers, block_size, model.num_kv_heads, cfg.head_dim, dtype
    )
    if budget < block_bytes:
        gib = 1 << 30
        raise InvalidInputError(
            "gpu_memory_utilization",
            f"{gpu_memory_utilization} of {total / gib:.1f} GiB leaves no room for KV blocks: "
            f"weights and activations take {peak / gib:.1f} GiB, other processes "
            f"{others / gib:.1f} GiB; raise it (at most 1.0) or lower max_num_batched_tokens",
        )
    return budget // block_bytes


def resolve_attention_backend(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """The attention path a runner uses: "triton" (GPU kernels; on CPU only under the Triton
    interpreter), "cpu" (the C++ decode kernel) or "torch" (the reference).

    auto: Triton on CUDA, the C++ kernel on CPU, the torch reference where neither can run."""
    if requested == "torch":
        return "torch"
    if requested == "triton":
        reason = triton_unusable_reason(device)
        if reason is not None:
            raise InvalidInputError("attention_backend", f"triton cannot run here: {reason}")
        return "triton"
    if device.type == "cuda":
        reason = triton_unusable_reason(device)
        if reason is None:
            return "triton"
        logger.warning("Triton attention unavailable (%s); using the torch reference", reason)
        return "torch"
    if dtype in (torch.float32, torch.bfloat16) and load_cpu_kernels() is not None:
        return "cpu"
    return "torch"


@dataclass
class StepResult:
    sampled: dict[str, int]  # request id -> new token
    logprobs: dict[str, tuple[float, list[tuple[int, float]]]]


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        seed: int = 0,
        attention_backend: str = "auto",
        *,
        enforce_eager: bool = True,
        max_num_seqs: int = 128,
        max_model_len: int | None = None,
    ) -> None:
        """`enforce_eager=False` captures CUDA graphs for decode batches of up to `max_num_seqs`
        requests and `max_model_len` tokens (default: the model's context) where they apply:
        CUDA, the Triton backend, no tensor parallelism. Elsewhere it changes nothing."""
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.device = device
        self.kv_caches = [
            torch.zeros(
                (2, num_blocks, block_size, model.num_kv_heads, cfg.head_dim),
                dtype=dtype,
                device=device,
            )
            for _ in range(cfg.num_hidden_layers)
        ]
        self.sampler = Sampler(seed)
        self.attention_backend = resolve_attention_backend(attention_backend, device, dtype)
        self.use_decode_kernel = self.attention_backend == "cpu"
        self.use_triton = self.attention_backend == "triton"
        self.decode_graphs: DecodeGraphs | None = None
        if not enforce_eager and device.type == "cuda" and self.use_triton and not model.tp.enabled:
            self.decode_graphs = DecodeGraphs(
                model,
                self.kv_caches,
                max_num_seqs,
                max_model_len or cfg.max_position_embeddings,
                block_size,
            )

    @torch.inference_mode()
    def execute(
        self,
        out: SchedulerOutput,
        kv: KVCacheManager,
        on_layer: Callable[[int], None] | None = None,
    ) -> StepResult:
        """`on_layer`: see `LlamaForCausalLM.forward` (never with a CUDA graph)."""
        requests = [r for r, _ in out.scheduled]
        query_lens = [n for _, n in out.scheduled]
        starts = [r.num_computed_tokens for r in requests]
        seq_lens = [s + n for s, n in zip(starts, query_lens, strict=True)]

        input_ids = np.concatenate(
            [
                np.asarray(r.all_token_ids[s:e], dtype=np.int64)
                for r, s, e in zip(requests, starts, seq_lens, strict=True)
            ]
        )
        positions = np.concatenate(
            [np.arange(s, e, dtype=np.int64) for s, e in zip(starts, seq_lens, strict=True)]
        )
        block_ids = [kv.get_block_ids(r.request_id) for r in requests]
        graphs = self.decode_graphs
        if graphs is not None and on_layer is None and graphs.can_run(query_lens, seq_lens):
            bs = self.block_size
            slots = np.array(
                [
                    b[(s - 1) // bs] * bs + (s - 1) % bs
                    for b, s in zip(block_ids, seq_lens, strict=True)
                ],
                dtype=np.int64,
            )
            hidden = graphs.run(input_ids, positions, slots, seq_lens, block_ids)
        else:
            meta = AttentionMetadata.build(
                query_lens,
                seq_lens,
                block_ids,
                self.block_size,
                self.device,
                self.use_decode_kernel,
                self.model.num_kv_heads if self.use_triton else None,
            )
            hidden = self.model(
                to_device(input_ids, self.device),
                to_device(positions, self.device),
                self.kv_caches,
                meta,
                on_layer,
            )

        # Only requests whose computed tokens reach their last token sample this step.
        sample_rows = [i for i, r in enumerate(requests) if seq_lens[i] == r.num_tokens]
        if not sample_rows:
            return StepResult({}, {})
        ends = np.cumsum(query_lens)
        last = to_device(np.array([ends[i] - 1 for i in sample_rows], dtype=np.int64), self.device)
        logits = self.model.compute_logits(hidden[last])  # [N, vocab]
        to_sample = [requests[i] for i in sample_rows]
        result: SamplerOutput = self.sampler(logits, to_sample)
        sampled = {r.request_id: t for r, t in zip(to_sample, result.token_ids, strict=True)}
        logprobs = {
            r.request_id: lp
            for r, lp in zip(to_sample, result.logprobs, strict=True)
            if lp is not None
        }
        return StepResult(sampled, logprobs)
