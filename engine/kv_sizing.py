"""How many KV blocks an engine's pool gets: from a byte budget (CPU) or from what a GPU has
left once the weights, a warm-up's activations and every other known consumer (transfer
staging, NCCL communicators, the CUDA-graph pool) are counted; never more than the kernels'
32-bit offsets address; and the same on every rank of a tensor-parallel group, whose
schedulers must make identical decisions."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from duet.engine.attention_metadata import AttentionMetadata
from duet.engine.cuda_graphs import uses_decode_graphs
from duet.engine.errors import InvalidInputError
from duet.engine.model.moe import experts_read_on_host
from duet.engine.parallel import TensorParallel
from duet.engine.piecewise_graphs import piecewise_max_tokens, piecewise_unsupported

if TYPE_CHECKING:
    from duet.engine.config import EngineConfig
    from duet.engine.model import LlamaForCausalLM

logger = logging.getLogger(__name__)

GRAPH_MAX_SPLITS = 16
"""Most split-K partials per decode row a captured graph may hold (the decode kernel's cap)."""
_GIB = 1 << 30


@dataclass(frozen=True)
class GpuMemory:
    """What one GPU holds once the weights are loaded and a warm-up forward ran (bytes)."""

    total_bytes: int
    others_bytes: int  # other processes, the CUDA context, NCCL communicators made so far
    weights_bytes: int  # allocated by this process before the warm-up
    activation_bytes: int  # the warm-up's peak above the weights and its own KV
    num_warmup_tokens: int  # tokens of that warm-up forward


@dataclass(frozen=True)
class DraftSizing:
    """What a draft model (speculative `draft_model`) adds to its target's KV budget: its own
    pool holds as many blocks as the target's, so each block costs both models' bytes; on
    CUDA with graphs its runner captures its own decode (and piecewise) graphs. Its weights are
    loaded before the target's pool is sized, so the warm-up's measurement holds them."""

    block_bytes: int
    num_heads: int
    head_dim: int


def plan_gpu_kv_blocks(
    memory: GpuMemory, utilization: float, block_bytes: int, reserved: Mapping[str, int]
) -> int:
    """Blocks that fit in `utilization` of the GPU once `memory`'s consumers and the `reserved`
    ones (name -> bytes: staging, NCCL, CUDA graphs) are counted. Raises `InvalidInputError`
    naming every term when not one block fits."""
    used = memory.others_bytes + memory.weights_bytes + memory.activation_bytes
    budget = int(memory.total_bytes * utilization) - used - sum(reserved.values())
    if budget < block_bytes:
        terms = ", ".join(f"{name} {b / _GIB:.2f} GiB" for name, b in reserved.items())
        raise InvalidInputError(
            "gpu_memory_utilization",
            f"{utilization} of {memory.total_bytes / _GIB:.1f} GiB leaves no room for KV blocks: "
            f"weights take {memory.weights_bytes / _GIB:.2f} GiB, activations "
            f"{memory.activation_bytes / _GIB:.2f} GiB, other processes "
            f"{memory.others_bytes / _GIB:.2f} GiB" + (f", {terms}" if terms else "") + "; "
            "raise it (at most 1.0), lower max_num_batched_tokens, or reserve less",
        )
    return budget // block_bytes


def graph_pool_bytes(memory: GpuMemory, max_num_seqs: int, num_heads: int, head_dim: int) -> int:
    """An upper estimate of the decode CUDA graphs' private memory pool: the activations of a
    `max_num_seqs`-token forward at the warm-up's bytes per token (which include its logits,
    which the graphs do not hold) plus the fp32 split-K partials of every row."""
    partials = max_num_seqs * num_heads * GRAPH_MAX_SPLITS * (head_dim + 2) * 4
    return _activation_bytes_per_token(memory) * max_num_seqs + partials


def piecewise_pool_bytes(memory: GpuMemory, max_tokens: int) -> int:
    """An upper estimate of the piecewise graphs' pool and static buffers
    (engine/piecewise_graphs.py): the activations of a `max_tokens`-token forward at the
    warm-up's bytes per token (what one piece holds is one layer's share of that; the pieces
    share the pool, captured largest first)."""
    return _activation_bytes_per_token(memory) * max_tokens


def _activation_bytes_per_token(memory: GpuMemory) -> int:
    """The warm-up's activations per token, rounded up: what the graph pools scale by."""
    return -(-memory.activation_bytes // max(1, memory.num_warmup_tokens))


def measure_gpu_memory(
    model: LlamaForCausalLM,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    max_num_batched_tokens: int,
    use_triton: bool,
) -> GpuMemory:
    """Run a warm-up forward of one `max_num_batched_tokens`-token prompt (with the logits of
    every row: an upper bound on a step's) and read the GPU's memory around it. CUDA only."""
    cfg = model.config
    num_tokens = max_num_batched_tokens
    warm_blocks = -(-num_tokens // block_size)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    weights = torch.cuda.memory_allocated(device)
    shape = model.kv_spec.shape(warm_blocks, block_size)
    caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_layers)]
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
        model.logits_on_first_rank(hidden)  # rank 0 also holds the gathered logits
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - warm_cache_bytes
    del caches, hidden, meta
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return GpuMemory(
        total_bytes=total,
        others_bytes=total - free - torch.cuda.memory_reserved(device),
        weights_bytes=weights,
        activation_bytes=max(0, peak - weights),
        num_warmup_tokens=num_tokens,
    )


def num_kv_blocks_for_gpu_memory(
    model: LlamaForCausalLM,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    gpu_memory_utilization: float,
    max_num_batched_tokens: int,
    use_triton: bool,
    *,
    reserved: Mapping[str, int] | None = None,
    graph_max_num_seqs: int = 0,
    piecewise_max_tokens: int = 0,
    draft: DraftSizing | None = None,
) -> int:
    """KV blocks that fit in `gpu_memory_utilization` of the GPU (see `measure_gpu_memory`,
    `plan_gpu_kv_blocks`); `graph_max_num_seqs` > 0 also reserves the CUDA-graph pool of
    decode batches of up to that many requests, `piecewise_max_tokens` > 0 that of piecewise
    graphs of steps of up to that many tokens (`piecewise_pool_bytes`). `draft`: a draft
    model's blocks beside each of the target's, and its graphs' pools. CUDA only."""
    cfg = model.config
    memory = measure_gpu_memory(
        model, block_size, dtype, device, max_num_batched_tokens, use_triton
    )
    reserve = dict(reserved or {})
    if graph_max_num_seqs > 0:
        num_heads = model.heads.num_heads
        reserve["cuda_graphs"] = graph_pool_bytes(
            memory, graph_max_num_seqs, num_heads, cfg.head_dim
        )
    if piecewise_max_tokens > 0:
        reserve["piecewise_graphs"] = piecewise_pool_bytes(memory, piecewise_max_tokens)
    block_bytes = model.kv_spec.bytes_per_block(model.num_layers, block_size, dtype)
    if draft is not None:
        # the target's activations per token bound the (smaller) draft's
        if graph_max_num_seqs > 0:
            reserve["draft_cuda_graphs"] = graph_pool_bytes(
                memory, graph_max_num_seqs, draft.num_heads, draft.head_dim
            )
        if piecewise_max_tokens > 0:
            reserve["draft_piecewise_graphs"] = piecewise_pool_bytes(memory, piecewise_max_tokens)
        block_bytes += draft.block_bytes
    num_blocks = plan_gpu_kv_blocks(memory, gpu_memory_utilization, block_bytes, reserve)
    logger.info(
        "GPU memory: %.2f GiB total, weights %.2f, activations %.2f, others %.2f, %s; "
        "KV pool %d blocks",
        memory.total_bytes / _GIB, memory.weights_bytes / _GIB, memory.activation_bytes / _GIB,
        memory.others_bytes / _GIB,
        ", ".join(f"{k} {v / _GIB:.2f}" for k, v in reserve.items()) or "nothing reserved",
        num_blocks,
    )  # fmt: skip
    return num_blocks


def size_kv_pool(
    config: EngineConfig,
    model: LlamaForCausalLM,
    device: torch.device,
    dtype: torch.dtype,
    tp: TensorParallel,
    max_model_len: int,
    use_triton: bool,
    draft: DraftSizing | None = None,
) -> int:
    """The engine's block count: `num_kv_blocks`, else what the GPU has left (CUDA) or
    `kv_cache_memory_bytes` (CPU); clamped to what 32-bit offsets address; the minimum over
    the tensor-parallel group (every rank calls this at the same point). `draft`: a draft
    model's pool of as many blocks shares the budget (`DraftSizing`)."""
    spec = model.kv_spec
    block_bytes = spec.bytes_per_block(model.num_layers, config.block_size, dtype)
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    elif device.type == "cuda":
        on_host = experts_read_on_host(model)
        graphs = uses_decode_graphs(config.enforce_eager, device, use_triton, on_host)
        num_blocks = num_kv_blocks_for_gpu_memory(
            model,
            config.block_size,
            dtype,
            device,
            config.gpu_memory_utilization,
            config.max_num_batched_tokens,
            use_triton,
            reserved=config.device_reservations(block_bytes, max_model_len),
            graph_max_num_seqs=config.max_num_seqs if graphs and config.decodes else 0,
            piecewise_max_tokens=(
                piecewise_max_tokens(config.max_num_batched_tokens)
                if graphs
                and config.cuda_graph_mode == "piecewise"
                and piecewise_unsupported(model) is None
                else 0
            ),
            draft=draft,
        )
    else:
        draft_bytes = 0 if draft is None else draft.block_bytes
        num_blocks = max(1, config.kv_cache_memory_bytes // (block_bytes + draft_bytes))
    limit = spec.max_addressable_blocks(config.block_size)
    if num_blocks > limit:
        logger.warning(
            "KV pool clamped from %d to %d blocks: one layer's cache may hold at most 2^31 - 1 "
            "elements (32-bit offsets in the attention kernels)",
            num_blocks, limit,
        )  # fmt: skip
        num_blocks = limit
    agreed = tp.agree_min_all(num_blocks, device)  # every stage schedules the same blocks
    if agreed != num_blocks:
        logger.info(
            "tensor-parallel rank %d: %d KV blocks fit here; the group agreed on %d",
            tp.rank, num_blocks, agreed,
        )  # fmt: skip
    return agreed
