"""Attention metadata for a flat mixed batch: what each backend (torch reference, CPU
kernels, Triton) needs to know about a step's requests, built once per step.

A step's tokens are laid out flat, request after request. Request i contributes
`query_lens[i]` tokens starting at `query_start_loc[i]`; after this step it holds
`seq_lens[i]` tokens of KV, the last `query_lens[i]` of which are the new ones. Its KV
lives in the blocks listed in row i of `block_tables`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from duet.engine.input_batch import StepInputs

# Decode requests are grouped by length so that padding every group to its longest member
# wastes at most this fraction of the gathered KV.
_MAX_PADDING_WASTE = 0.25


@dataclass
class DecodeGroup:
    """Single-token requests of similar length, attended to in one batched call."""

    token_indices: torch.Tensor  # [G] long: positions in the flat batch
    block_ids: torch.Tensor  # [G * num_blocks] long: each request's table, padded, flattened
    seq_lens: torch.Tensor  # [G] long
    num_blocks: int


@dataclass
class DecodeBatch:
    """All single-token requests, for the fused CPU kernel (no padding waste: it reads only
    each request's own blocks)."""

    token_indices: torch.Tensor  # [Bd] long
    block_tables: torch.Tensor  # [Bd, max_blocks] long, padded with 0
    seq_lens: torch.Tensor  # [Bd] long


@dataclass
class PrefillBatch:
    """All multi-token requests (prompts, chunks, the rest of a prompt after a prefix hit), for
    the CPU prefill kernel: it reads each request's KV from the cache, this step's included."""

    block_tables: torch.Tensor  # [Bp, max_blocks] long, padded with 0
    seq_lens: torch.Tensor  # [Bp] long
    query_start: torch.Tensor  # [Bp] long: first row in the flat batch
    query_lens: torch.Tensor  # [Bp] long


@dataclass
class KernelBatch:
    """The whole step as device tensors for the Triton kernels (engine/kernels/triton_*.py);
    built only for that backend. Requests keep their order in the flat batch."""

    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32: tokens of KV after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    decode_indices: torch.Tensor  # [Bd] int32: requests with one query token
    prefill_indices: torch.Tensor  # [Bp] int32: the others (chunks, prefix hits, prompts)
    max_query_len: int  # longest query among prefill_indices (sizes the prefill grid)
    num_splits: int  # split-K factor of the decode kernel's launch
    split_partition: int = 0  # 0, or each request's fixed split unit (deterministic inference)
    whole_prompts_in_sdpa: bool = False
    """Every prefill request is a whole prompt with no cached prefix and runs in torch's SDPA
    on this step's K/V (`prefill_attention` sdpa), not in the prefill kernel."""

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_ids: list[list[int]],
        starts: np.ndarray,
        num_kv_heads: int,
        device: torch.device,
        deterministic: bool = False,
        prefill_attention: str = "triton",
    ) -> KernelBatch:
        from duet.engine.kernels.triton_decode import choose_splits, device_num_sms

        num_reqs = len(seq_lens)
        width = max(1, max(len(b) for b in block_ids))
        decode = [i for i, q in enumerate(query_lens) if q == 1]
        prefill = [i for i, q in enumerate(query_lens) if q != 1]
        # One int32 buffer, one host-to-device copy; the fields are views of it.
        sizes = [num_reqs + 1, num_reqs, len(decode), len(prefill), num_reqs * width]
        packed = np.zeros(sum(sizes), dtype=np.int32)
        parts = np.split(packed, np.cumsum(sizes)[:-1])
        parts[0][:] = starts
        parts[1][:] = seq_lens
        parts[2][:] = decode
        parts[3][:] = prefill
        table = parts[4].reshape(num_reqs, width)
        for row, blocks in enumerate(block_ids):
            table[row, : len(blocks)] = blocks
        dev = to_device(packed, device)
        views = torch.split(dev, sizes)
        max_decode_len = max((seq_lens[i] for i in decode), default=0)
        num_splits, partition = choose_splits(
            len(decode), num_kv_heads, max_decode_len, device_num_sms(device), deterministic
        )
        return cls(
            query_start_loc=views[0],
            seq_lens=views[1],
            block_tables=views[4].view(num_reqs, width),
            decode_indices=views[2],
            prefill_indices=views[3],
            max_query_len=max((query_lens[i] for i in prefill), default=0),
            num_splits=num_splits,
            split_partition=partition,
            whole_prompts_in_sdpa=prefill_attention == "sdpa"
            and bool(prefill)
            and all(query_lens[i] == seq_lens[i] for i in prefill),
        )


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array as a tensor on `device` (on CUDA through pinned memory, without a sync)."""
    host = torch.from_numpy(array)
    if device.type == "cuda":
        # Pinned + non_blocking: the copy overlaps the host's work instead of syncing.
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


@dataclass
class AttentionMetadata:
    slot_mapping: (
        torch.Tensor
    )  # [T] long: flat cache slot (block_id * block_size + offset) per token
    query_start_loc: list[int]  # [B + 1] host ints
    seq_lens: list[int]  # [B] host ints: tokens of KV after this step
    block_ids: list[list[int]]  # [B] each request's block table
    decode_groups: list[DecodeGroup]  # torch path
    decode_batch: DecodeBatch | None  # kernel path
    prefill_indices: list[int]  # requests with several query tokens
    kernel_batch: KernelBatch | None = None  # Triton path: everything in two kernels
    prefill_batch: PrefillBatch | None = None  # CPU kernel path for prefill_indices

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_ids: list[list[int]],
        block_size: int,
        device: torch.device,
        use_decode_kernel: bool = False,
        triton_num_kv_heads: int | None = None,
        slot_mapping: torch.Tensor | None = None,
        deterministic: bool = False,
        prefill_attention: str = "triton",
    ) -> AttentionMetadata:
        """`use_decode_kernel`: decodes and prefills go to the C++ CPU kernels (prefills where
        the head size suits the kernel; `paged_attention` checks). `triton_num_kv_heads`: the
        Triton backend (the KV heads this rank caches, for the split-K heuristic); decode
        groups are then not built. `slot_mapping`: already computed (by the `InputBatch`).
        `deterministic`: Triton's decode splits by each request's own length (`choose_splits`).
        `prefill_attention` "sdpa": a Triton step whose prefills are all whole prompts runs them
        in torch's SDPA (`KernelBatch.whole_prompts_in_sdpa`)."""
        starts = np.zeros(len(query_lens) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=starts[1:])
        if slot_mapping is None:
            slots = []
            for q_len, s_len, blocks in zip(query_lens, seq_lens, block_ids, strict=True):
                pos = np.arange(s_len - q_len, s_len)
                slots.append(
                    np.asarray(blocks, dtype=np.int64)[pos // block_size] * block_size
                    + pos % block_size
                )
            slot_mapping = to_device(np.concatenate(slots), device)
        decode = [i for i, q in enumerate(query_lens) if q == 1]
        groups: list[DecodeGroup] = []
        batch = None
        kernel_batch = None
        if triton_num_kv_heads is not None:
            kernel_batch = KernelBatch.build(
                query_lens, seq_lens, block_ids, starts, triton_num_kv_heads, device,
                deterministic, prefill_attention,
            )  # fmt: skip
        elif decode and use_decode_kernel:
            batch = DecodeBatch(
                token_indices=torch.from_numpy(starts[decode]).to(device),
                block_tables=_block_table([block_ids[i] for i in decode], device),
                seq_lens=torch.tensor([seq_lens[i] for i in decode], device=device),
            )
        elif decode:
            groups = _group_decodes(decode, starts, seq_lens, block_ids, block_size, device)
        prefill = [i for i, q in enumerate(query_lens) if q != 1]
        prefill_batch = None
        if prefill and use_decode_kernel and triton_num_kv_heads is None:
            prefill_batch = PrefillBatch(
                block_tables=_block_table([block_ids[i] for i in prefill], device),
                seq_lens=torch.tensor([seq_lens[i] for i in prefill], device=device),
                query_start=torch.from_numpy(starts[prefill]).to(device),
                query_lens=torch.tensor([query_lens[i] for i in prefill], device=device),
            )
        return cls(
            slot_mapping=slot_mapping,
            query_start_loc=starts.tolist(),
            seq_lens=seq_lens,
            block_ids=block_ids,
            decode_groups=groups,
            decode_batch=batch,
            prefill_indices=prefill,
            kernel_batch=kernel_batch,
            prefill_batch=prefill_batch,
        )

    @classmethod
    def from_step(
        cls,
        step: StepInputs,
        block_table: np.ndarray,
        block_size: int,
        device: torch.device,
        backend: str,
        num_kv_heads: int,
        prefill_kernel: bool,
        deterministic: bool = False,
        prefill_attention: str = "triton",
    ) -> AttentionMetadata:
        """The metadata of a step the `InputBatch` prepared. `backend`: "cpu" (the C++
        kernels read the batch's `KernelTables`; `prefill_kernel` says whether they also
        take the prefills), "triton" or "torch" (the reference)."""
        query_lens = step.query_lens
        seq_lens = step.seq_lens.tolist()
        starts = step.query_start
        kt = step.kernel_tables
        if backend == "cpu" and kt is not None:
            prefill = kt.prefill_rows.tolist()
            block_ids = (
                [] if prefill_kernel or not prefill else step.block_ids(block_table, block_size)
            )
            decode_batch = None
            if kt.decode_rows.size:
                decode_batch = DecodeBatch(
                    kt.decode_token_indices, kt.decode_tables, kt.decode_seq_lens
                )
            prefill_batch = None
            if prefill and prefill_kernel:
                prefill_batch = PrefillBatch(
                    kt.prefill_tables,
                    kt.prefill_seq_lens,
                    kt.prefill_query_start,
                    kt.prefill_query_lens,
                )
            return cls(
                slot_mapping=step.slot_mapping,
                query_start_loc=starts.tolist(),
                seq_lens=seq_lens,
                block_ids=block_ids,
                decode_groups=[],
                decode_batch=decode_batch,
                prefill_indices=prefill,
                prefill_batch=prefill_batch,
            )
        block_ids = step.block_ids(block_table, block_size)
        meta = cls.build(
            query_lens.tolist(),
            seq_lens,
            block_ids,
            block_size,
            device,
            triton_num_kv_heads=num_kv_heads if backend == "triton" else None,
            slot_mapping=step.slot_mapping,
            deterministic=deterministic,
            prefill_attention=prefill_attention,
        )
        return meta


def _block_table(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """Rows of block ids, padded with 0 to the longest: [len(tables), max_blocks] long."""
    width = max(len(t) for t in tables)
    table = np.zeros((len(tables), width), dtype=np.int64)
    for row, blocks in enumerate(tables):
        table[row, : len(blocks)] = blocks
    return torch.from_numpy(table).to(device)


def _group_decodes(
    decode: list[int],
    starts: np.ndarray,
    seq_lens: list[int],
    block_ids: list[list[int]],
    block_size: int,
    device: torch.device,
) -> list[DecodeGroup]:
    order = sorted(decode, key=lambda i: seq_lens[i], reverse=True)
    groups: list[list[int]] = []
    for i in order:
        if groups:
            longest = -(-seq_lens[groups[-1][0]] // block_size)
            members = groups[-1]
            used = sum(-(-seq_lens[j] // block_size) for j in members) + -(
                -seq_lens[i] // block_size
            )
            if 1 - used / (longest * (len(members) + 1)) <= _MAX_PADDING_WASTE:
                members.append(i)
                continue
        groups.append([i])
    out = []
    for members in groups:
        nb = -(-seq_lens[members[0]] // block_size)
        table = np.zeros((len(members), nb), dtype=np.int64)
        for row, i in enumerate(members):
            n = -(-seq_lens[i] // block_size)
            table[row, :n] = block_ids[i][:n]
        out.append(
            DecodeGroup(
                token_indices=torch.from_numpy(starts[members]).to(device),
                block_ids=torch.from_numpy(table.reshape(-1)).to(device),
                seq_lens=torch.tensor([seq_lens[i] for i in members], device=device),
                num_blocks=nb,
            )
        )
    return out
