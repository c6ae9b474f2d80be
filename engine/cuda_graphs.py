"""CUDA graphs of the decode forward: one per batch-size bucket, replayed over static buffers.

A decode step launches a few hundred small kernels whose launch cost, not the GPU, bounds the
step time at small batches; a graph replays them all from one launch. Graphs fix every address
and grid, so a step's inputs are copied into static buffers (from pinned host staging, without
a sync) and a batch of n runs the graph of the smallest bucket >= n: rows past n are padding
with slot -1 (their K/V is not written) and seq_len 0 (they attend to nothing). The split-K
factor of each bucket is chosen for `max_model_len`, since the grid cannot change at replay;
each request then uses as many of those splits as its own length fills (triton_decode), and
every bucket's graph replays the same compiled kernels.

On by default where it applies (`uses_decode_graphs`: CUDA, the Triton backend, dense models
and mixtures of experts on the fused kernel; per rank with tensor parallelism and per stage
with pipeline stages);
`enforce_eager=True` turns it off. Steps with a prefill chunk or a speculative query (more than
one token for a request) run eagerly, or in pieces around attention with `cuda_graph_mode`
piecewise (engine/piecewise_graphs.py). The capture itself goes through a `GraphCapture`, so
that the CPU tests run all of this bookkeeping with a stand-in whose "replay" calls the
captured function (the Triton kernels under the interpreter), CUDA being absent.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from duet.engine.attention_metadata import AttentionMetadata, KernelBatch


def uses_decode_graphs(
    enforce_eager: bool, device: torch.device, use_triton: bool, experts_on_host: bool = False
) -> bool:
    """Whether an engine captures decode graphs: unless `enforce_eager`, on CUDA with the Triton
    attention kernels (the graphs' metadata is theirs), unless the model's sparse layers read
    device values on the host (`experts_on_host`, `moe.experts_read_on_host`: a mixture of
    experts off the fused Triton kernel, or under the expert exchange; on the fused kernel a
    mixture is captured as a dense model is). With tensor parallelism each rank
    captures its own graphs with the layers' all-reduces inside (NCCL collectives can be
    captured); the ranks capture the same buckets in the same order and, scheduling alike,
    replay the same bucket at the same step, so the captured collectives meet. The logits'
    gather to rank 0 and the token broadcast stay outside the graphs. With pipeline stages
    each stage's ranks capture their stage's layers (`LlamaForCausalLM.stage_forward`) over
    static buffers of the streams they receive and send; the receive before a replay and the
    send after it stay outside the graphs, as do the sampled tokens' broadcast. The KV budget
    reserves the graphs' pool exactly when this is True (`kv_sizing.size_kv_pool`)."""
    return not enforce_eager and not experts_on_host and device.type == "cuda" and use_triton


def decode_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_num_seqs (which is always included)."""
    buckets = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    buckets += list(range(16, max_num_seqs, 16))
    return sorted({*buckets, max_num_seqs})


def padded_batch_size(buckets: Sequence[int], num_reqs: int) -> int:
    """The bucket a decode step of `num_reqs` requests replays: the smallest that holds them."""
    for bucket in buckets:
        if bucket >= num_reqs:
            return bucket
    raise ValueError(f"num_reqs: {num_reqs} is more than the largest bucket {buckets[-1]}")


class ReplayableGraph(Protocol):
    def replay(self) -> None: ...


class GraphCapture(Protocol):
    """How `DecodeGraphs` captures and synchronizes; `CudaGraphCapture` on a GPU."""

    pin_memory: bool
    """Whether host staging buffers are pinned (CUDA: so copies from them are asynchronous)."""

    def capture(self, forward: Callable[[], None], pool: Any) -> tuple[ReplayableGraph, Any]:
        """Capture `forward` into a graph sharing the memory `pool` (None: a new one); returns
        the graph and its pool."""
        ...

    def synchronize(self, device: torch.device) -> None: ...

    def event(self) -> Any:
        """An event with `record()` and `synchronize()` (orders the staging copies)."""
        ...

    def reserved_bytes(self, device: torch.device) -> int:
        """Memory the device's allocator holds (the graphs' pool is the growth across capture)."""
        ...


class CudaGraphCapture:
    pin_memory = True

    def capture(self, forward: Callable[[], None], pool: Any) -> tuple[ReplayableGraph, Any]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            forward()
        return graph, graph.pool()

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def event(self) -> Any:
        return torch.cuda.Event()

    def reserved_bytes(self, device: torch.device) -> int:
        return int(torch.cuda.memory_reserved(device))


class _Called:
    def __init__(self, forward: Callable[[], None]) -> None:
        self.replay = forward


class _NoEvent:
    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


class EagerCapture:
    """A `GraphCapture` without graphs, for the CPU: capturing keeps the function, replaying
    calls it (over the same static buffers a graph would read). It runs the graphs'
    bookkeeping where CUDA is absent: the CPU tests, a GPU benchmark's `--smoke`."""

    pin_memory = False

    def __init__(self) -> None:
        self.num_captures = 0

    def capture(self, forward: Callable[[], None], pool: Any) -> tuple[ReplayableGraph, Any]:
        self.num_captures += 1
        return _Called(forward), pool

    def synchronize(self, device: torch.device) -> None:
        pass

    def event(self) -> Any:
        return _NoEvent()

    def reserved_bytes(self, device: torch.device) -> int:
        return 0


