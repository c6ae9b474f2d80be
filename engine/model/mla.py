"""DeepSeek-V2/V3's multi-head latent attention (MLA), with HF transformers' semantics and the
absorbed form for every step (DeepSeek-V2 paper, section 2.1.2; vLLM's and SGLang's MLA).

Per token: the query (q_proj, or q_a_proj -> q_a_layernorm -> q_b_proj) splits per head into
q_nope and q_pe; kv_a_proj_with_mqa gives the latent c (kv_a_layernorm applied) and one roped
key part k_pe for every head. The paged cache keeps only [c | k_pe] (engine/model/latent_attention.py).
HF expands c through kv_b_proj into each head's k_nope and value; here kv_b_proj is split at
load into its per-head key part W_UK [qk_nope, kv_lora] and value part W_UV [v_head, kv_lora]
(`absorb`): q_nope.k_nope = (W_UK^T q_nope).c, so each head's query becomes
[W_UK^T q_nope | q_pe] and attends over the entries directly; its latent result times W_UV is
the head's output, then o_proj. Prefill chunks take the same path (no expanded K/V).

The rotary part follows HF: DeepSeek pairs dims (x0, x1), (x2, x3), ... (V2 always, V3 with
`rope_interleave`), else rotate-half. The result is stored de-interleaved (each pair's first
dims, then its second), the same permutation for q_pe and k_pe, which leaves q_pe.k_pe as HF's.
Under yarn, cos and sin are multiplied by HF's attention factor and the softmax scale by
mscale(mscale_all_dim)^2 (`MLAConfig`).

Tensor parallelism shards the heads: a rank holds its heads' rows of q_proj (or q_b_proj) and
kv_b_proj and their columns of o_proj, and one all-reduce after o_proj sums the ranks' parts.
The latent is every head's, so q_a_proj, kv_a_proj_with_mqa and the norms are whole on every
rank, each rank computes the same entries and caches them whole (the cache is replicated, as a
KV head shared by several ranks is: `KVLayout.shipped_range` ships it from one rank). Not yet:
TP with `attention_bias` (o_proj's bias would be added once per rank: `check_mla_layout`
refuses it, naming the option). Pipeline stages and expert parallelism work as for the other
models (engine/pipeline.py, engine/model/moe.py); quantization quantizes the projections
except kv_b_proj, whose absorbed halves stay dense.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from duet.engine.errors import InvalidInputError
from duet.engine.model.arch import ModelArchConfig
from duet.engine.model.latent_attention import latent_attention, write_latent_cache
from duet.engine.model.mlp import make_linear
from duet.engine.model.norm import RMSNorm
from duet.engine.model.row_invariant import Linear
from duet.engine.parallel import HeadShard, TensorParallel
from duet.engine.quant.config import QuantizationConfig

if TYPE_CHECKING:
    from duet.engine.attention_metadata import AttentionMetadata
    from duet.engine.model.forward_context import ForwardContext

_LORA_NORM_EPS = 1e-6
"""HF's q_a_layernorm and kv_a_layernorm take the RMSNorm default, not `rms_norm_eps`."""


def check_mla_layout(arch: ModelArchConfig, tensor_parallel_size: int) -> None:
    """Raise `InvalidInputError` naming `tensor_parallel_size` for an MLA model with
    `attention_bias` split over ranks, the one layout it cannot take yet. (Pipeline stages,
    expert parallelism and quantization work as for the other models.)"""
    if arch.mla is None:
        return
    if tensor_parallel_size != 1 and arch.attention_bias:
        raise InvalidInputError(
            "tensor_parallel_size",
            f"must be 1 for {arch.architecture} with attention_bias (multi-head latent "
            f"attention's o_proj bias is not split over ranks yet); got {tensor_parallel_size}",
        )


