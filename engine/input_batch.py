"""`InputBatch`: the model runner's persistent view of the requests it runs, and the buffers
each step's inputs are written into.

Every running request holds a slot (a row) from its first scheduled step until it leaves the
running set (finished, aborted, preempted, handed to a decode worker). Per slot, kept across
steps and written only when something changes:
- its block table row: new blocks are appended as the request grows;
- its sampling parameters (`SamplingSlots`), written when it joins.

Per step, `prepare` writes the step's token ids, positions, cache slots, lengths and the
rows that sample into buffers allocated once (pinned on CUDA) and copies them to the
device in one go. Nothing is allocated per step: every buffer comes from `_buffer`, which
counts (`num_buffers_allocated`), so a test can prove it; likewise `to_host` is the one place
a step waits for the device (`num_host_syncs`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from duet.engine.kernel_tables import KernelTableBuilder, KernelTables
from duet.engine.kv_cache_manager import KVCacheManager
from duet.engine.request import Request
from duet.engine.sampling_slots import SamplingSlots
from duet.engine.staging import StagingBuffer


@dataclass
class StepInputs:
    """One step's inputs. Host arrays are views of the batch's buffers and tensors are views
    of their device mirror, valid until the next `prepare`."""

    num_reqs: int
    num_tokens: int
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    slot_mapping: torch.Tensor  # [T] long: block_id * block_size + offset per token
    query_lens: np.ndarray  # [B]
    seq_lens: np.ndarray  # [B]: tokens of KV after this step
    query_start: np.ndarray  # [B + 1]
    slots: np.ndarray  # [B]: each request's row in the block table
    sample_rows: list[int]  # requests (indices into the step) whose last token is computed
    logits_indices: torch.Tensor  # [N] long: their last token's row in the flat batch (and
    # a speculating request's proposed tokens' rows before it)
    kernel_tables: KernelTables | None  # with `split_tables`
    host_inputs: tuple[np.ndarray, np.ndarray, np.ndarray]  # ids, positions, slot mapping

    def block_ids(self, table: np.ndarray, block_size: int) -> list[list[int]]:
        """Each request's block table as a list (the torch reference path and CUDA graphs)."""
        return [
            table[slot, : -(-int(n) // block_size)].tolist()
            for slot, n in zip(self.slots, self.seq_lens, strict=True)
        ]


_FEW_TOKENS = 8
"""Up to this many tokens a step's slot mapping is computed without numpy."""


class InputBatch:
    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        block_size: int,
        vocab_size: int,
        device: torch.device,
        split_tables: bool = False,
        num_speculative_tokens: int = 0,
    ) -> None:
        """`split_tables`: also lay out each step for the C++ CPU kernels (`KernelTables`).
        `num_speculative_tokens`: most proposed tokens a request computes in one step."""
        self.max_num_seqs = max_num_seqs
        self.block_size = block_size
        self.device = device
        if split_tables and device.type != "cpu":
            raise ValueError(
                f"split_tables: the C++ CPU kernels' tables need device cpu, not {device}"
            )
        self.max_blocks = -(-max_model_len // block_size)
        self.num_buffers_allocated = 0
        self.num_host_syncs = 0
        s = max_num_seqs
        # Tokens of one step: the budget, plus one per request (the scheduler never exceeds
        # the budget; the margin keeps a bad budget from writing out of bounds).
        t = max_num_batched_tokens + s
        self._block_table_host = self._host((s, self.max_blocks), torch.int64)
        self.block_table = self._block_table_host.numpy()
        self._num_blocks = [0] * s  # block ids written per row
        self._slot_of: dict[str, int] = {}
        self._free_slots = list(range(s - 1, -1, -1))
        self.sampling = SamplingSlots(
            s, vocab_size, device, self._buffer, max_rows=s * (1 + num_speculative_tokens)
        )

        size = 4 * t + s  # ids, positions, slot mapping, logits rows (at most one per token)
        if split_tables:
            size += KernelTableBuilder.staging_size(s, self.max_blocks)
        host = self._host((size,), torch.int64)
        dev = host if device.type == "cpu" else self._buffer((size,), torch.int64, device)
        self._staging = StagingBuffer(host, dev)
        # Host-only scratch, reused every step.
        self._token_rows = self._host((t,), torch.int64).numpy()
        self._scratch = self._host((t,), torch.int64).numpy()
        self._arange = np.arange(t, dtype=np.int64)
        self._query_lens = self._host((s,), torch.int64).numpy()
        self._seq_lens_host = self._host((s,), torch.int64)
        self._seq_lens = self._seq_lens_host.numpy()
        self._query_start = self._host((s + 1,), torch.int64).numpy()
        self._slots = self._host((s,), torch.int64).numpy()
        self._kernel_tables = (
            KernelTableBuilder(
                staging=self._staging,
                block_table=self._block_table_host,
                slots=self._slots,
                query_lens=self._query_lens,
                seq_lens=self._seq_lens_host,
                query_start=self._query_start,
                arange=self._arange,
                block_size=block_size,
            )
            if split_tables
            else None
        )

    @property
    def split_tables(self) -> bool:
        """Whether each step is also laid out for the C++ CPU kernels (`KernelTables`)."""
        return self._kernel_tables is not None

    # -- buffers (the allocation hook) ---------------------------------------------------------

    def _buffer(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        """Every buffer the batch (and its sampling slots) owns is made here, and counted."""
        self.num_buffers_allocated += 1
        pin = device.type == "cpu" and self.device.type == "cuda"
        return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)

    def _host(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self._buffer(shape, dtype, torch.device("cpu"))

    def to_host(self, tensor: torch.Tensor) -> list:
        """The step's one wait for the device: `tensor` as a (nested) list of numbers."""
        self.num_host_syncs += 1
        return tensor.tolist()

    # -- slots ----------------------------------------------------------------------------------

    @property
    def num_active(self) -> int:
        return len(self._slot_of)

    def slot_of(self, request_id: str) -> int | None:
        return self._slot_of.get(request_id)

    def remove(self, request_ids: Sequence[str]) -> None:
        """Free the slots of requests that left the running set."""
        for request_id in request_ids:
            slot = self._slot_of.pop(request_id, None)
            if slot is not None:
                self._num_blocks[slot] = 0
                self._free_slots.append(slot)

    def trim(self, request_id: str, num_blocks: int) -> None:
        """The request's block table was cut to `num_blocks`: its row is rewritten from
        there when it grows again (new blocks may have other ids than the ones given back)."""
        slot = self._slot_of.get(request_id)
        if slot is not None:
            self._num_blocks[slot] = min(self._num_blocks[slot], num_blocks)

    def _join(self, request: Request) -> int:
        if not self._free_slots:
            raise RuntimeError(
                f"input batch full ({self.max_num_seqs} slots): a request left the running set "
                "without being removed"
            )
        slot = self._free_slots.pop()
        self._slot_of[request.request_id] = slot
        self._num_blocks[slot] = 0
        self.sampling.write(slot, request)
        return slot

    # -- one step -------------------------------------------------------------------------------

    def prepare(
        self,
        scheduled: Sequence[tuple[Request, int]],
        kv: KVCacheManager,
        spec_token_ids: Mapping[str, list[int]] | None = None,
    ) -> StepInputs:
        """Write one step's inputs (requests in the scheduler's order, each with its number of
        new tokens, which count its proposed tokens in `spec_token_ids`) and copy them to the
        device. A speculating request's logits rows are its last token's and every proposed
        token's (verification needs the target's distribution at each)."""
        bs = self.block_size
        table = self.block_table
        rows = self._token_rows
        query_lens, seq_lens, slots = self._query_lens, self._seq_lens, self._slots
        query_start = self._query_start
        num_reqs = len(scheduled)
        num_tokens = sum(n for _, n in scheduled)
        staging = self._staging
        ids, ids_dev = staging.take(num_tokens)
        positions, positions_dev = staging.take(num_tokens)
        sample_rows: list[int] = []
        logits_spans: list[tuple[int, int]] = []  # (end row, rows) of each sampling request
        num_logits = 0
        num_decode = 0
        # Whether the requests' slots are consecutive (first, first + 1, ...) in step order.
        first_slot = -1
        consecutive = True
        longest = 0
        t = 0
        query_start[0] = 0
        for i, (request, num_new) in enumerate(scheduled):
            slot = self._slot_of.get(request.request_id)
            if slot is None:
                slot = self._join(request)
            if i == 0:
                first_slot = slot
            elif slot != first_slot + i:
                consecutive = False
            blocks = kv.req_to_blocks[request.request_id]
            written = self._num_blocks[slot]
            if len(blocks) > written:  # the request grew: append its new blocks
                for j in range(written, len(blocks)):
                    table[slot, j] = blocks[j].block_id
                self._num_blocks[slot] = len(blocks)
            start = request.num_computed_tokens
            end = start + num_new
            stop = t + num_new
            spec = spec_token_ids.get(request.request_id) if spec_token_ids else None
            if num_new == 1:
                ids[t] = request.all_token_ids[start]
                positions[t] = start
                rows[t] = slot
                num_decode += 1
            else:
                if spec:
                    ids[t : stop - len(spec)] = request.all_token_ids[start:]
                    ids[stop - len(spec) : stop] = spec
                    end -= len(spec)  # sampling is decided on the request's own tokens
                else:
                    ids[t:stop] = request.all_token_ids[start:end]
                np.add(self._arange[:num_new], start, out=positions[t:stop])
                rows[t:stop] = slot
            slots[i] = slot
            query_lens[i] = num_new
            seq_lens[i] = start + num_new
            query_start[i + 1] = stop
            if end == request.num_tokens:
                sample_rows.append(i)
                n = 1 + (len(spec) if spec else 0)
                logits_spans.append((stop, n))
                num_logits += n
            longest = max(longest, start + num_new)
            t = stop

        # slot_mapping = table[row, pos // bs] * bs + pos % bs: vectorized over the step, or
        # for a few tokens one by one (each numpy call costs microseconds of its own).
        slot_mapping, slot_mapping_dev = staging.take(t)
        if t <= _FEW_TOKENS:
            for k, (row, pos) in enumerate(zip(rows[:t].tolist(), positions.tolist(), strict=True)):
                slot_mapping[k] = int(table[row, pos // bs]) * bs + pos % bs
        else:
            flat = self._scratch[:t]
            np.floor_divide(positions, bs, out=flat)
            np.multiply(rows[:t], self.max_blocks, out=rows[:t])
            np.add(flat, rows[:t], out=flat)
            np.take(table.reshape(-1), flat, out=slot_mapping)
            np.multiply(slot_mapping, bs, out=slot_mapping)
            np.remainder(positions, bs, out=flat)
            np.add(slot_mapping, flat, out=slot_mapping)

        logits, logits_dev = staging.take(num_logits)
        j = 0
        for stop, n in logits_spans:  # a request's last n rows (Python ints: no numpy scalars)
            if n == 1:
                logits[j] = stop - 1
            else:
                logits[j : j + n] = self._arange[:n] + (stop - n)
            j += n
        kernel_tables = (
            self._kernel_tables.build(
                num_reqs, num_decode, longest, first_slot if consecutive else -1
            )
            if self._kernel_tables is not None
            else None
        )
        staging.copy()
        return StepInputs(
            num_reqs=num_reqs,
            num_tokens=t,
            input_ids=ids_dev,
            positions=positions_dev,
            slot_mapping=slot_mapping_dev,
            query_lens=query_lens[:num_reqs],
            seq_lens=seq_lens[:num_reqs],
            query_start=query_start[: num_reqs + 1],
            slots=slots[:num_reqs],
            sample_rows=sample_rows,
            logits_indices=logits_dev,
            kernel_tables=kernel_tables,
            host_inputs=(ids, positions, slot_mapping),
        )
