"""`KernelTables`: the C++ CPU kernels' layout of one step, and `KernelTableBuilder`, which
writes it from the input batch's arrays.

The kernels take decodes (one query token) and prefills (several) apart, each with its own block
tables. An all-decode step whose requests hold consecutive slots (the common step) needs no copy
at all: its lengths and tables are views of the batch's own arrays."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from duet.engine.staging import MAX_CACHED_VIEWS, StagingBuffer


@dataclass
class KernelTables:
    """The C++ CPU kernels' view of a step (see `attention.DecodeBatch`, `PrefillBatch`):
    decodes (one query token) and prefills (several) apart, each with its block tables."""

    decode_rows: np.ndarray  # [Bd] indices into the step
    decode_token_indices: torch.Tensor  # [Bd] long
    decode_seq_lens: torch.Tensor  # [Bd] long
    decode_tables: torch.Tensor  # [Bd, w] long
    prefill_rows: np.ndarray  # [Bp]
    prefill_query_start: torch.Tensor  # [Bp] long
    prefill_query_lens: torch.Tensor  # [Bp] long
    prefill_seq_lens: torch.Tensor  # [Bp] long
    prefill_tables: torch.Tensor  # [Bp, w] long


class KernelTableBuilder:
    """Lays out each step for the kernels. It reads the input batch's persistent arrays (held
    by reference: the batch writes them, the builder only reads them) and writes into the
    batch's staging buffer. The tables are read on the host only (the kernels are CPU ones)."""

    def __init__(
        self,
        *,
        staging: StagingBuffer,
        block_table: torch.Tensor,
        slots: np.ndarray,
        query_lens: np.ndarray,
        seq_lens: torch.Tensor,
        query_start: np.ndarray,
        arange: np.ndarray,
        block_size: int,
    ) -> None:
        """`block_table` [slots, max blocks] and `seq_lens` [slots] are host tensors; `slots`,
        `query_lens` and `query_start` are per request in step order; `arange` is 0, 1, ... at
        least as long as the slots."""
        self._staging = staging
        self._block_table_host = block_table
        self._block_table = block_table.numpy()
        self._slots = slots
        self._query_lens = query_lens
        self._seq_lens_host = seq_lens
        self._seq_lens = seq_lens.numpy()
        self._query_start = query_start
        self._arange = arange
        self._block_size = block_size
        empty = staging.dev[:0]
        self._empty = (empty, empty.view(0, 1))  # the tables of a step without decodes/prefills
        # 0..s-1: an all-decode step's token indices (views cached per size).
        self._arange_tensor = torch.from_numpy(arange[: block_table.shape[0]])
        self._decode_indices: dict[int, torch.Tensor] = {}
        # An all-decode step's tables as views of the batch's own arrays (no copy):
        # n -> seq_lens[:n], (first slot, n) -> block_table[first : first + n].
        self._seq_len_views: dict[int, torch.Tensor] = {}
        self._table_views: dict[tuple[int, int], torch.Tensor] = {}

    @staticmethod
    def staging_size(max_num_seqs: int, max_blocks: int) -> int:
        """Elements of the staging buffer one step's tables can take: at most five per-request
        vectors (decode starts and lengths; prefill starts, query lengths and lengths) and two
        block tables, each bounded by every request's full row (their rows together never
        exceed the requests, so this leaves room)."""
        return 5 * max_num_seqs + 2 * max_num_seqs * max_blocks

    def build(
        self, num_reqs: int, num_decode: int, longest_seq: int, first_slot: int
    ) -> KernelTables:
        """`num_decode`: the requests with one query token this step; `longest_seq`: the most
        tokens of KV any of them has after the step; `first_slot`: the first request's slot when
        the requests hold consecutive slots in step order, else -1."""
        query_lens, seq_lens = self._query_lens[:num_reqs], self._seq_lens[:num_reqs]
        starts = self._query_start[:num_reqs]
        bs, staging = self._block_size, self._staging
        empty, empty_table = self._empty
        if num_decode == num_reqs:  # all decodes (the common step): no gathers by row
            # Request i's one token is row i: the token indices are 0..B-1, made once.
            indices = self._decode_indices.get(num_reqs)
            if indices is None:
                indices = self._decode_indices[num_reqs] = self._arange_tensor[:num_reqs]
            if first_slot >= 0:
                return self._decode_views(num_reqs, indices, first_slot)
            seq_dev = staging.stage(seq_lens)
            width = max(1, -(-longest_seq // bs))
            table, table_dev = staging.take_table(num_reqs, width)
            np.take(self._block_table[:, :width], self._slots[:num_reqs], axis=0, out=table)
            return KernelTables(
                self._arange[:num_reqs], indices, seq_dev, table_dev,
                self._arange[:0], empty, empty, empty, empty_table,
            )  # fmt: skip
        if num_decode == 0:
            dec, pre = self._arange[:0], self._arange[:num_reqs]
        else:
            is_decode = query_lens == 1
            dec, pre = np.flatnonzero(is_decode), np.flatnonzero(~is_decode)

        def tables(rows: np.ndarray) -> torch.Tensor:
            every = rows.size == num_reqs  # then rows is 0..num_reqs-1
            longest = longest_seq if every else int(seq_lens[rows].max())
            width = max(1, -(-longest // bs))
            host, dev = staging.take_table(rows.size, width)
            slots = self._slots[:num_reqs] if every else self._slots[rows]
            np.take(self._block_table[:, :width], slots, axis=0, out=host)
            return dev

        stage = staging.stage
        if dec.size:
            decode = (stage(starts[dec]), stage(seq_lens[dec]), tables(dec))
        else:
            decode = (empty, empty, empty_table)
        if pre.size:
            prefill = (
                stage(starts[pre]),
                stage(query_lens[pre]),
                stage(seq_lens[pre]),
                tables(pre),
            )
        else:
            prefill = (empty, empty, empty, empty_table)
        return KernelTables(dec, *decode, pre, *prefill)

    def _decode_views(self, n: int, indices: torch.Tensor, first: int) -> KernelTables:
        """An all-decode step on the CPU whose requests hold slots first..first + n - 1: the
        kernel reads their lengths and block tables in place. Each table row is the slot's full
        row (the kernel reads the blocks its length covers; the rest of a row is never read)."""
        seq_lens = self._seq_len_views.get(n)
        if seq_lens is None:
            seq_lens = self._seq_len_views[n] = self._seq_lens_host[:n]
        tables = self._table_views.get((first, n))
        if tables is None:
            if len(self._table_views) >= MAX_CACHED_VIEWS:
                self._table_views.clear()
            tables = self._table_views[first, n] = self._block_table_host[first : first + n]
        empty, empty_table = self._empty
        return KernelTables(
            self._arange[:n], indices, seq_lens, tables,
            self._arange[:0], empty, empty, empty, empty_table,
        )  # fmt: skip
