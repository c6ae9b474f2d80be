"""The Llama family in one module: Llama 2/3, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (q/k
RMSNorm), SmolLM2 (tied embeddings), and the mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE
and DeepSeek-V2/V3, whose sparse layers' feed-forward is a `SparseMoeBlock` (engine/model/moe.py)
in place of the dense `MLP` (engine/model/mlp.py); DeepSeek's attention is multi-head latent
attention (`MLAttention`, engine/model/mla.py) in place of `Attention`.

The forward takes a flat batch of tokens plus `AttentionMetadata`, so one step can mix
prefill chunks and decodes. Projections are fused at load time (q|k|v, gate|up). With tensor
parallelism each rank holds its shard (see engine/parallel.py) and the shards meet in one
all-reduce after o_proj, one after down_proj (or after a sparse layer's experts), one after the
embedding, and a gather of the logits to rank 0, the rank that samples. Which part of each
checkpoint tensor a rank holds, and where it goes, is engine/model/placement.py's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from duet.engine.attention import (
    GatherWorkspace,
    decode_only_kernels,
    paged_attention,
    store_kv,
)
from duet.engine.attention_metadata import AttentionMetadata
from duet.engine.kv_cache_spec import KVCacheSpec, kv_cache_spec
from duet.engine.model.arch import ModelArchConfig
from duet.engine.model.dense_cpu_linear import use_dense_kernel
from duet.engine.model.forward_context import ForwardContext
from duet.engine.model.mla import MLAttention, check_mla_layout
from duet.engine.model.mlp import MLP, make_linear
from duet.engine.model.moe import SparseMoeBlock, check_ep_size
from duet.engine.model.norm import RMSNorm
from duet.engine.model.packed_linear import PackedLinear, can_pack, pack_linears
from duet.engine.model.placement import WeightPlacement, copy_weights, finalize_quantized, tied_head
from duet.engine.model.quantized_embedding import can_gather_rows, gather_rows
from duet.engine.model.quantized_linear import QuantizedLinear
from duet.engine.model.rotary import RotaryEmbedding
from duet.engine.model.row_invariant import TiedLinear
from duet.engine.parallel import SINGLE, TensorParallel, TensorSlice, split
from duet.engine.quant.config import QuantizationConfig

_FUSED = (torch.float32, torch.bfloat16)
"""Dtypes of `decode_attention_step` (the CPU kernels')."""


class Attention(nn.Module):
    def __init__(
        self, cfg: ModelArchConfig, tp: TensorParallel, quant: QuantizationConfig | None = None
    ) -> None:
        super().__init__()
        self.tp = tp
        self.head_dim = cfg.head_dim
        heads = tp.heads(cfg.num_attention_heads, cfg.num_key_value_heads)
        self.num_heads = heads.num_heads
        self.num_kv_heads = heads.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_sizes = [self.q_size, self.kv_size, self.kv_size]
        self.qkv_proj = make_linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.attention_bias, quant
        )
        self.o_proj = make_linear(self.q_size, cfg.hidden_size, False, quant)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(
        self, hidden: torch.Tensor, kv_cache: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        parts: dict[str, Any] = self._modules  # see DecoderLayer.forward
        qkv = parts["qkv_proj"].forward(hidden)  # [T, (H + 2 Hkv) D] of this rank's heads
        fused = ctx.decode_kernels
        if (
            fused is not None
            and self.q_norm is None
            and qkv.dtype in _FUSED
            and kv_cache.dtype == qkv.dtype
            and qkv.is_contiguous()
        ):
            # a step of decodes on the CPU kernels: rotary, KV write and attention in one call
            rotary: dict[str, torch.Tensor] = ctx.rotary._buffers  # type: ignore[assignment]
            d = ctx.meta.decode_batch
            assert d is not None
            out = fused.decode_attention_step(
                qkv, ctx.positions, rotary["cos"], rotary["sin"], kv_cache, ctx.meta.slot_mapping,
                d.block_tables, d.seq_lens, d.token_indices, self.num_heads, self.num_kv_heads,
                self.scale,
            )  # fmt: skip
            return self.tp.all_reduce(parts["o_proj"].forward(out))
        meta = ctx.meta
        q, k, v = self.split_heads(qkv, ctx.positions, None)
        # Triton on CUDA: rotary and the KV write in one kernel
        stored = meta.kernel_batch is not None and ctx.rotary.rotate_and_store(
            ctx.positions, q, k, v, kv_cache, meta.slot_mapping
        )
        if not stored:
            q, k = ctx.rotary.forward(ctx.positions, q, k)
        return self.output(self.attend((q, k, v), kv_cache, meta, ctx.workspace, stored))

    # The three parts of `forward` off the CPU's fused decode step; piecewise CUDA graphs
    # (engine/piecewise_graphs.py) capture `prepare` and `output` and run `attend` between.
    @property
    def out_width(self) -> int:
        """Columns of `attend`'s result: every head's output."""
        return self.q_size

    def prepare(
        self, hidden: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding
    ) -> tuple[torch.Tensor, ...]:
        """q [T, H, D], k and v [T, Hkv, D] of `hidden`: projected, normed (Qwen3), rotated."""
        qkv_proj: nn.Module = self._modules["qkv_proj"]  # type: ignore[assignment]
        return self.split_heads(qkv_proj.forward(hidden), positions, rotary)

    def split_heads(
        self, qkv: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding | None
    ) -> tuple[torch.Tensor, ...]:
        """q [T, H, D], k and v [T, Hkv, D] of the projected q|k|v [T, (H + 2 Hkv) D]: views
        of it, q and k normed (Qwen3) and rotated (not without `rotary`)."""
        num_tokens = qkv.shape[0]
        # split_with_sizes: Tensor.split is a Python wrapper around it
        q, k, v = qkv.split_with_sizes(self.qkv_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rotary is not None:
            q, k = rotary.forward(positions, q, k)
        return q, k, v

    def attend(
        self,
        inputs: tuple[torch.Tensor, ...],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        workspace: GatherWorkspace,
        stored: bool = False,
    ) -> torch.Tensor:
        """This step's K/V (`inputs`: q, k, v) written into the cache (unless `stored`
        already), then attention over it: [T, H D]."""
        q, k, v = inputs
        if not stored:
            store_kv(kv_cache, k, v, meta)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale, workspace)  # [T, H, D]
        return out.reshape(out.shape[0], self.q_size)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """o_proj of attention's [T, H D] and the tensor-parallel all-reduce."""
        o_proj: nn.Module = self._modules["o_proj"]  # type: ignore[assignment]
        return self.tp.all_reduce(o_proj.forward(out))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelArchConfig,
        tp: TensorParallel,
        quant: QuantizationConfig | None = None,
        index: int = 0,
    ) -> None:
        super().__init__()
        self.self_attn: nn.Module = (
            MLAttention(cfg, tp, quant) if cfg.mla is not None else Attention(cfg, tp, quant)
        )
        self.mlp: nn.Module
        if cfg.moe is not None and cfg.moe.is_sparse(index):
            self.mlp = SparseMoeBlock(cfg, tp, quant)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, tp, quant)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it); the next layer (or the
        final norm) adds the two, fused with its norm. `residual` is None for the first layer."""
        # NOTE: submodules (and parameters) are read from `_modules` (`_parameters`), the
        # dicts nn.Module keeps them in: `self.mlp` goes through nn.Module.__getattr__, a
        # Python call, and a batch-1 decode step made about 600 such calls.
        parts: dict[str, Any] = self._modules
        if residual is None:
            residual = hidden
            hidden = parts["input_layernorm"].forward(hidden)
        else:
            hidden, residual = parts["input_layernorm"].add_and_norm(hidden, residual)
        hidden = parts["self_attn"].forward(hidden, kv_cache, ctx)
        hidden, residual = parts["post_attention_layernorm"].add_and_norm(hidden, residual)
        return parts["mlp"].forward(hidden), residual


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        cfg: ModelArchConfig,
        rope_freqs: torch.Tensor | None = None,
        tp: TensorParallel = SINGLE,
        quant: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.quant = quant
        # Checked up front so a bad tensor_parallel_size fails with a clear message.
        self.heads = tp.heads(cfg.num_attention_heads, cfg.num_key_value_heads)
        if tp.expert_parallel:
            check_ep_size(tp.world_size, cfg.moe)
        if tp.exchange is not None:  # data-parallel attention (engine/model/moe_exchange.py)
            check_ep_size(tp.exchange.size, cfg.moe)
        check_mla_layout(cfg, tp.world_size)
        self.vocab_start, self.vocab_end = tp.split(cfg.vocab_size)
        self.vocab_sizes = [
            end - start
            for start, end in (
                split(cfg.vocab_size, tp.world_size, r) for r in range(tp.world_size)
            )
        ]  # every rank's share of the LM head's rows, for the gather
        shard_vocab = self.vocab_end - self.vocab_start
        # Pipeline parallelism (engine/pipeline.py): this stage's layers; the first stage
        # embeds, the last holds the final norm and the head (a tied head: the embedding
        # table as well).
        pp = tp.pp
        self.layer_start, self.layer_end = pp.layers(cfg.num_hidden_layers)
        self.holds_embedding = pp.is_first or (pp.is_last and cfg.tie_word_embeddings)
        vocab, layers = (self.vocab_start, self.vocab_end), (self.layer_start, self.layer_end)
        self.placement = WeightPlacement(cfg, tp, self.heads, vocab, layers, self.holds_embedding)
        rows = shard_vocab if self.holds_embedding else 0
        # Given its weight, Embedding skips its random init, which on the meta device imports
        # torch._dynamo (2-4 s of a process's start); the loader fills every weight.
        self.embed_tokens = nn.Embedding(
            rows, cfg.hidden_size, _weight=torch.empty(rows, cfg.hidden_size)
        )
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, tp, quant, i) for i in range(self.layer_start, self.layer_end)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if pp.is_last else None
        head_quant = quant if quant is not None and quant.lm_head else None
        self.lm_head = (
            None
            if cfg.tie_word_embeddings or not pp.is_last
            else make_linear(cfg.hidden_size, shard_vocab, False, head_quant)
        )
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling, rope_freqs
        )
        self.workspace = GatherWorkspace()
        self.tied_head: nn.Module | None = None  # set by load_weights, packed by pack_for_cpu
        self.embedding_in_head = False
        """Whether lookups read the quantized tied head (`embed_tokens` then holds no rows)."""
        for p in self.parameters():
            p.requires_grad_(False)

    @property
    def num_kv_heads(self) -> int:
        """KV heads this rank caches (MLA: 1, the latent entry every head reads)."""
        return self.heads.num_kv_heads

    @property
    def kv_spec(self) -> KVCacheSpec:
        """What this rank's cache holds per token and layer."""
        return kv_cache_spec(self.config, self.num_kv_heads)

    @property
    def num_layers(self) -> int:
        """Layers this rank runs and caches KV for (all of them without pipeline stages)."""
        return self.layer_end - self.layer_start

    def holds_tensor(self, name: str) -> bool:
        """Whether this rank's stage holds the checkpoint tensor `name` (HF's name)."""
        return self.placement.holds(name)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],  # per layer `kv_spec.shape(num_blocks, block_size)`
        meta: AttentionMetadata,
        on_layer: Callable[[int], None] | None = None,
        sends: list[Any] | None = None,
    ) -> torch.Tensor:
        """`on_layer(i)` is called once layer i (the model's index) has written its KV into
        this stage's cache of it (on CUDA: once the writes are queued), e.g. to start sending
        it (layer-wise KV transfer). `kv_caches`: one per layer of this stage.

        With pipeline stages a stage after the first receives the previous stage's hidden and
        residual streams instead of embedding, and a stage before the last sends its own on
        and returns its hidden stream (no logits come from it). `sends`: where such a stage
        leaves its sends in flight (the caller waits on them, `pipeline.wait_all`); None: it
        waits for them itself."""
        pp = self.tp.pp
        hidden_in = residual_in = None
        if not pp.is_first:
            weight = self.embed_tokens.weight  # this stage's dtype and device (maybe no rows)
            shape = (input_ids.shape[0], self.config.hidden_size)
            hidden_in = torch.empty(shape, dtype=weight.dtype, device=weight.device)
            residual_in = torch.empty_like(hidden_in)
            pp.recv_prev(hidden_in, residual_in)
        hidden, residual = self.stage_forward(
            input_ids, positions, kv_caches, meta, on_layer, hidden_in, residual_in
        )
        if not pp.is_last:
            assert residual is not None  # every stage runs at least one layer
            works = pp.send_next(hidden, residual)
            if sends is None:
                for work in works:
                    work.wait()
            else:
                sends += works
        return hidden

    def stage_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        on_layer: Callable[[int], None] | None = None,
        hidden_in: torch.Tensor | None = None,
        residual_in: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This stage's part of `forward`, without sending or receiving: from the embedding of
        `input_ids` (the first stage) or from the previous stage's hidden and residual streams
        (`hidden_in`, `residual_in`, [T, hidden] each), through this stage's layers. Returns
        the final norm's output and None on the last stage, else the hidden and residual
        streams to send on. A CUDA graph of a stage captures this (engine/cuda_graphs.py)."""
        ctx = ForwardContext(
            positions,
            meta,
            self.rotary,
            self.workspace,
            decode_only_kernels(meta, positions.device),
        )
        pp = self.tp.pp
        residual: torch.Tensor | None = None
        if pp.is_first:
            hidden = self._embed(input_ids)  # [T, hidden]
        else:
            assert hidden_in is not None and residual_in is not None
            hidden, residual = hidden_in, residual_in
        start = self.layer_start
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            # NOTE: `.forward`, not `__call__`: nn.Module's call path (hook checks) costs a few
            # microseconds per call, 240 calls a decode step; the engine registers no hooks.
            hidden, residual = layer.forward(hidden, residual, kv_cache, ctx)
            if on_layer is not None:
                on_layer(start + i)
        if not pp.is_last:
            return hidden, residual
        norm = self.norm
        assert norm is not None  # the last stage's
        if residual is None:
            return norm(hidden), None
        return norm.add_and_norm(hidden, residual)[0], None

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return self._lookup(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.embed_tokens.num_embeddings)
        hidden = self._lookup(local.masked_fill(outside, 0))
        hidden.masked_fill_(outside[:, None], 0.0)
        return self.tp.all_reduce(hidden)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embedding_in_head:  # the quantized tied head is the table
            assert isinstance(self.tied_head, QuantizedLinear)
            return gather_rows(self.tied_head, ids, self.embed_tokens.weight.dtype)
        return self.embed_tokens(ids)

    def logits_on_first_rank(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The full logits ([N, vocab] fp32) on TP rank 0, None on the others: each rank
        computes its vocabulary shard and rank 0, the one that samples, gathers them (every
        rank of the group must call this at the same point). None on every rank of a pipeline
        stage before the last, which computes nothing."""
        if not self.tp.pp.is_last:
            return None
        if self.lm_head is not None:
            logits = self.lm_head(hidden)
        else:
            assert self.tied_head is not None  # set by load_weights
            logits = self.tied_head(hidden)
        return self.tp.gather_last_dim(logits.float(), self.vocab_sizes)  # [N, vocab]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The full logits ([N, vocab] fp32) of a single rank or TP rank 0."""
        logits = self.logits_on_first_rank(hidden)
        if logits is None:
            raise RuntimeError("only tensor-parallel rank 0 holds the full logits")
        return logits

    def pack_for_cpu(self) -> int:
        """Reorder projection weights once into oneDNN's layout where that pays (engine/model/
        packed_linear.py); a tied LM head gets a packed copy. Returns the layers packed."""
        count = pack_linears(self)
        head = self.tied_head
        tied_dense = isinstance(head, TiedLinear) and head.cpu_kernel is None
        if self.lm_head is None and tied_dense and can_pack(self.embed_tokens.weight):
            self.tied_head = PackedLinear.from_weight(self.embed_tokens.weight)
            count += 1
        # bf16 without native bf16: duet's kernel for what oneDNN would emulate.
        return count + use_dense_kernel(self)

    def weight_slice(self, name: str, shape: tuple[int, ...]) -> TensorSlice | None:
        """The part of the checkpoint tensor `name` (HF's name, full `shape`) this rank holds
        (`WeightPlacement.weight_slice`, engine/model/placement.py)."""
        return self.placement.weight_slice(name, shape)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into the fused parameters: whole tensors, of which each rank
        keeps its shard, or tensors already cut to `weight_slice` (sharded loading); then
        finish the quantized layers and a tied head. Returns the names it loaded."""
        loaded, quantized_embedding = copy_weights(self, self.placement, weights)
        for layer in self.layers:
            if isinstance(layer.self_attn, MLAttention):
                layer.self_attn.absorb()
        table = self.embed_tokens.weight
        finalize_quantized(self, table.dtype, table.device)
        if self.lm_head is None and self.tp.pp.is_last:  # the head is the embedding table
            self.tied_head = head = tied_head(table, self.quant, quantized_embedding)
            if isinstance(head, QuantizedLinear) and can_gather_rows(head):
                # one quantized table for both (engine/model/quantized_embedding.py)
                empty = torch.empty(0, table.shape[1], dtype=table.dtype, device=table.device)
                self.embed_tokens.weight = nn.Parameter(empty, requires_grad=False)
                self.embedding_in_head = True
        return loaded