def mla_weight_shapes(arch: ModelArchConfig, prefix: str) -> list[tuple[str, tuple[int, ...]]]:
    """A layer's attention tensors under `prefix` ("model.layers.N."): (HF name, shape)."""
    mla = arch.mla
    assert mla is not None
    h, heads = arch.hidden_size, arch.num_attention_heads
    qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    a = prefix + "self_attn."
    shapes: list[tuple[str, tuple[int, ...]]]
    if mla.q_lora_rank is None:
        shapes = [(a + "q_proj.weight", (heads * qk, h))]
    else:
        rank = mla.q_lora_rank
        shapes = [
            (a + "q_a_proj.weight", (rank, h)),
            (a + "q_a_layernorm.weight", (rank,)),
            (a + "q_b_proj.weight", (heads * qk, rank)),
        ]
    shapes += [
        (a + "kv_a_proj_with_mqa.weight", (mla.entry_size, h)),
        (a + "kv_a_layernorm.weight", (mla.kv_lora_rank,)),
        (
            a + "kv_b_proj.weight",
            (heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank),
        ),
        (a + "o_proj.weight", (h, heads * mla.v_head_dim)),
    ]
    if arch.attention_bias:
        if mla.q_lora_rank is not None:
            shapes.append((a + "q_a_proj.bias", (mla.q_lora_rank,)))
        shapes += [(a + "kv_a_proj_with_mqa.bias", (mla.entry_size,)), (a + "o_proj.bias", (h,))]
    return shapes


def mla_shard_rows(arch: ModelArchConfig, heads: HeadShard) -> dict[str, tuple[int, int, int]]:
    """HF module suffix -> (this rank's [start, end) of its tensor, the dimension) for the
    projections tensor parallelism shards by head; the rest are whole on every rank."""
    mla = arch.mla
    assert mla is not None
    qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    kv = mla.qk_nope_head_dim + mla.v_head_dim
    start, end = heads.q_start, heads.q_end
    return {
        "self_attn.q_proj": (start * qk, end * qk, 0),
        "self_attn.q_b_proj": (start * qk, end * qk, 0),
        "self_attn.kv_b_proj": (start * kv, end * kv, 0),
        "self_attn.o_proj": (start * mla.v_head_dim, end * mla.v_head_dim, 1),
    }


