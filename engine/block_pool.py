"""`BlockPool`: storage of KV blocks. Free list, ref counts, and the prefix cache's
hash -> block map. Policy (which request gets which blocks) lives in `KVCacheManager`.

Invariants:
- A block is in the free queue iff its `ref_cnt` is 0.
- A free block may still hold a cached hash; it is evicted (hash dropped) only when
  `get_new_blocks` hands it out again. The free queue is LRU: the front is evicted first
  (within a window that keeps a request's blocks in runs: `get_new_blocks`).
- Not thread-safe: one scheduler thread owns the pool.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

BlockHash = bytes

EVICTION_WINDOW = 2
"""By default `get_new_blocks` picks n blocks among the 2n least recently freed."""


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], salt: str | None = None
) -> BlockHash:
    """Chained hash of a full block: identical hashes mean identical prefixes, across processes.
    `salt` (a request's `cache_salt`) enters the first block's, so the chains of requests with
    different salts never meet: one tenant's requests cannot hit (or time) another's cache."""
    h = hashlib.blake2b(digest_size=16)
    if parent_hash is not None:
        h.update(parent_hash)
    elif salt is not None:
        h.update(b"cache_salt\0" + salt.encode())
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


def hash_request_blocks(
    token_ids: Sequence[int], block_size: int, hashes: list[BlockHash], salt: str | None = None
) -> list[BlockHash]:
    """Extend `hashes` (the chain computed so far) to cover every full block of `token_ids`."""
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block_tokens(parent, token_ids[start : start + block_size], salt))
    return hashes


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    def __init__(
        self, num_blocks: int, enable_caching: bool = True, eviction_window: int = EVICTION_WINDOW
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1; got {num_blocks}")
        if eviction_window < 1:
            raise ValueError(f"eviction_window must be >= 1; got {eviction_window}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.eviction_window = eviction_window
        """n blocks are taken among the `eviction_window` x n least recently freed (1: the
        queue's front n, strict LRU)."""
        # NOTE: a block is made when first handed out (ids from `len(self.blocks)` on have
        # never been): a pool of 10^5-10^6 blocks took 0.5 s per engine to build up front. The
        # never-used ids stand at the front of the free queue, in ascending order, as the
        # whole pool did at the start.
        self.blocks: list[KVCacheBlock] = []  # every block handed out so far, by id
        # block_id -> block, in eviction order (front = least recently freed), after the
        # never-used ids.
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict()
        self._cached: dict[BlockHash, KVCacheBlock] = {}
        self.num_evictions = 0
        # (stored?, hash) since the last `take_events`, once `record_events` is on: a prefill
        # worker reports them so the router knows which prefixes each worker holds.
        self.record_events = False
        self._events: list[tuple[bool, BlockHash]] = []

    @property
    def num_free_blocks(self) -> int:
        return self._num_unused + len(self._free)

    @property
    def _num_unused(self) -> int:
        return self.num_blocks - len(self.blocks)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def free_block_ids(self) -> list[int]:
        """Free blocks in eviction order (for tests and debugging)."""
        return list(range(len(self.blocks), self.num_blocks)) + list(self._free)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` free blocks, evicting any cached hash, in ascending block order.

        Never-used blocks go first; then, of the free queue's `eviction_window` (2) x as many
        least recently freed blocks, the ones that make the fewest runs of consecutive ids
        (the longest runs first, the oldest part of a run when only part is needed). A KV
        transfer moves each run of a request's table as one span (an operation of the
        transport each: `kv_transfer/nixl/regions.py`), and requests that grew a block at a
        time leave their ids interleaved in the queue: after such churn, a 256-block request
        taken strictly from the front made about 100 runs, taken this way about 4
        (`benchmarks/kv/transfer_measure.py`'s churn model). The cost is an eviction order
        that is least-recently-freed only within the window."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} blocks; {self.num_free_blocks} free")
        out = []
        num_new = min(num_blocks, self._num_unused)
        for block_id in range(len(self.blocks), len(self.blocks) + num_new):
            block = KVCacheBlock(block_id, ref_cnt=1)
            self.blocks.append(block)
            out.append(block)
        for block_id in self._evicted_ids(num_blocks - num_new):
            block = self._free.pop(block_id)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        out.sort(key=lambda block: block.block_id)
        return out

    def _evicted_ids(self, need: int) -> list[int]:
        """The `need` free-queue blocks `get_new_blocks` takes (see there)."""
        if need <= 1 or need >= len(self._free) or self.eviction_window == 1:
            return list(itertools.islice(self._free, need))
        size = min(len(self._free), self.eviction_window * need)
        window = list(itertools.islice(self._free, size))
        by_id = sorted(range(len(window)), key=window.__getitem__)  # ages (0: the oldest)
        runs = []  # (-length, oldest age, start, end) over `by_id`
        start, oldest = 0, by_id[0]
        for i in range(1, len(by_id) + 1):
            if i < len(by_id) and window[by_id[i]] == window[by_id[i - 1]] + 1:
                oldest = min(oldest, by_id[i])
                continue
            runs.append((start - i, oldest, start, i))
            if i < len(by_id):
                start, oldest = i, by_id[i]
        runs.sort()
        chosen: list[int] = []
        for _, _, start, end in runs:
            left = need - len(chosen)
            if end - start > left:  # the `left` consecutive blocks of the run freed longest ago
                ages = list(itertools.accumulate(by_id[start:end], initial=0))
                start += min(range(end - start - left + 1), key=lambda j: ages[j + left] - ages[j])
                end = start + left
            chosen += [window[i] for i in by_id[start:end]]
            if len(chosen) == need:
                break
        return chosen

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits; a free one leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each. Blocks reaching 0 join the back of the free queue in the
        order given, so pass a request's blocks tail-first: its last blocks are evicted first."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        start: int,
        end: int,
    ) -> None:
        """Register blocks[start:end] under their hashes (they now hold full, computed blocks)."""
        if not self.enable_caching:
            return
        for i in range(start, end):
            block = blocks[i]
            if block.block_hash is not None:
                continue
            block_hash = block_hashes[i]
            if block_hash in self._cached:
                continue  # another block already holds this prefix; keep the first
            block.block_hash = block_hash
            self._cached[block_hash] = block
            if self.record_events:
                self._events.append((True, block_hash))

    def take_events(self) -> list[tuple[bool, BlockHash]]:
        """Prefix-cache changes since the last call: (True, hash) cached, (False, hash)
        evicted, in order."""
        out, self._events = self._events, []
        return out

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        if self.record_events:
            self._events.extend((False, h) for h in self._cached)
        self._cached.clear()
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
                if self.record_events:
                    self._events.append((False, block.block_hash))
            block.block_hash = None
            self.num_evictions += 1
