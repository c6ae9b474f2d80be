"""Where a checkpoint's tensors go in a Llama-family model (engine/model/llama.py), and putting
them there.

`WeightPlacement` answers, for one rank, which part of each HF-named tensor it holds (none of
another pipeline stage's or, with expert parallelism, of another rank's routed expert; a
tensor-parallel slice of a sharded layer's; or the whole tensor, as a rank's own whole experts)
and which of our fused parameters it fills, at which row (q|k|v, gate|up). The layout is
engine/parallel.py's; docs/parallelism.md describes sharded loading. `copy_weights` copies
tensors in, whole (each rank keeps its slice) or already cut to `WeightPlacement.weight_slice`;
`finalize_quantized` and `tied_head` finish the load: quantized layers into their kernel
layouts, and the LM head of a model whose head is its embedding table.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from duet.engine.model.arch import ModelArchConfig
from duet.engine.model.mla import mla_shard_rows
from duet.engine.model.mlp import mlp_shard
from duet.engine.model.moe_names import expert_placement, router_name
from duet.engine.model.quantized_linear import QuantizedLinear, quantize_linear
from duet.engine.model.row_invariant import TiedLinear
from duet.engine.parallel import HeadShard, TensorParallel, TensorSlice
from duet.engine.quant.config import QuantizationConfig
from duet.engine.quant.formats import QuantizedWeight


class Placement(NamedTuple):
    """Where a checkpoint tensor goes (`WeightPlacement.locate`)."""

    target: str
    """Our parameter's name."""
    offset: int
    """The first row it fills of a fused parameter (q|k|v, gate|up)."""
    rows: tuple[int, int] | None
    """This rank's [start, end) of the tensor along `dim`; None: every rank holds it whole."""
    dim: int


@dataclass(frozen=True)
class WeightPlacement:
    """One rank's part of the checkpoint: the model's shard of heads, vocabulary and layers
    (as `LlamaForCausalLM` built them), read to place HF-named tensors."""

    config: ModelArchConfig
    tp: TensorParallel
    heads: HeadShard
    """This rank's attention heads."""
    vocab_rows: tuple[int, int]
    """This rank's [start, end) of the embedding's and LM head's rows."""
    layers: tuple[int, int]
    """This stage's [start, end) of the model's layers."""
    holds_embedding: bool
    """Whether this stage holds the embedding table (the first; the last too for a tied head)."""

    def holds(self, name: str) -> bool:
        """Whether this rank holds the checkpoint tensor `name` (HF's name): not another
        pipeline stage's, nor (expert parallelism, or an expert exchange) another rank's
        routed expert."""
        target = name.removeprefix("model.")
        if target.startswith("layers."):
            if not self.layers[0] <= int(target.split(".", 2)[1]) < self.layers[1]:
                return False
            sharded = self.tp.expert_parallel or self.tp.exchange is not None
            expert = expert_placement(target) if sharded else None
            if expert is not None and expert[1] is not None and self.config.moe is not None:
                start, end = self.tp.expert_range(self.config.moe.num_experts)
                return start <= expert[1] < end  # another rank's experts: not read at all
            return True
        if target.startswith("embed_tokens."):
            return self.holds_embedding
        if target.startswith(("lm_head.", "norm.")):
            return self.tp.pp.is_last
        return True

    def skips(self, name: str) -> bool:
        """Whether loading passes over the checkpoint tensor `name`: another stage's, the rope
        tables' (made, not loaded), or a tied head's copy of the embedding some checkpoints
        store."""
        if "rotary_emb" in name or not self.holds(name):
            return True
        return name == "lm_head.weight" and self.config.tie_word_embeddings

    def weight_slice(self, name: str, shape: tuple[int, ...]) -> TensorSlice | None:
        """The part of the checkpoint tensor `name` (HF's name, full `shape`) this rank holds;
        None for a tensor every rank holds whole (norms, routers, and everything at one rank);
        an empty slice for another pipeline stage's tensor (not read at all)."""
        if not self.holds(name):
            return TensorSlice(0, 0, 0)
        if not self.tp.enabled:
            return None
        place = self.locate(name.removeprefix("model."))
        if place is None or place.rows is None:
            return None
        if place.dim == 1 and len(shape) < 2:
            return None  # a row-parallel layer's bias is whole on every rank
        return TensorSlice(place.dim, place.rows[0], place.rows[1])

    def local_name(self, name: str) -> str:
        """`name` with its layer index counted from this stage's first layer (our numbering)."""
        target = name.removeprefix("model.")
        if not self.layers[0] or not target.startswith("layers."):
            return target
        _, index, rest = target.split(".", 2)
        return f"layers.{int(index) - self.layers[0]}.{rest}"

    def locate(self, target: str) -> Placement | None:
        """Where the checkpoint tensor `target` (HF's name without "model.") goes: our
        parameter, the row offset in it, this rank's [start, end) of the tensor along `dim`
        (None: whole); None for a name the sharded layers do not cover (norms, routers: the
        name is ours as is)."""
        moe = self.config.moe
        if moe is not None:
            expert = expert_placement(target)
            if expert is not None:
                layer, index, proj = expert
                if index is None:
                    module, size = f"{layer}mlp.shared_expert", moe.shared_expert_intermediate_size
                else:  # numbered from this rank's first expert (0 without expert parallelism)
                    first = self.tp.expert_range(moe.num_experts)[0]
                    module, size = f"{layer}mlp.experts.{index - first}", moe.intermediate_size
                # with expert parallelism a rank's routed experts are whole
                whole = index is not None and self.tp.expert_parallel
                rows = None if whole else mlp_shard(size, self.tp)
                if proj == "down_proj":
                    return Placement(f"{module}.down_proj.weight", 0, rows, 1)
                width = size if rows is None else rows[1] - rows[0]
                offset = width if proj == "up_proj" else 0
                return Placement(f"{module}.gate_up_proj.weight", offset, rows, 0)
            router = router_name(target)
            if router is not None:
                return Placement(router, 0, None, 0)
        if self.config.mla is not None and ".self_attn." in f".{target}":
            # MLA's projections keep HF's names; a rank's heads of the sharded ones
            for hf, (start, end, dim) in mla_shard_rows(self.config, self.heads).items():
                if f".{hf}." in f".{target}":
                    return Placement(target, 0, (start, end), dim)
            return None  # the latent's: whole on every rank
        for hf, (ours, off, shard_rows, shard_dim) in self._shard_layout().items():
            if target == f"{hf}.weight" or f".{hf}." in f".{target}":
                return Placement(target.replace(hf, ours), off, shard_rows, shard_dim)
        return None

    def _shard_layout(self) -> dict[str, tuple[str, int, tuple[int, int], int]]:
        """HF module suffix -> (our module, row offset in the fused weight, this rank's
        [start, end) of the HF tensor, the dimension it is split along)."""
        cfg, d = self.config, self.config.head_dim
        h = self.heads
        q_rows = (h.q_start * d, h.q_end * d)
        kv_rows = (h.kv_start * d, h.kv_end * d)
        mlp_rows = mlp_shard(cfg.intermediate_size, self.tp)
        q, kv, inter = h.num_heads * d, h.num_kv_heads * d, mlp_rows[1] - mlp_rows[0]
        return {
            "self_attn.q_proj": ("self_attn.qkv_proj", 0, q_rows, 0),
            "self_attn.k_proj": ("self_attn.qkv_proj", q, kv_rows, 0),
            "self_attn.v_proj": ("self_attn.qkv_proj", q + kv, kv_rows, 0),
            "self_attn.o_proj": ("self_attn.o_proj", 0, q_rows, 1),
            "mlp.gate_proj": ("mlp.gate_up_proj", 0, mlp_rows, 0),
            "mlp.up_proj": ("mlp.gate_up_proj", inter, mlp_rows, 0),
            "mlp.down_proj": ("mlp.down_proj", 0, mlp_rows, 1),
            "embed_tokens": ("embed_tokens", 0, self.vocab_rows, 0),
            "lm_head": ("lm_head", 0, self.vocab_rows, 0),
        }