class MLAttention(nn.Module):
    """One layer's latent attention (this rank's heads); parameters under HF's names, except
    kv_b_proj, which `absorb` replaces with the per-head `k_absorb` and `v_absorb` products."""

    def __init__(
        self, cfg: ModelArchConfig, tp: TensorParallel, quant: QuantizationConfig | None = None
    ) -> None:
        super().__init__()
        mla = cfg.mla
        assert mla is not None
        self.tp = tp
        self.num_heads = heads = tp.heads(cfg.num_attention_heads, 1).num_heads
        self.nope = mla.qk_nope_head_dim
        self.rope = mla.qk_rope_head_dim
        self.latent = mla.kv_lora_rank
        self.v_head_dim = mla.v_head_dim
        self.scale = mla.softmax_scale
        self.interleave = mla.rope_interleave
        self.rope_factor = mla.rope_attention_factor
        hidden, bias = cfg.hidden_size, cfg.attention_bias
        qk = self.nope + self.rope
        # registered even when None, so that forward finds every one in `_modules`
        rank = mla.q_lora_rank
        # dense or quantized (`make_linear`); kv_b_proj stays dense: `absorb` splits its weight
        q_proj = make_linear(hidden, heads * qk, False, quant) if not rank else None
        self.register_module("q_proj", q_proj)
        self.register_module("q_a_proj", make_linear(hidden, rank, bias, quant) if rank else None)
        self.register_module("q_a_layernorm", RMSNorm(rank, _LORA_NORM_EPS) if rank else None)
        q_b_proj = make_linear(rank, heads * qk, False, quant) if rank else None
        self.register_module("q_b_proj", q_b_proj)
        self.kv_a_proj_with_mqa = make_linear(hidden, mla.entry_size, bias, quant)
        self.kv_a_layernorm = RMSNorm(self.latent, _LORA_NORM_EPS)
        self.kv_b_proj: Linear | None = Linear(
            self.latent, heads * (self.nope + self.v_head_dim), bias=False
        )
        self.k_absorb = nn.ModuleList()
        """Per head: W_UK^T as a [kv_lora, qk_nope] linear (q_nope -> latent space)."""
        self.v_absorb = nn.ModuleList()
        """Per head: W_UV, a [v_head, kv_lora] linear (latent result -> the head's output)."""
        self.o_proj = make_linear(heads * self.v_head_dim, hidden, bias, quant)
        self.grouped_kernel: Any = None
        """With `group_absorb_cpu`: duet's dense CPU kernel module, which runs every head's
        absorbed product of a kind as one grouped call on the panels below."""
        self.k_panels: nn.Parameter | None
        self.v_panels: nn.Parameter | None
        self.register_parameter("k_panels", None)  # [H, tiles, nope, tile]
        self.register_parameter("v_panels", None)  # [H, tiles, latent, tile]

    def group_absorb_cpu(self, kernel: Any) -> bool:
        """Every head's k_absorb and v_absorb as one grouped call each on duet's dense CPU
        kernel (engine/kernels/grouped_linear_cpu.cpp: the per-head products' element order
        at any row count, so batch-invariant), instead of two Python-driven products per head
        (256 a layer for DeepSeek-V3's 128 heads). False (nothing changed) unless they are
        plain fp32 or bf16 `Linear`s on the CPU the kernel packs as panels (not AMX pairs)."""
        from duet.engine.model.grouped_experts_cpu import plain_weights, stacked_panels

        ks = plain_weights(list(self.k_absorb))
        vs = plain_weights(list(self.v_absorb))
        k_panels = stacked_panels(ks, kernel) if ks else None
        v_panels = stacked_panels(vs, kernel) if vs else None
        if k_panels is None or v_panels is None:
            return False
        self.k_panels = nn.Parameter(k_panels, requires_grad=False)
        self.v_panels = nn.Parameter(v_panels, requires_grad=False)
        self.grouped_kernel = kernel
        self.k_absorb = nn.ModuleList()
        self.v_absorb = nn.ModuleList()
        return True

    def _absorb_queries(self, q_nope: torch.Tensor, out: torch.Tensor) -> None:
        """Each head's W_UK^T q_nope ([T, H, nope]) into `out` ([T, H, latent])."""
        if self.grouped_kernel is not None:
            num_tokens, heads = q_nope.shape[0], self.num_heads
            rows = q_nope.transpose(0, 1).reshape(heads * num_tokens, self.nope)  # by head
            got = self.grouped_kernel.grouped_dense_linear(
                rows, self.k_panels, [num_tokens] * heads, self.latent
            )
            out.copy_(got.view(heads, num_tokens, self.latent).transpose(0, 1))
            return
        parts: dict[str, Any] = self._modules  # see DecoderLayer.forward
        k_absorb: dict[str, Any] = parts["k_absorb"]._modules
        for h in range(self.num_heads):
            out[:, h] = k_absorb[str(h)].forward(q_nope[:, h].contiguous())

    def _absorb_values(self, latent: torch.Tensor) -> torch.Tensor:
        """Each head's W_UV times its latent result ([T, H, latent]): [T, H * v_head]."""
        num_tokens, heads = latent.shape[0], self.num_heads
        if self.grouped_kernel is not None:
            rows = latent.transpose(0, 1).reshape(heads * num_tokens, self.latent)
            got = self.grouped_kernel.grouped_dense_linear(
                rows, self.v_panels, [num_tokens] * heads, self.v_head_dim
            )
            return (
                got.view(heads, num_tokens, self.v_head_dim)
                .transpose(0, 1)
                .reshape(num_tokens, heads * self.v_head_dim)
            )
        parts: dict[str, Any] = self._modules
        v_absorb: dict[str, Any] = parts["v_absorb"]._modules
        outs = [v_absorb[str(h)].forward(latent[:, h].contiguous()) for h in range(heads)]
        return torch.cat(outs, dim=-1)

    def absorb(self) -> None:
        """Split the loaded kv_b_proj into the per-head products and drop it (its bytes move,
        none are added)."""
        kv_b = self.kv_b_proj
        assert kv_b is not None, "absorb runs once, after loading"
        weight = kv_b.weight.view(self.num_heads, self.nope + self.v_head_dim, self.latent)
        device, dtype = weight.device, weight.dtype
        for h in range(self.num_heads):
            k = Linear(self.nope, self.latent, bias=False, device=device, dtype=dtype)
            v = Linear(self.latent, self.v_head_dim, bias=False, device=device, dtype=dtype)
            with torch.no_grad():
                k.weight.copy_(weight[h, : self.nope].t())
                v.weight.copy_(weight[h, self.nope :])
            k.weight.requires_grad_(False)
            v.weight.requires_grad_(False)
            self.k_absorb.append(k)
            self.v_absorb.append(v)
        self.kv_b_proj = None

    def forward(
        self, hidden: torch.Tensor, kv_cache: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        inputs = self.prepare(hidden, ctx.positions, ctx.rotary)
        return self.output(self.attend(inputs, kv_cache, ctx.meta, ctx.workspace))

    # The three parts of `forward`; piecewise CUDA graphs (engine/piecewise_graphs.py)
    # capture `prepare` and `output` and run `attend` between them.
    @property
    def out_width(self) -> int:
        """Columns of `attend`'s result: every head's latent result."""
        return self.num_heads * self.latent

    def prepare(
        self, hidden: torch.Tensor, positions: torch.Tensor, rotary: Any
    ) -> tuple[torch.Tensor, ...]:
        """(the cache entries [T, latent + rope]: normed latent and rotated key part; the
        absorbed queries [T, H, latent + rope])."""
        num_tokens, heads = hidden.shape[0], self.num_heads
        parts: dict[str, Any] = self._modules  # see DecoderLayer.forward
        if parts["q_proj"] is not None:
            q = parts["q_proj"].forward(hidden)
        else:
            q_a = parts["q_a_layernorm"].forward(parts["q_a_proj"].forward(hidden))
            q = parts["q_b_proj"].forward(q_a)
        q = q.view(num_tokens, heads, self.nope + self.rope)
        compressed = parts["kv_a_proj_with_mqa"].forward(hidden)  # [T, latent + rope]
        latent = parts["kv_a_layernorm"].forward(compressed[:, : self.latent].contiguous())
        q_pe, k_pe = self._rotate(
            rotary, positions, q[..., self.nope :], compressed[:, None, self.latent :]
        )
        entries = torch.cat([latent, k_pe[:, 0]], dim=-1)  # [T, latent + rope]
        query = q.new_empty(num_tokens, heads, self.latent + self.rope)  # [T, H, latent + rope]
        self._absorb_queries(q[..., : self.nope], query[..., : self.latent])
        query[:, :, self.latent :] = q_pe
        return entries, query

    def attend(
        self,
        inputs: tuple[torch.Tensor, ...],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        workspace: Any,
    ) -> torch.Tensor:
        """The entries written into the latent cache, then attention over it: [T, H latent]."""
        entries, query = inputs
        write_latent_cache(kv_cache, entries, meta.slot_mapping, meta.kernel_batch is not None)
        out = latent_attention(query, kv_cache, meta, self.scale, self.latent)  # [T, H, latent]
        return out.reshape(out.shape[0], self.out_width)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """W_UV per head, o_proj and the tensor-parallel all-reduce of `attend`'s result."""
        parts: dict[str, Any] = self._modules
        latent = out.view(out.shape[0], self.num_heads, self.latent)
        return self.tp.all_reduce(parts["o_proj"].forward(self._absorb_values(latent)))

    def _rotate(
        self, rotary: Any, positions: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q_pe [T, H, rope] and k_pe [T, 1, rope] rotated in fp32 (HF's V2 computes in fp32),
        de-interleaved where DeepSeek interleaves: (q_pe, k_pe) in the input's dtype."""
        cos = rotary.cos[positions].unsqueeze(1)  # [T, 1, rope / 2]
        sin = rotary.sin[positions].unsqueeze(1)
        if self.rope_factor != 1.0:
            cos, sin = cos * self.rope_factor, sin * self.rope_factor
        return _rotate(q_pe, cos, sin, self.interleave), _rotate(k_pe, cos, sin, self.interleave)


def group_mla_absorb_cpu(model: nn.Module) -> int:
    """On the CPU with duet's kernels: every latent attention layer's absorbed products as two
    grouped calls (`MLAttention.group_absorb_cpu`), before any other packing takes them.
    Returns how many layers (0 without the kernel, or where they do not qualify)."""
    from duet.engine.model.dense_cpu_linear import load_dense_kernel

    layers = [m for m in model.modules() if isinstance(m, MLAttention)]
    kernel = load_dense_kernel() if layers else None
    if kernel is None:
        return 0
    return sum(layer.group_absorb_cpu(kernel) for layer in layers)


def _rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool
) -> torch.Tensor:
    xf = x.float()
    if interleave:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