class DecodeGraphs:
    """Captured decode graphs of one model and its KV caches.

    Invariants: built after the KV caches are allocated (the graphs hold their addresses) and
    used only for steps in which every request has exactly one query token; `run` may be called
    from one thread at a time (the static buffers are shared)."""

    def __init__(
        self,
        model: Any,  # LlamaForCausalLM (not imported: engine.model imports engine.attention)
        kv_caches: list[torch.Tensor],
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        deterministic: bool = False,
        capture: GraphCapture | None = None,
    ) -> None:
        """`capture`: `CudaGraphCapture()` unless given (tests pass a stand-in on the CPU)."""
        from duet.engine.kernels.triton_decode import choose_splits, device_num_sms

        capture = capture or CudaGraphCapture()
        started = time.perf_counter()
        cache = kv_caches[0]
        device = cache.device
        reserved_before = capture.reserved_bytes(device)
        self.block_size = block_size
        self.buckets = decode_buckets(max_num_seqs)
        max_bs = self.buckets[-1]
        self.width = -(-max_model_len // block_size)
        i32, i64 = torch.int32, torch.int64
        self.input_ids = torch.zeros(max_bs, dtype=i64, device=device)
        self.positions = torch.zeros(max_bs, dtype=i64, device=device)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=i64, device=device)
        # one query token per request: request i's is row i
        self.query_start_loc = torch.arange(max_bs + 1, dtype=i32, device=device)
        self.decode_indices = torch.arange(max_bs, dtype=i32, device=device)
        self.prefill_indices = torch.zeros(0, dtype=i32, device=device)
        self.seq_lens = torch.zeros(max_bs, dtype=i32, device=device)
        self.block_tables = torch.zeros(max_bs, self.width, dtype=i32, device=device)
        hidden_size = model.config.hidden_size
        self.hidden = torch.zeros(max_bs, hidden_size, dtype=cache.dtype, device=device)
        # Pipeline stages: the streams a stage receives (after the first) and sends on (before
        # the last) live in static buffers too; the sends and receives stay outside the graphs.
        self.pp = model.tp.pp
        stream = (2, max_bs, hidden_size)
        self.received = (
            None if self.pp.is_first else torch.zeros(stream, dtype=cache.dtype, device=device)
        )
        self.residual = None if self.pp.is_last else torch.zeros_like(self.hidden)
        # A mixture's expert load counts real rows only: 1 a request, 0 a padding row.
        self.row_weight = torch.zeros(max_bs, dtype=i64, device=device)
        counted = [m for m in model.modules() if getattr(m, "expert_counts", None) is not None]
        # Pinned staging: rows input_ids, positions, slots, row weights; then seq_lens + block
        # table.
        self._host_i64 = torch.zeros(4, max_bs, dtype=torch.int64)
        self._host_i32 = torch.zeros(max_bs * (1 + self.width), dtype=torch.int32)
        if capture.pin_memory:
            self._host_i64 = self._host_i64.pin_memory()
            self._host_i32 = self._host_i32.pin_memory()
        self._copied = capture.event()
        self.graphs: dict[int, ReplayableGraph] = {}
        self.num_splits: dict[int, int] = {}  # bucket -> split count its graph replays
        self.split_partition = 0  # deterministic inference: each request's split unit

        num_kv_heads = cache.shape[3]
        sms = device_num_sms(device)
        pool = None
        for bs in reversed(self.buckets):  # largest first: the others fit in its memory pool
            # The grid is fixed at capture: it covers the longest request the graph may see.
            splits, self.split_partition = choose_splits(
                bs, num_kv_heads, max_model_len, sms, deterministic
            )
            self.num_splits[bs] = splits
            meta = self._metadata(bs, splits)

            def forward(bs: int = bs, meta: AttentionMetadata = meta) -> None:
                ids, pos = self.input_ids[:bs], self.positions[:bs]
                received = self.received
                for block in counted:  # the weights' buffer goes into the graph
                    block.expert_row_weight = self.row_weight
                try:
                    hidden, residual = model.stage_forward(
                        ids, pos, kv_caches, meta, None,
                        *((received[0, :bs], received[1, :bs]) if received is not None else ()),
                    )  # fmt: skip
                finally:
                    for block in counted:  # eager steps count every row
                        block.expert_row_weight = None
                self.hidden[:bs] = hidden
                if self.residual is not None:
                    self.residual[:bs] = residual

            forward()  # compiles the Triton kernels and warms the allocator outside the capture
            capture.synchronize(device)
            self.graphs[bs], pool = capture.capture(forward, pool)
        capture.synchronize(device)
        self.capture_s = time.perf_counter() - started
        """Seconds the capture took (every bucket's warm-up forward and capture)."""
        self.pool_bytes = max(0, capture.reserved_bytes(device) - reserved_before)
        """What the allocator reserved across the capture: the graphs' private pool plus
        what the warm-up forwards left cached (an upper bound on the pool)."""
        self.num_replays = 0
        """Steps that replayed a graph (the runner's other steps ran eagerly)."""

    @property
    def max_batch_size(self) -> int:
        return self.buckets[-1]

    def can_run(self, query_lens: Sequence[int], seq_lens: Sequence[int]) -> bool:
        return (
            0 < len(query_lens) <= self.max_batch_size
            and all(q == 1 for q in query_lens)
            and max(seq_lens) <= self.width * self.block_size
        )

    def run(
        self,
        input_ids: np.ndarray,  # [n] int64
        positions: np.ndarray,  # [n] int64
        slot_mapping: np.ndarray,  # [n] int64
        seq_lens: Sequence[int],  # [n]
        block_ids: Sequence[Sequence[int]],  # [n] block tables
    ) -> torch.Tensor:
        """Replay the decode graph for these n requests; returns hidden states [n, hidden] (a
        view of a static buffer, valid until the next `run`)."""
        n = len(seq_lens)
        bs = padded_batch_size(self.buckets, n)
        self.num_replays += 1
        width = max(len(b) for b in block_ids)
        self._copied.synchronize()  # the previous step's copies have left the staging buffers
        h64 = self._host_i64.numpy()
        h64[:, :bs] = 0
        h64[0, :n] = input_ids
        h64[1, :n] = positions
        h64[2, :n] = slot_mapping
        h64[2, n:bs] = -1
        h64[3, :n] = 1
        h32 = self._host_i32.numpy()
        h32[:bs] = 0
        h32[:n] = seq_lens
        table = h32[self.max_batch_size : self.max_batch_size + bs * width].reshape(bs, width)
        table[:] = 0
        for row, blocks in enumerate(block_ids):
            table[row, : len(blocks)] = blocks
        staged_table = self._host_i32[self.max_batch_size : self.max_batch_size + bs * width]
        self.input_ids[:bs].copy_(self._host_i64[0, :bs], non_blocking=True)
        self.positions[:bs].copy_(self._host_i64[1, :bs], non_blocking=True)
        self.slot_mapping[:bs].copy_(self._host_i64[2, :bs], non_blocking=True)
        self.row_weight[:bs].copy_(self._host_i64[3, :bs], non_blocking=True)
        self.seq_lens[:bs].copy_(self._host_i32[:bs], non_blocking=True)
        self.block_tables[:bs, :width].copy_(staged_table.view(bs, width), non_blocking=True)
        self._copied.record()
        if self.received is not None:  # the previous stage's n rows (padding rows: unread)
            self.pp.recv_prev(self.received[0, :n], self.received[1, :n])
        self.graphs[bs].replay()
        if self.residual is not None:  # on to the next stage, before the buffers are reused
            for work in self.pp.send_next(self.hidden[:n], self.residual[:n]):
                work.wait()
        return self.hidden[:n]

    def _metadata(self, bs: int, num_splits: int) -> AttentionMetadata:
        batch = KernelBatch(
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            decode_indices=self.decode_indices[:bs],
            prefill_indices=self.prefill_indices,
            max_query_len=0,
            num_splits=num_splits,
            split_partition=self.split_partition,
        )
        # The host-side fields serve the torch path only; the Triton path reads `batch`.
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            query_start_loc=list(range(bs + 1)),
            seq_lens=[0] * bs,
            block_ids=[[] for _ in range(bs)],
            decode_groups=[],
            decode_batch=None,
            prefill_indices=[],
            kernel_batch=batch,
        )
