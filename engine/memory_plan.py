"""The memory plan of a model over GPUs (`duet plan`): for each tensor x pipeline layout the
GPU count allows, what every rank holds (weights, activations, the CUDA-graph pool, transfer
staging and NCCL, KV blocks) and whether the layout fits, computed with the engine's own
pieces so that the plan and a running engine agree:

- weights: the engine's model (`LlamaForCausalLM`, built on the meta device for each TP rank,
  so replicated KV heads, vocabulary-parallel embedding, uneven splits and, with expert
  parallelism, a rank's whole experts are the engine's) counted by `weight_bytes`, as the
  loader logs it;
- KV blocks: `KVCacheSpec.bytes_per_block` of the rank's layers and KV heads (MLA: one
  latent entry per token and layer), `plan_gpu_kv_blocks` over what is left, clamped by
  `KVCacheSpec.max_addressable_blocks`, the minimum over the ranks (every rank of an engine
  schedules the same blocks);
- the CUDA-graph pool: `graph_pool_bytes`, from the activations (with `piecewise_graphs`,
  plus `piecewise_pool_bytes`).

Activations are the one estimate: a running engine measures them with a warm-up forward
(`measure_gpu_memory`); the plan counts the tensors alive at that forward's peak
(`activation_bytes`, docs/parallelism.md gives the formula). Pipeline stages hold
`stage_layers(num_hidden_layers, P, stage)` layers; the first stage the embedding, the last the final
norm and the LM head (with tied embeddings the table too).

With `PlanSettings.data_parallel`, a mixture of experts also gets its data-parallel attention
layouts (`duet serve -dp D --expert-parallel-size D`, TP = PP = 1): each of D ranks holds the
whole attention, embedding and head, 1/D of the routed experts, and a KV pool of its own, so
the layout holds D times one rank's sequences; no CUDA graphs (the exchange needs eager
steps); its activations add the exchange's rows (every rank's tokens x k, in and back).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from duet.engine.errors import InvalidInputError
from duet.engine.kv_cache_spec import kv_cache_spec
from duet.engine.kv_sizing import (
    GpuMemory,
    graph_pool_bytes,
    piecewise_pool_bytes,
    plan_gpu_kv_blocks,
)
from duet.engine.model.arch import ModelArchConfig
from duet.engine.model.llama import LlamaForCausalLM
from duet.engine.model.mla import check_mla_layout
from duet.engine.model.mlp import mlp_shard
from duet.engine.model.moe import check_ep_size
from duet.engine.model.weight_bytes import weight_bytes
from duet.engine.parallel import ExpertExchange, TensorParallel, check_tp_size, split
from duet.engine.piecewise_graphs import piecewise_max_tokens
from duet.engine.pipeline import check_pp_size, stage_layers

CUDA_CONTEXT_BYTES = 512 << 20
"""What a process's CUDA context and torch's own state take on a GPU before any tensor (an
estimate; a running engine measures it as `GpuMemory.others_bytes`)."""


@dataclass(frozen=True)
class PlanSettings:
    """The engine settings a plan depends on (the `EngineConfig` fields of the same names)."""

    dtype: torch.dtype = torch.bfloat16
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int | None = None  # None: the model's context
    gpu_memory_utilization: float = 0.9
    cuda_graphs: bool = True  # decode graphs captured (not enforce_eager): their pool counted
    piecewise_graphs: bool = False  # pieces captured (piecewise, not eager): their pool too
    reserved: Mapping[str, int] = field(default_factory=dict)
    """Other consumers every rank leaves room for (name -> bytes): a worker's KV staging and
    NCCL communicators (`KVWorkerConfig.device_reservations`); empty for aggregated serving."""
    cuda_context_bytes: int = CUDA_CONTEXT_BYTES
    expert_parallel: bool = False
    """A mixture's routed experts sharded whole over each layout's TP ranks
    (`expert_parallel_size` = `tensor_parallel_size`) instead of every expert sliced."""
    data_parallel: bool = False
    """`plan_layouts` adds a mixture's data-parallel attention layouts (the module docstring)."""


