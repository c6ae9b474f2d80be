"""`KVCacheManager`: which blocks each request holds, prefix-cache lookups, allocation.

It decides; `BlockPool` stores. Called only from the scheduler's thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from duet.engine.block_pool import (
    EVICTION_WINDOW,
    BlockPool,
    KVCacheBlock,
    hash_request_blocks,
)
from duet.engine.request import Request


@dataclass
class PrefixCacheStats:
    num_queries: int = 0  # prompt tokens looked up
    num_hits: int = 0  # of which served from cache
    num_requests: int = 0
    num_requests_hit: int = 0


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        eviction_window: int = EVICTION_WINDOW,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching, eviction_window)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # how many of each request's first blocks were offered to the prefix cache already
        self._num_offered: dict[str, int] = {}
        self.prefix_stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request: (blocks, number of tokens they hold).

        At least one token is always left to compute, so the step produces logits. A request
        that asked for prompt logprobs gets no hit (every position's logits are needed)."""
        params = request.sampling_params
        if (
            not self.enable_caching
            or params.prompt_logprobs is not None
            or params.pooling in ("mean", "cls")
        ):
            return [], 0
        salt = request.sampling_params.cache_salt
        hash_request_blocks(request.all_token_ids, self.block_size, request.block_hashes, salt)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        self.prefix_stats.num_requests += 1
        self.prefix_stats.num_queries += request.num_tokens
        self.prefix_stats.num_hits += num_hit_tokens
        self.prefix_stats.num_requests_hit += bool(hits)
        return hits, num_hit_tokens

    def can_allocate(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> bool:
        computed = new_computed_blocks or []
        return self._num_blocks_needed(request, num_new_tokens, computed) <= self._num_available(
            computed
        )

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Give the request room for `num_new_tokens` more tokens beyond its computed ones
        (plus prefix hits in `new_computed_blocks`). Returns the new blocks, or None (and
        changes nothing) when the pool cannot hold them."""
        computed = new_computed_blocks or []
        num_needed = self._num_blocks_needed(request, num_new_tokens, computed)
        if num_needed > self._num_available(computed):
            return None
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if computed:
            self.pool.touch(computed)
            blocks.extend(computed)
        new_blocks = self.pool.get_new_blocks(num_needed) if num_needed > 0 else []
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's full, computed blocks in the prefix cache: those that became
        full since the last call (a decode step mostly has none, and hashes nothing)."""
        if not self.enable_caching:
            return
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return
        offered = self._num_offered.get(request.request_id, 0)
        num_full = min(num_computed_tokens, request.num_tokens) // self.block_size
        if num_full <= offered:
            return
        salt = request.sampling_params.cache_salt
        hash_request_blocks(request.all_token_ids, self.block_size, request.block_hashes, salt)
        num_full = min(num_full, len(request.block_hashes), len(blocks))
        self.pool.cache_full_blocks(blocks, request.block_hashes, offered, num_full)
        self._num_offered[request.request_id] = max(offered, num_full)

    def trim(self, request: Request, num_tokens: int) -> int:
        """Give back the request's blocks past those `num_tokens` tokens need (slots a step
        took for speculative tokens that were rejected). They hold no full computed block, so
        none is in the prefix cache. Returns how many blocks were freed."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = self.num_blocks_for(num_tokens)
        if not blocks or len(blocks) <= keep:
            return 0
        tail = blocks[keep:]
        del blocks[keep:]
        if self._num_offered.get(request.request_id, 0) > keep:  # never: cached blocks stay
            self._num_offered[request.request_id] = keep
        self.pool.free_blocks(reversed(tail))
        return len(tail)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first so its prefix stays cached longest."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self._num_offered.pop(request.request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def _num_blocks_needed(
        self, request: Request, num_new_tokens: int, computed: list[KVCacheBlock]
    ) -> int:
        held = len(self.req_to_blocks.get(request.request_id, ())) + len(computed)
        num_tokens = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        return max(0, self.num_blocks_for(num_tokens) - held)

    def _num_available(self, computed: list[KVCacheBlock]) -> int:
        # Hits that sit in the free queue are not available for new allocations.
        return self.pool.num_free_blocks - sum(1 for b in computed if b.ref_cnt == 0)
