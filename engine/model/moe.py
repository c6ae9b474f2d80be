"""Mixture-of-experts feed-forward layers (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3): a
router that picks each token's top-k experts, the experts computed as grouped products over the
tokens each one received, and a shared expert: Qwen2-MoE's behind its sigmoid gate, DeepSeek's
added as is.

Routing follows HF transformers' `*TopKRouter`s: router logits in the model's dtype, a softmax in
fp32, the top k, divided by their sum where the architecture renormalises (`MoEConfig`);
DeepSeek's group-limited and sigmoid routers are engine/model/deepseek_router.py's.

The grouped products: a step's (token, choice) pairs are sorted by expert (stably, so each
expert sees its tokens in batch order), each expert runs one gate|up and one down product on its
rows, and the results, scaled by their routing weights, land in a [T, k, hidden] buffer at their
(token, choice) slot. A token's k results are then added in expert order, as HF's loop of
`index_add_` adds them. Each expert is a pair of the dense path's row-invariant linears
(`row_invariant.Linear`, or `QuantizedLinear`), so a token's output does not depend on which
other tokens its experts received (docs/determinism.md), and the load-time probe, packing,
duet's CPU kernel and the quantized kernels apply to experts as to any projection. On the CPU,
dense fp32 and bf16 experts instead take duet's grouped kernel (`group_moe_experts_cpu`,
grouped_experts_cpu.py): one call for every expert's gate|up product and one for the downs,
the same element order at any row count.

With tensor parallelism each rank holds a slice of every expert's intermediate size (as of the
dense MLP's) and the router whole; the routed and shared outputs are partial sums that meet in
one all-reduce per layer. With expert parallelism (`TensorParallel.expert_parallel`, E = the TP
size) each rank holds a contiguous 1/E of the routed experts whole instead, and computes only
the (token, choice) pairs routed to them; the shared expert stays sliced. Every rank routes
every token (attention leaves each rank the whole batch), so the same one all-reduce sums
the experts' contributions: no all-to-all (docs/parallelism.md says why). Under data-parallel
attention (`TensorParallel.exchange`) each rank has its own tokens and 1/size of the experts, and
the rows travel by all-to-all instead (engine/model/moe_exchange.py). Each block counts
the (token, choice) pairs its router picks, for every expert, into the model's `ExpertLoad`
(expert_load.py), from the same count that cuts the rows per expert (the fused Triton
kernel, which needs no count, adds them on the device).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from duet.engine.errors import InvalidInputError
from duet.engine.model.arch import ModelArchConfig, MoEConfig
from duet.engine.model.deepseek_router import route_deepseek
from duet.engine.model.expert_load import ExpertLoad, record_expert_ids
from duet.engine.model.grouped_experts_cpu import CpuGroupedExperts
from duet.engine.model.grouped_quant_experts_cpu import CpuGroupedQuantExperts
from duet.engine.model.mlp import MLP
from duet.engine.model.moe_combine import combine_choices, expert_outputs
from duet.engine.model.moe_exchange import exchanged_experts
from duet.engine.model.row_invariant import Linear
from duet.engine.parallel import SINGLE, TensorParallel
from duet.engine.quant.config import QuantizationConfig

logger = logging.getLogger(__name__)


GROUPED = (CpuGroupedExperts, CpuGroupedQuantExperts)
"""The routed experts as one module with one call for all (`forward(rows, counts)`)."""


def check_ep_size(ep_size: int, moe: MoEConfig | None) -> None:
    """Raise `InvalidInputError` naming `expert_parallel_size` unless it is 1, or the model is
    a mixture whose routed experts divide into `ep_size` whole shares."""
    if ep_size == 1:
        return
    if moe is None:
        raise InvalidInputError(
            "expert_parallel_size",
            f"must be 1 for a dense model (it has no routed experts to shard); got {ep_size}",
        )
    if moe.num_experts % ep_size:
        raise InvalidInputError(
            "expert_parallel_size",
            f"must divide the model's routed experts ({moe.num_experts}) into whole shares "
            f"(1 or a divisor of {moe.num_experts} equal to tensor_parallel_size); got {ep_size}",
        )


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k]) from router `logits` ([T, E]), each token's
    choices in ascending expert order: HF's softmax in fp32, top k, optional renormalisation."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        # NOTE: added in choice order, one column at a time, rather than `sum`, whose reduction
        # order over a row is torch's choice (it may vectorize across rows, or split a row).
        total = weights[:, :1]
        for k in range(1, top_k):
            total = total + weights[:, k : k + 1]
        weights = weights / total
    ids, order = ids.sort(dim=-1)  # HF adds a token's experts in expert order
    return weights.gather(-1, order), ids


def grouped_experts(
    x: torch.Tensor,  # [T, hidden]
    experts: nn.ModuleList | CpuGroupedExperts | CpuGroupedQuantExperts,  # first, first + 1, ...
    weights: torch.Tensor,  # [T, k], fp32
    ids: torch.Tensor,  # [T, k], ascending per row
    weights_in_model_dtype: bool,
    num_experts: int | None = None,
    first: int = 0,
    counts_into: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum over each token's k experts of weight * expert(token): [T, hidden] in `x`'s dtype.
    `experts`: MLPs without their all-reduce, one gate|up and one down product each over the
    rows it received, or `CpuGroupedExperts`, one call for all. With expert parallelism they
    are the model's `num_experts` experts [first, first + the local number): the (token,
    choice) pairs routed to others add zeros (their ranks add the products). `counts_into`
    ([num_experts] int64): the step's (token, choice) pairs per expert are added to it (the
    model's `ExpertLoad` row), from the count that cuts the rows."""
    top_k = ids.shape[1]
    if isinstance(experts, GROUPED):
        num_local = experts.num_experts
    else:
        num_local = len(experts)
    num_experts = num_experts or num_local
    flat = ids.reshape(-1)  # [T k]
    order = torch.argsort(flat, stable=True)  # (token, choice) slots grouped by expert
    # NOTE: the counts come to the host to cut the rows per expert: a sync per layer on CUDA,
    # where dense experts take the fused Triton kernel instead (`fuse_experts`); quantized ones
    # stay here, one reason MoE models decode without CUDA graphs for now.
    counted = torch.bincount(flat, minlength=num_experts)  # [E]
    if counts_into is not None:
        counts_into.add_(counted)
    counts = counted.tolist()
    start = sum(counts[:first])  # this rank's experts' slots are one run of `order`
    end = start + sum(counts[first : first + num_local])
    order = order[start:end]
    rows = x.index_select(0, order // top_k)  # [slots, hidden], grouped by expert
    y = expert_outputs(experts, rows, counts[first : first + num_local])  # [slots, hidden]
    return combine_choices(y, order, weights, weights_in_model_dtype, x, top_k)


def sigmoid_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.sigmoid of `x` ([T, 1]), each row's bits independent of T.

    NOTE: torch's CPU sigmoid runs a contiguous tensor through vector code (SLEEF's exp) and
    its last few elements through scalar code (std::exp), which differ in the last bit: a
    [T, 1] tensor's row got other bits depending on where it fell (7 of 300 fp32 rows differed
    from the row alone). A strided tensor takes the scalar code for every element, as a row
    alone does."""
    if x.device.type != "cpu":
        return torch.sigmoid(x)
    rows = x.shape[0]
    strided = x.new_empty(rows, 2)[:, 0]
    strided.copy_(x[:, 0])
    out = x.new_empty(rows, 2)[:, 0]
    torch.sigmoid(strided, out=out)
    return out.unsqueeze(1)


class SparseMoeBlock(nn.Module):
    """A layer's feed-forward as a mixture of experts: the router (`gate`, never quantized, with
    DeepSeek-V3's `e_score_correction_bias`), the routed `experts`, and optionally the
    `shared_expert`, scaled by sigmoid(`shared_expert_gate`) (Qwen2-MoE) or not (DeepSeek)."""

    def __init__(
        self,
        cfg: ModelArchConfig,
        tp: TensorParallel,
        quant: QuantizationConfig | None,
    ) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        self.tp = tp
        self.top_k = moe.num_experts_per_tok
        self.num_experts = moe.num_experts
        self.expert_counts: torch.Tensor | None = None
        """This layer's row of the model's `ExpertLoad` ([E]), once attached."""
        self.expert_row_weight: torch.Tensor | None = None
        """While a CUDA graph's forward runs: 1 for its real rows, 0 for its padding rows (the
        fused path counts only the real ones); None otherwise (every row counts)."""
        self.moe = moe
        self.renormalize = moe.renormalize
        self.weights_in_model_dtype = moe.weights_in_model_dtype
        self.deepseek_routing = moe.checkpoint_names == "deepseek"
        hidden = cfg.hidden_size
        self.gate = Linear(hidden, moe.num_experts, bias=False)
        self.first_expert, end = tp.expert_range(moe.num_experts)
        """This rank's experts are the model's [first_expert, first_expert + len(experts))."""
        # With expert parallelism a rank's experts are whole (their intermediate unsliced);
        # with an exchange (data-parallel attention) too, and the rank runs no TP of its own.
        self.exchange = tp.exchange
        assert self.exchange is None or not tp.enabled, "an expert exchange runs at TP 1"
        expert_tp = SINGLE if tp.expert_parallel or self.exchange is not None else tp
        self.experts = nn.ModuleList(
            MLP(hidden, moe.intermediate_size, expert_tp, quant, reduce=False)
            for _ in range(self.first_expert, end)
        )
        # With `fuse_experts`: every expert's gate|up weight [E, 2 I, hidden] and down weight
        # [E, hidden, I] for the fused Triton kernel, in place of the per-expert layers.
        self.w13: nn.Parameter | None
        self.w2: nn.Parameter | None
        self.register_parameter("w13", None)
        self.register_parameter("w2", None)
        size = moe.shared_expert_intermediate_size
        # registered even when None, so that forward finds both in `_modules`
        self.register_module(
            "shared_expert", MLP(hidden, size, tp, quant, reduce=False) if size else None
        )
        gated = size and moe.shared_expert_gated
        self.register_module("shared_expert_gate", Linear(hidden, 1, bias=False) if gated else None)
        bias = moe.topk_method == "noaux_tc"
        self.e_score_correction_bias: nn.Parameter | None
        self.register_parameter(
            "e_score_correction_bias",
            nn.Parameter(torch.zeros(moe.num_experts), requires_grad=False) if bias else None,
        )
        # With `group_experts_cpu`: every local expert on duet's grouped CPU kernel, in place of
        # the per-expert layers (registered even when None: forward finds it in `_modules`).
        self.cpu_experts: CpuGroupedExperts | CpuGroupedQuantExperts | None
        self.register_module("cpu_experts", None)

    def group_experts_cpu(self, kernel: Any) -> bool:
        """Every local expert as grouped products: dense fp32 or bf16 `Linear`s (not
        AMX-packed) on duet's dense CPU kernel (`kernel`, dense_cpu_linear.load_dense_kernel;
        grouped_experts_cpu.py), the per-expert layers dropped; int8 or int4 ones on duet's
        quantized kernels (grouped_quant_experts_cpu.py), the per-expert layers kept over the
        same buffers. False (nothing changed) where they are neither."""
        dense = CpuGroupedExperts.from_experts(self.experts, kernel)
        if dense is not None:
            self.experts = nn.ModuleList()  # frees the per-expert weights
            self.cpu_experts = dense
            return True
        quantized = CpuGroupedQuantExperts.from_experts(self.experts)
        self.cpu_experts = quantized
        return quantized is not None

    def fuse_experts(self) -> bool:
        """Stack the experts' weights (this rank's, with expert parallelism) for
        `triton_moe.fused_experts` (CUDA, or the Triton interpreter in tests) and drop the
        per-expert layers; under the expert exchange, the rows this rank receives take
        `triton_moe.expert_rows` over the same weights. False (nothing changed) unless every expert is a plain dense
        `Linear` pair (not quantized, not on a CPU kernel)."""
        experts = [e for e in self.experts if isinstance(e, MLP)]
        pairs = [(e.gate_up_proj, e.down_proj) for e in experts]
        if not experts or not all(
            type(m) is Linear and m.cpu_kernel is None for pair in pairs for m in pair
        ):
            return False
        w13 = torch.stack([gate_up.weight for gate_up, _ in pairs])  # type: ignore[misc]
        w2 = torch.stack([down.weight for _, down in pairs])  # type: ignore[misc]
        self.experts = nn.ModuleList()  # frees the per-expert weights
        self.w13 = nn.Parameter(w13, requires_grad=False)
        self.w2 = nn.Parameter(w2, requires_grad=False)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        parts: dict[str, Any] = self._modules  # see DecoderLayer.forward
        if self.exchange is not None:
            return self._exchanged(x)
        weights, ids = self._route(x)
        w13, w2 = self._parameters["w13"], self._parameters["w2"]
        if w13 is not None and w2 is not None:
            from duet.engine.kernels.triton_moe import fused_experts

            if self.expert_counts is not None:
                record_expert_ids(self.expert_counts, ids, self.expert_row_weight)
            out = fused_experts(
                x, w13, w2, weights, ids, self.weights_in_model_dtype, self.first_expert,
                local=w13.shape[0] < self.num_experts,
            )  # fmt: skip
        else:
            grouped = parts["cpu_experts"]
            out = grouped_experts(
                x, parts["experts"] if grouped is None else grouped, weights, ids,
                self.weights_in_model_dtype, self.num_experts, self.first_expert,
                self.expert_counts,  # counted where the rows are cut, not twice
            )  # fmt: skip
        return self.tp.all_reduce(self._add_shared(x, out))

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate: Any = self._modules["gate"]
        logits = gate.forward(x)  # [T, E]
        if self.deepseek_routing:
            return route_deepseek(logits, self.moe, self._parameters["e_score_correction_bias"])
        return route(logits, self.top_k, self.renormalize)

    def _add_shared(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        parts: dict[str, Any] = self._modules
        shared = parts["shared_expert"]
        if shared is not None and parts["shared_expert_gate"] is None:
            out = out + shared.forward(x)
        elif shared is not None:
            gate = sigmoid_rows(parts["shared_expert_gate"].forward(x))  # [T, 1]
            out = out + gate * shared.forward(x)
        return out

    def _exchanged(self, x: torch.Tensor) -> torch.Tensor:
        """The layer under data-parallel attention (engine/model/moe_exchange.py). With no
        tokens of its own (T = 0) a rank still serves the rows others route to its experts."""
        assert self.exchange is not None
        if x.shape[0] == 0:
            weights = x.new_empty(0, self.top_k, dtype=torch.float32)
            ids = torch.empty(0, self.top_k, dtype=torch.int64, device=x.device)
        else:
            weights, ids = self._route(x)
        w13, w2 = self._parameters["w13"], self._parameters["w2"]
        grouped = self._modules["cpu_experts"]
        experts: Any = self._modules["experts"] if grouped is None else grouped
        if w13 is not None and w2 is not None:
            experts = _FusedRows(w13, w2)
        out = exchanged_experts(
            x, experts, weights, ids, self.weights_in_model_dtype, self.num_experts,
            self.exchange, self.expert_counts,
        )  # fmt: skip
        return out if x.shape[0] == 0 else self._add_shared(x, out)


class _FusedRows:
    """A rank's stacked experts (`fuse_experts`) as `moe_combine.expert_outputs` calls a grouped
    module: rows grouped by expert through the fused Triton kernel."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        self.w13, self.w2 = w13, w2

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        from duet.engine.kernels.triton_moe import expert_rows

        return expert_rows(rows, self.w13, self.w2, counts)