def copy_weights(
    model: nn.Module, placement: WeightPlacement, weights: Iterable[tuple[str, torch.Tensor]]
) -> tuple[set[str], QuantizedWeight | None]:
    """Copy HF-named tensors into `model`'s fused parameters (and its `QuantizedLinear`s'
    parts): whole tensors, of which each rank keeps its shard, or tensors already cut to
    `placement.weight_slice` (sharded loading). Returns the names it loaded, and a GGUF
    embedding kept quantized (for a tied head to reuse), if one came."""
    params = dict(model.named_parameters())
    slots = {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    tp_enabled = placement.tp.enabled
    quantized_embedding: QuantizedWeight | None = None
    loaded: set[str] = set()
    for name, tensor in weights:
        if placement.skips(name):
            continue
        target = placement.local_name(name)
        target, offset, rows, dim = placement.locate(target) or Placement(target, 0, None, 0)
        param, slot = params.get(target), slots.get(target)
        if param is None and slot is None:
            arch = placement.config.architecture
            raise KeyError(f"checkpoint tensor {name!r} has no place in {arch}")
        cut = rows is not None and tp_enabled and (dim == 0 or len(tensor.shape) == 2)
        if cut and rows is not None and tensor.shape[dim] != rows[1] - rows[0]:
            tensor = tensor.narrow(dim, rows[0], rows[1] - rows[0])  # a whole tensor
        if slot is not None:
            slot.load_part(offset, tensor)
        else:
            assert param is not None
            if not isinstance(tensor, torch.Tensor):  # a GGUF embedding kept quantized
                quantized_embedding = tensor if target == "embed_tokens.weight" else None
                tensor = tensor.dequantize()
            with torch.no_grad():
                param[offset : offset + tensor.shape[0]].copy_(tensor)
        loaded.add(name)
    return loaded, quantized_embedding


def finalize_quantized(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Turn every loaded `QuantizedLinear` of `model` into its kernel layout (or a dense
    fallback) for `dtype` on `device`."""
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, QuantizedLinear):
                setattr(parent, child_name, child.finalize(dtype, device))


def tied_head(
    table: torch.Tensor, quant: QuantizationConfig | None, quantized: QuantizedWeight | None
) -> nn.Module:
    """The LM head of a model whose head is its embedding `table` ([vocab shard, hidden]):
    the table itself, or a quantized copy when `quant` quantizes the head (a GGUF file's own
    quantized embedding, `quantized`, where it came so)."""
    if quant is None or not quant.lm_head:
        return TiedLinear(table)
    if quantized is not None and quant.method == "gguf":
        head = QuantizedLinear(table.shape[1], table.shape[0], False, quant)
        head.load_part(0, quantized)
        return head.finalize(table.dtype, table.device)
    if quant.method == "gguf":  # gguf with a full-precision embedding: keep the head dense
        return TiedLinear(table)
    return quantize_linear(table, None, quant, table.dtype)
