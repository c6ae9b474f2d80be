"""Piecewise CUDA graphs: any step's forward as graphs of the parts between its attention calls,
which run eagerly between the replays (vLLM v1's piecewise graphs; `cuda_graph_mode` piecewise).

Decode-only steps replay whole graphs (engine/cuda_graphs.py), whose attention metadata is
static. Every other step (a prefill chunk beside decodes, a speculative step with several query
tokens per request) ran eagerly: on an H200 an 8B model's eager step costs about 40 ms of host
launches before any compute (docs/gpu.md), so a step that takes in one new prompt's chunk
stalls every stream's next token. Here such a step of n <= `max_tokens` tokens runs, for the
smallest captured size T >= n:

    piece 0      embed, layer 0's norm and attention inputs (`prepare`: q|k|v
                 projection, q/k norm, rotary; MLA: absorbed queries, latent entries)  (a graph)
    attention 0  K/V written to the cache, paged attention over the n rows (`attend`)  (eager)
    piece i      layer i-1's `output` (o_proj, all-reduce), residual add + norm, MLP;
                 layer i's residual add + norm and attention inputs                  (a graph)
    ...
    piece L      the last layer's `output` and MLP, the final norm                  (a graph)

Only attention sees the step's shape (its metadata is host-built per step, its grid depends on
it); the pieces see T rows whatever the batch. Graphs fix addresses, so what crosses a piece's
edge lives in static buffers: the token ids and positions (rows past n: 0), the residual
stream, attention's inputs and attention's output (its rows past n keep old values:
rows are independent, and a mixture's expert load counts real rows only, `row_weight`). The
pieces of all sizes share one memory pool, captured largest first.

Per layer a replay launches one graph and attention's few kernels instead of every operator of
the layer. The tokens are the eager forward's where each row's arithmetic does not depend on
the rows beside it (the CPU kernels; on CUDA deterministic inference's Triton products; cuBLAS
may pick another kernel for T rows than for n, as for the decode graphs' padded batches).

A layer's attention module (`Attention`, and multi-head latent attention's `MLAttention`)
offers the three parts: `prepare(hidden, positions, rotary)` -> its inputs, `attend(inputs,
kv_cache, meta, workspace)` -> [T, `out_width`], `output(that)` -> [T, hidden]; its own
`forward` is the three in a row.

Not captured (those steps run eagerly): pipeline stages, data-parallel attention (its expert
exchange's sizes change with the step), mixtures whose experts are read on the host
(`moe.experts_read_on_host`), steps of more than `max_tokens` tokens (compute-bound).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from duet.engine.attention_metadata import AttentionMetadata
from duet.engine.cuda_graphs import CudaGraphCapture, GraphCapture, ReplayableGraph

MAX_TOKENS = 512
"""Largest step captured: beyond it a step's products, not its launches, set its time."""


def piecewise_max_tokens(max_num_batched_tokens: int) -> int:
    """The largest step an engine with this step budget captures in pieces."""
    return min(MAX_TOKENS, max_num_batched_tokens)


def piecewise_buckets(max_tokens: int) -> list[int]:
    """Captured sizes up to `max_tokens` (always included): 1, 2, 4, 8, multiples of 16 to
    256, then of 64."""
    sizes = [1, 2, 4, 8, *range(16, 257, 16), *range(320, max_tokens, 64)]
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens})


def piecewise_unsupported(model: Any) -> str | None:
    """Why `model`'s forward cannot be captured in pieces, or None when it can."""
    if model.tp.pp.num_stages > 1:
        return "pipeline stages"
    if model.tp.exchange is not None:
        return "data-parallel attention"
    if not all(hasattr(layer.self_attn, "prepare") for layer in model.layers):
        return "an attention without the three parts"
    return None