def fuse_moe_experts(model: nn.Module, device: torch.device) -> int:
    """On CUDA where Triton runs: every sparse block's experts on the fused kernel (one launch
    for all experts' gate|up products and one for the downs, no host sync) instead of a product
    per expert; with expert parallelism, this rank's experts, the others' slots skipped.
    Returns how many blocks."""
    from duet.engine.kernels.triton_runtime import triton_unusable_reason

    if device.type != "cuda" or triton_unusable_reason(device) is not None:
        return 0
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    return sum(block.fuse_experts() for block in blocks)


def group_moe_experts_cpu(model: nn.Module) -> int:
    """On the CPU with duet's kernels: every sparse block's dense experts as grouped products on
    the dense kernel (grouped_experts_cpu.py), before any other packing takes them. Returns
    how many blocks (0 without the kernel, or where the experts do not qualify)."""
    from duet.engine.model.dense_cpu_linear import load_dense_kernel

    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    kernel = load_dense_kernel() if blocks else None
    if kernel is None:
        return 0
    count = sum(block.group_experts_cpu(kernel) for block in blocks)
    if count:
        logger.info("%d sparse layers' experts on duet's grouped CPU kernel", count)
    return count


def use_dense_kernel_for_routers(model: nn.Module) -> int:
    """On the CPU: every sparse block's router (`gate`, the expert count's outputs) on duet's
    dense kernel, whatever the dtype and mode (batch-invariant by construction). So few output
    channels are all overhead in oneDNN's packed bf16 product: at one row a [64, 1024] router
    took it 13x the kernel's time, and the benchmark MoE model decoded 10% faster at one stream.
    Only routers whose expert count fills the kernel's panels (64, 128, 256 experts; not the
    tiny test models' 8 or 16, nor Qwen2-MoE's one-output shared-expert gate): padding would
    make the weights outgrow what `duet plan` counts. Returns how many layers."""
    from duet.engine.model.dense_cpu_linear import fills_panels, load_dense_kernel, set_dense_kernel

    kernel = load_dense_kernel()
    blocks = [block for block in model.modules() if isinstance(block, SparseMoeBlock)]
    if kernel is None or not blocks:
        return 0
    layers: list[nn.Module] = [block.gate for block in blocks if fills_panels(kernel, block.gate)]
    if not layers or not set_dense_kernel(layers):
        return 0
    return len(layers)


def experts_read_on_host(model: nn.Module) -> bool:
    """Whether a forward of `model` reads device values on the host in its sparse layers, which
    a CUDA graph cannot hold: each expert's row count (the per-expert and grouped paths) or the
    exchange's all-to-all sizes (data-parallel attention). False for a dense model and for one
    whose every sparse block runs the fused Triton kernel (`fuse_experts`), with no exchange."""
    return any(
        isinstance(m, SparseMoeBlock) and (m.exchange is not None or m.w13 is None)
        for m in model.modules()
    )


def attach_expert_load(model: nn.Module, device: torch.device) -> ExpertLoad | None:
    """One `ExpertLoad` for every sparse block of `model`, each block given its row; None
    (nothing attached) for a dense model."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    if not blocks:
        return None
    load = ExpertLoad(len(blocks), blocks[0].num_experts, device)
    for i, block in enumerate(blocks):
        block.expert_counts = load.counts[i]
    return load