@dataclass(frozen=True)
class RankPlan:
    """One rank's memory (bytes) under a layout."""

    tp_rank: int  # (the data-parallel rank in a data-parallel layout)
    pp_stage: int
    layers: tuple[int, int]  # [start, end) of the model's layers this rank's stage holds
    weights_bytes: int
    activation_bytes: int
    graph_pool_bytes: int
    others_bytes: int  # the CUDA context and the group's NCCL communicators
    reserved: Mapping[str, int]
    kv_block_bytes: int
    num_kv_blocks: int  # what fits on this rank alone (0: not one block)


@dataclass(frozen=True)
class LayoutPlan:
    """One tensor x pipeline layout: its ranks and what the engine would get."""

    tp: int
    pp: int
    ranks: list[RankPlan]
    num_kv_blocks: int  # the minimum over the ranks (data-parallel: each rank's own pool)
    max_model_len: int
    block_size: int
    max_num_seqs: int
    dp: int = 1  # data-parallel attention ranks (then tp = pp = 1), each its own sequences

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def kv_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    @property
    def fits(self) -> bool:
        """One sequence of `max_model_len` tokens fits in the KV pool."""
        return self.kv_tokens >= self.max_model_len

    @property
    def max_context(self) -> int:
        """The longest sequence the pool holds (at most `max_model_len`)."""
        return min(self.max_model_len, self.kv_tokens)

    @property
    def max_concurrent_seqs(self) -> int:
        """Sequences of `max_model_len` tokens the pool holds at once (at most max_num_seqs),
        over every data-parallel rank's pool."""
        return self.dp * min(self.max_num_seqs, self.kv_tokens // self.max_model_len)


def valid_tp_size(arch: ModelArchConfig, tp: int, expert_parallel: bool = False) -> bool:
    """Whether the engine accepts `tp` for `arch` (heads and intermediate size; with
    `expert_parallel`, routed experts that split into `tp` whole shares)."""
    try:
        check_tp_size(tp, arch.num_attention_heads)
        mlp_shard(arch.intermediate_size, TensorParallel(0, tp))
        if expert_parallel:
            check_ep_size(tp, arch.moe)
        check_mla_layout(arch, tp)
    except InvalidInputError:
        return False
    return True


@dataclass(frozen=True)
class _RankWeights:
    """Weight bytes of one TP rank's model parts."""

    per_layer: tuple[int, int]  # a dense layer's, a sparse (MoE) layer's
    embedding: int
    head: int  # the final norm and the LM head (0 for a tied one: the embedding is the head)
    tied: bool
    num_kv_heads: int
    num_heads: int


def _rank_weights(
    arch: ModelArchConfig,
    tp: int,
    rank: int,
    dtype: torch.dtype,
    expert_parallel: bool = False,
    dp: int = 1,
) -> _RankWeights:
    """The engine's model for TP rank `rank` of `tp` (or data-parallel rank `rank` of `dp`) on
    the meta device, one layer deep (a dense layer and, for a mixture of experts, a sparse
    one: Qwen2-MoE mixes them), counted by `weight_bytes`: with `expert_parallel` (and more
    than one rank) or `dp` the rank's whole experts in place of a slice of every one. The
    rope tables (built for real, and no weights) are kept short."""
    layout = TensorParallel(rank, tp, expert_parallel=expert_parallel and tp > 1)
    if dp > 1:
        layout = TensorParallel(exchange=ExpertExchange(rank, dp))
    per_layer: list[int] = []
    for sparse in (False, True):
        moe = arch.moe
        if moe is not None:
            moe = dataclasses.replace(moe, sparse_layers=(0,) if sparse else ())
        one_layer = dataclasses.replace(
            arch, num_hidden_layers=1, max_position_embeddings=16, moe=moe
        )
        with torch.device("meta"):
            net = LlamaForCausalLM(one_layer, None, layout).to(dtype)
        per_layer.append(weight_bytes(net.layers[0])[0])
    embedding = weight_bytes(net.embed_tokens)[0]
    assert net.norm is not None  # one stage: the last
    head = weight_bytes(net.norm)[0]
    if net.lm_head is not None:
        head += weight_bytes(net.lm_head)[0]
    return _RankWeights(
        (per_layer[0], per_layer[1]),
        embedding,
        head,
        net.lm_head is None,
        net.num_kv_heads,
        net.heads.num_heads,
    )


def activation_bytes(
    arch: ModelArchConfig,
    tp: int,
    rank: int,
    num_tokens: int,
    dtype: torch.dtype,
    first_stage: bool = True,
    last_stage: bool = True,
) -> int:
    """An estimate of the warm-up forward's peak above the weights and the KV cache: the
    largest of the MLP's tensors alive at once (hidden and residual streams, gate|up, silu(gate)
    and its product with up) and, on the last stage, the logits of every row (this rank's
    vocabulary shard in the dtype and in fp32, and on rank 0 the gathered shards and the
    concatenated fp32 logits). A stage after the first also holds the received hidden and
    residual buffers."""
    item = torch.empty((), dtype=dtype).element_size()
    hidden = num_tokens * arch.hidden_size * item
    start, end = mlp_shard(arch.intermediate_size, TensorParallel(rank, tp))
    inter = num_tokens * (end - start) * item
    mlp_peak = 2 * hidden + 2 * inter + 2 * inter  # streams, gate|up, silu(gate), act
    received = 0 if first_stage else 2 * hidden
    if not last_stage:
        return mlp_peak + received
    vocab = [e - s for s, e in (split(arch.vocab_size, tp, r) for r in range(tp))]
    logits = num_tokens * vocab[rank] * (item + 4)
    if tp > 1 and rank == 0:
        logits += num_tokens * max(vocab) * 4 * tp + num_tokens * arch.vocab_size * 4
    return max(mlp_peak, hidden + logits) + received


def nccl_communicators(tp: int, pp: int) -> int:
    """NCCL communicators one rank creates: its TP group's, and one per pipeline neighbour."""
    return (1 if tp > 1 else 0) + (0 if pp == 1 else 1 if pp == 2 else 2)


def plan_layout(
    arch: ModelArchConfig,
    tp: int,
    pp: int,
    gpu_memory_bytes: int,
    settings: PlanSettings,
    nccl_comm_bytes: int = 256 << 20,
    dp: int = 1,
) -> LayoutPlan:
    """Every rank's memory under `tp` x `pp` (or `dp` data-parallel attention ranks) on GPUs
    of `gpu_memory_bytes` each."""
    check_tp_size(tp, arch.num_attention_heads)
    check_pp_size(pp, arch.num_hidden_layers)
    if settings.expert_parallel:
        check_ep_size(tp, arch.moe)
    check_mla_layout(arch, tp)
    if dp > 1 and (tp, pp) != (1, 1):
        raise InvalidInputError("data_parallel_size", f"runs at TP and PP 1; got {tp} x {pp}")
    if dp > 1 and arch.moe is None:
        raise InvalidInputError("data_parallel_size", "needs a mixture of experts")
    check_ep_size(dp, arch.moe)
    max_model_len = min(
        settings.max_model_len or arch.max_position_embeddings, arch.max_position_embeddings
    )
    num_tokens = settings.max_num_batched_tokens
    others = settings.cuda_context_bytes + nccl_communicators(max(tp, dp), pp) * nccl_comm_bytes
    ranks: list[RankPlan] = []
    for rank in range(max(tp, dp)):
        w = _rank_weights(arch, tp, rank, settings.dtype, settings.expert_parallel, dp)
        for stage in range(pp):
            first, last = stage == 0, stage == pp - 1
            layers = stage_layers(arch.num_hidden_layers, pp, stage)
            num_layers = layers[1] - layers[0]
            weights = sum(
                w.per_layer[arch.moe is not None and arch.moe.is_sparse(i)]
                for i in range(layers[0], layers[1])
            )
            # A tied LM head is the embedding table: the last stage holds it too.
            holds_table = first or (last and w.tied)
            weights += (w.embedding if holds_table else 0) + (w.head if last else 0)
            if dp > 1:  # a whole model's activations, and the exchange's rows
                act = activation_bytes(arch, 1, 0, num_tokens, settings.dtype, first, last)
                act += exchange_bytes(arch, dp, num_tokens, settings.dtype)
            else:
                act = activation_bytes(arch, tp, rank, num_tokens, settings.dtype, first, last)
            memory = GpuMemory(gpu_memory_bytes, others, weights, act, num_tokens)
            reserve = dict(settings.reserved)
            graphs = 0
            spec = kv_cache_spec(arch, w.num_kv_heads)
            # every stage captures its own graphs (MLA too: Triton's latent kernels), as
            # `kv_sizing.size_kv_pool` reserves them
            if settings.cuda_graphs and dp == 1:
                graphs = graph_pool_bytes(memory, settings.max_num_seqs, w.num_heads, arch.head_dim)
                reserve["cuda_graphs"] = graphs
            if settings.piecewise_graphs and dp == 1 and pp == 1:  # engine/piecewise_graphs.py
                pieces = piecewise_pool_bytes(memory, piecewise_max_tokens(num_tokens))
                reserve["piecewise_graphs"] = pieces
                graphs += pieces
            block_bytes = spec.bytes_per_block(num_layers, settings.block_size, settings.dtype)
            try:
                num_blocks = plan_gpu_kv_blocks(
                    memory, settings.gpu_memory_utilization, block_bytes, reserve
                )
            except InvalidInputError:
                num_blocks = 0
            limit = spec.max_addressable_blocks(settings.block_size)
            ranks.append(
                RankPlan(
                    tp_rank=rank,
                    pp_stage=stage,
                    layers=layers,
                    weights_bytes=weights,
                    activation_bytes=act,
                    graph_pool_bytes=graphs,
                    others_bytes=others,
                    reserved=dict(settings.reserved),
                    kv_block_bytes=block_bytes,
                    num_kv_blocks=min(num_blocks, limit),
                )
            )
    return LayoutPlan(
        tp=tp,
        pp=pp,
        ranks=ranks,
        num_kv_blocks=min(r.num_kv_blocks for r in ranks),
        max_model_len=max_model_len,
        block_size=settings.block_size,
        max_num_seqs=settings.max_num_seqs,
        dp=dp,
    )


def exchange_bytes(arch: ModelArchConfig, dp: int, num_tokens: int, dtype: torch.dtype) -> int:
    """The expert exchange's buffers at a sparse layer's peak, on top of the activations: the
    rows an owner can receive (every rank's `num_tokens` x k) and their results, and a rank's
    own k rows out and back."""
    assert arch.moe is not None
    item = torch.empty((), dtype=dtype).element_size()
    rows = num_tokens * arch.moe.num_experts_per_tok * arch.hidden_size * item
    return 2 * dp * rows + 2 * rows


def plan_layouts(
    arch: ModelArchConfig,
    num_gpus: int,
    gpu_memory_bytes: int,
    settings: PlanSettings,
    nccl_comm_bytes: int = 256 << 20,
    max_pp: int | None = None,
) -> list[LayoutPlan]:
    """`plan_layout` for every TP x PP the engine accepts with TP * PP <= `num_gpus` (and PP
    at most `max_pp`) and, with `settings.data_parallel`, every data-parallel size up to
    `num_gpus` that divides a mixture's experts; by the number of GPUs, then DP, then TP."""
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1:
        raise InvalidInputError("gpus", f"must be an integer >= 1; got {num_gpus!r}")
    layouts = [
        (tp, pp)
        for tp in range(1, num_gpus + 1)
        for pp in range(1, num_gpus // tp + 1)
        if valid_tp_size(arch, tp, settings.expert_parallel)
        and pp <= min(arch.num_hidden_layers, max_pp or arch.num_hidden_layers)
    ]
    plans = [
        plan_layout(arch, tp, pp, gpu_memory_bytes, settings, nccl_comm_bytes) for tp, pp in layouts
    ]
    if settings.data_parallel and arch.moe is not None:
        plans += [
            plan_layout(arch, 1, 1, gpu_memory_bytes, settings, nccl_comm_bytes, dp)
            for dp in range(2, num_gpus + 1)
            if arch.moe.num_experts % dp == 0
        ]
    plans.sort(key=lambda plan: (plan.num_gpus, plan.dp, plan.tp))
    return plans