class PiecewiseGraphs:
    """The captured pieces of one model's forward, per size, and their static buffers.

    Invariants: built after the KV caches are allocated; `run` from one thread at a time (the
    static buffers are shared); the model is a single stage whose layers' attention offers
    `prepare`, `attend` and `output` (`piecewise_unsupported` is None)."""

    def __init__(
        self,
        model: Any,  # LlamaForCausalLM (not imported: engine.model imports engine.attention)
        kv_caches: list[torch.Tensor],
        max_tokens: int,
        capture: GraphCapture | None = None,
        sizes: Sequence[int] | None = None,
    ) -> None:
        """`max_tokens`: the largest step captured (`MAX_TOKENS`, or the step budget when it
        is smaller). `capture`: `CudaGraphCapture()` unless given (tests pass a stand-in).
        `sizes`: the sizes to capture, up to `max_tokens` (default `piecewise_buckets`; a
        benchmark captures the one it times)."""
        why = piecewise_unsupported(model)
        if why is not None:
            raise ValueError(f"piecewise CUDA graphs do not capture {why}")
        capture = capture or CudaGraphCapture()
        started = time.perf_counter()
        self.model = model
        self.kv_caches = kv_caches
        self.layers = list(model.layers)
        self.buckets = sorted(set(sizes)) if sizes else piecewise_buckets(max_tokens)
        if not 0 < self.buckets[0] <= self.buckets[-1] <= max_tokens:
            raise ValueError(f"sizes: must be in [1, {max_tokens}]; got {self.buckets}")
        cache = kv_caches[0]
        device, dtype = cache.device, cache.dtype
        reserved_before = capture.reserved_bytes(device)
        top = self.buckets[-1]
        hidden_size = model.config.hidden_size
        self.input_ids = torch.zeros(top, dtype=torch.int64, device=device)
        self.positions = torch.zeros(top, dtype=torch.int64, device=device)
        self.residual = torch.zeros(top, hidden_size, dtype=dtype, device=device)
        self.inputs: list[torch.Tensor] = []
        """Attention's inputs (every layer's alike), [top, ...] each: made by the first
        warm-up, of the largest size, from what `prepare` returns."""
        width = self.layers[0].self_attn.out_width
        self.attn_out = torch.zeros(top, width, dtype=dtype, device=device)
        self.out = torch.zeros(top, hidden_size, dtype=dtype, device=device)
        # A mixture's expert load counts real rows only: 1 a token, 0 a padding row.
        self.row_weight = torch.zeros(top, dtype=torch.int64, device=device)
        self._counted = [
            m for m in model.modules() if getattr(m, "expert_counts", None) is not None
        ]
        self.graphs: dict[int, list[ReplayableGraph]] = {}
        pool = None
        for size in reversed(self.buckets):  # largest first: the others fit in its pool
            pieces = [self._piece(i, size) for i in range(len(self.layers) + 1)]
            for piece in pieces:  # compiles the kernels, warms the allocator
                piece()
            capture.synchronize(device)
            captured = []
            for piece in pieces:
                graph, pool = capture.capture(piece, pool)
                captured.append(graph)
            self.graphs[size] = captured
        capture.synchronize(device)
        self.capture_s = time.perf_counter() - started
        """Seconds the capture took (every size's warm-up and capture)."""
        self.pool_bytes = max(0, capture.reserved_bytes(device) - reserved_before)
        """What the allocator reserved across the capture (an upper bound on the pool)."""
        self.num_replays = 0
        """Steps that ran in pieces."""

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def can_run(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.max_tokens

    def run(
        self,
        input_ids: torch.Tensor,  # [n] on the device
        positions: torch.Tensor,  # [n]
        meta: AttentionMetadata,  # the step's, for its n tokens
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """The forward of n tokens: the pieces of the smallest size >= n replayed, attention
        run eagerly between them; returns the final norm's output [n, hidden] (a view of a
        static buffer, valid until the next `run`). `on_layer(i)`: as in the model's forward,
        once layer i's K/V are written (queued)."""
        n = input_ids.shape[0]
        size = next(s for s in self.buckets if s >= n)
        self.num_replays += 1
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.row_weight[:n].fill_(1)
        if size > n:
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.row_weight[n:size].zero_()
        graphs = self.graphs[size]
        inputs = tuple(buffer[:n] for buffer in self.inputs)
        workspace = self.model.workspace
        start = self.model.layer_start
        for i, layer in enumerate(self.layers):
            graphs[i].replay()
            self.attn_out[:n].copy_(
                layer.self_attn.attend(inputs, self.kv_caches[i], meta, workspace)
            )
            if on_layer is not None:
                on_layer(start + i)
        graphs[-1].replay()
        return self.out[:n]

    def _piece(self, index: int, size: int) -> Callable[[], None]:
        """Piece `index` of the forward at `size` rows (the module docstring's table)."""
        model, layers = self.model, self.layers
        residual = self.residual[:size]
        positions = self.positions[:size]

        def piece() -> None:
            for block in self._counted:  # the weights' buffer goes into the graph
                block.expert_row_weight = self.row_weight[:size]
            try:
                if index == 0:
                    hidden = model._embed(self.input_ids[:size])
                    residual.copy_(hidden)
                    hidden = layers[0].input_layernorm.forward(hidden)
                else:
                    done = layers[index - 1]
                    attended = done.self_attn.output(self.attn_out[:size])
                    hidden, summed = done.post_attention_layernorm.add_and_norm(attended, residual)
                    hidden = done.mlp.forward(hidden)
                    norm = layers[index].input_layernorm if index < len(layers) else model.norm
                    hidden, summed = norm.add_and_norm(hidden, summed)
                    if summed is not residual:  # the kernels add in place; torch's path not
                        residual.copy_(summed)
                    if index == len(layers):
                        self.out[:size].copy_(hidden)
                        return
                inputs = layers[index].self_attn.prepare(hidden, positions, model.rotary)
                if not self.inputs:  # the first warm-up, at the largest size
                    self.inputs = [
                        torch.empty((self.max_tokens, *t.shape[1:]), dtype=t.dtype, device=t.device)
                        for t in inputs
                    ]
                for buffer, tensor in zip(self.inputs, inputs, strict=True):
                    buffer[:size].copy_(tensor)
            finally:
                for block in self._counted:  # eager steps count every row
                    block.expert_row_weight = None

        return piece
