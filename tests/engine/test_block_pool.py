"""BlockPool and KVCacheManager: exact block ids, ref counts, eviction order."""

from __future__ import annotations

import pytest

from duet.engine.block_pool import BlockPool, hash_block_tokens, hash_request_blocks
from duet.engine.kv_cache_manager import KVCacheManager
from duet.engine.request import Request
from duet.engine.sampling_params import SamplingParams


def make_request(request_id: str, tokens: list[int], salt: str | None = None) -> Request:
    params = SamplingParams(max_tokens=8, cache_salt=salt)
    return Request(request_id, tokens, params, max_tokens=8)


def test_new_blocks_come_from_front_in_id_order():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.free_block_ids() == [3, 4, 5]
    with pytest.raises(ValueError, match="cannot get 4 blocks; 3 free"):
        pool.get_new_blocks(4)


def test_free_order_sets_eviction_order():
    pool = BlockPool(4)
    a = pool.get_new_blocks(3)
    pool.free_blocks(reversed(a))  # tail first, as KVCacheManager.free does
    assert pool.free_block_ids() == [3, 2, 1, 0]
    assert pool.num_free_blocks == 4


def test_blocks_taken_in_queue_order_serve_in_ascending_ids():
    """Eviction picks which blocks (the queue's front); the request gets them in ascending
    order, so a freed request's blocks, queued tail-first, come back as one run."""
    pool = BlockPool(8)
    a, b = pool.get_new_blocks(3), pool.get_new_blocks(2)  # 0 1 2, 3 4
    pool.free_blocks(reversed(b))
    pool.free_blocks(reversed(a))
    assert pool.free_block_ids() == [5, 6, 7, 4, 3, 2, 1, 0]
    assert [x.block_id for x in pool.get_new_blocks(5)] == [3, 4, 5, 6, 7]  # front five
    assert pool.free_block_ids() == [2, 1, 0]
    assert [x.block_id for x in pool.get_new_blocks(3)] == [0, 1, 2]


def test_touch_and_ref_counts():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 1 and 0 not in pool.free_block_ids()
    pool.free_blocks([b])
    assert b.ref_cnt == 0 and pool.free_block_ids()[-1] == 0
    with pytest.raises(RuntimeError, match="double free of block 0"):
        pool.free_blocks([b])
    # Touching a free block takes it out of the free queue.
    pool.touch([b])
    assert b.ref_cnt == 1 and 0 not in pool.free_block_ids()


def test_cached_free_block_is_evicted_only_when_reused():
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(2)
    h0, h1 = hash_block_tokens(None, [1, 2]), hash_block_tokens(None, [3, 4])
    pool.cache_full_blocks(blocks, [h0, h1], 0, 2)
    pool.free_blocks(reversed(blocks))
    assert pool.free_block_ids() == [1, 0]
    assert pool.get_cached_block(h0) is blocks[0]
    (reused,) = pool.get_new_blocks(1)  # LRU front: block 1 goes, with its hash
    assert reused.block_id == 1 and reused.block_hash is None
    assert pool.get_cached_block(h1) is None
    assert pool.get_cached_block(h0) is blocks[0]
    assert pool.num_evictions == 1


def test_prefix_cache_events_in_order_only_when_recording():
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(2)
    h0, h1, h2 = (hash_block_tokens(None, [t]) for t in (1, 2, 3))
    pool.cache_full_blocks(blocks, [h0, h1], 0, 1)
    assert pool.take_events() == []  # off by default
    pool.record_events = True
    pool.cache_full_blocks(blocks, [h0, h1], 0, 2)  # block 0 already cached: one event
    pool.free_blocks(reversed(blocks))
    (reused,) = pool.get_new_blocks(1)  # evicts block 1 (h1)
    pool.cache_full_blocks([reused], [h2], 0, 1)
    assert pool.take_events() == [(True, h1), (False, h1), (True, h2)]
    assert pool.take_events() == []


def test_chained_hashes_depend_on_parent():
    a = hash_request_blocks([1, 2, 3, 4, 5], 2, [])
    b = hash_request_blocks([9, 9, 3, 4], 2, [])
    assert len(a) == 2 and len(b) == 2
    assert a[1] != b[1]  # same tokens [3, 4], different parents
    assert hash_request_blocks([1, 2, 3, 4, 5, 6], 2, list(a))[:2] == a


def test_a_salt_changes_every_hash_of_the_chain():
    plain = hash_request_blocks([1, 2, 3, 4], 2, [])
    salted = hash_request_blocks([1, 2, 3, 4], 2, [], "tenant-a")
    assert hash_request_blocks([1, 2, 3, 4], 2, [], "tenant-a") == salted
    other = hash_request_blocks([1, 2, 3, 4], 2, [], "tenant-b")
    assert len({plain[0], salted[0], other[0]}) == 3 and len({plain[1], salted[1], other[1]}) == 3
    assert salted[1] == hash_block_tokens(salted[0], [3, 4])  # the salt enters the first only


def test_prefix_hits_only_between_requests_of_one_salt():
    kv = KVCacheManager(num_blocks=12, block_size=4)
    for i, salt in enumerate((None, "a")):
        first = make_request(f"first-{i}", list(range(12)), salt)
        kv.allocate_slots(first, 12)
        first.num_computed_tokens = 12
        kv.cache_blocks(first, 12)
    hits = {}
    for salt in (None, "a", "b"):
        blocks, num_hit = kv.get_computed_blocks(make_request(f"x-{salt}", list(range(13)), salt))
        hits[salt] = ([b.block_id for b in blocks], num_hit)
    assert hits == {None: ([0, 1, 2], 12), "a": ([3, 4, 5], 12), "b": ([], 0)}


def test_manager_allocation_exact_ids_and_free():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = make_request("a", list(range(10)))  # 10 tokens -> 3 blocks
    assert kv.allocate_slots(r, 10) is not None
    assert kv.get_block_ids("a") == [0, 1, 2]
    r.num_computed_tokens = 10
    r.append_output_token(99)
    r.append_output_token(98)  # 12 tokens: still 3 blocks
    assert kv.allocate_slots(r, 2) == []
    r.num_computed_tokens = 12
    r.append_output_token(97)
    new = kv.allocate_slots(r, 1)
    assert [b.block_id for b in new] == [3]
    assert kv.num_free_blocks == 4
    kv.free(r)
    assert kv.num_free_blocks == 8
    assert kv.pool.free_block_ids() == [4, 5, 6, 7, 3, 2, 1, 0]


def test_manager_refuses_without_side_effects():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    r = make_request("a", list(range(9)))  # needs 3 blocks
    assert not kv.can_allocate(r, 9)
    assert kv.allocate_slots(r, 9) is None
    assert kv.num_free_blocks == 2 and kv.get_block_ids("a") == []


def test_prefix_hits_share_blocks_and_keep_one_token_to_compute():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    first = make_request("a", list(range(12)))
    kv.allocate_slots(first, 12)
    first.num_computed_tokens = 12
    kv.cache_blocks(first, 12)
    # Same 12 tokens: 3 full blocks cached, but the last token must be recomputed -> 2 blocks hit.
    same = make_request("b", list(range(12)))
    blocks, num_hit = kv.get_computed_blocks(same)
    assert [b.block_id for b in blocks] == [0, 1] and num_hit == 8
    longer = make_request("c", [*range(12), 50, 51])
    blocks, num_hit = kv.get_computed_blocks(longer)
    assert [b.block_id for b in blocks] == [0, 1, 2] and num_hit == 12
    assert kv.allocate_slots(longer, 2, blocks) is not None
    assert kv.get_block_ids("c") == [0, 1, 2, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 2, 1]
    kv.free(first)
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [1, 1, 1, 1]
    kv.free(longer)
    assert kv.num_free_blocks == 10
    # Freed cached blocks still serve hits until evicted.
    again = make_request("d", [*range(12), 7])
    blocks, num_hit = kv.get_computed_blocks(again)
    assert [b.block_id for b in blocks] == [0, 1, 2] and num_hit == 12
    assert kv.prefix_stats.num_requests == 3 and kv.prefix_stats.num_requests_hit == 3


def test_hits_in_free_queue_count_against_capacity():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    kv.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    kv.cache_blocks(a, 5)
    kv.free(a)
    b = make_request("b", [1, 2, 3, 4, 9, 9, 9, 9])  # hits 2 free blocks, needs 2 more; only 1 left
    blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 4
    assert not kv.can_allocate(b, 4, blocks)
    assert kv.allocate_slots(b, 4, blocks) is None
    assert kv.num_free_blocks == 3


def test_disabled_prefix_caching_never_hits():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_caching=False)
    a = make_request("a", [1, 2, 3])
    kv.allocate_slots(a, 3)
    a.num_computed_tokens = 3
    kv.cache_blocks(a, 3)
    kv.free(a)
    assert kv.get_computed_blocks(make_request("b", [1, 2, 3])) == ([], 0)
    assert kv.pool.num_cached_blocks == 0


def test_cache_blocks_offers_only_blocks_that_became_full(monkeypatch):
    """A decode step offers the prefix cache nothing until a block fills, then that block
    alone; freeing (preemption) starts the count again."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    request = make_request("r", list(range(10)))
    kv.allocate_slots(request, 10)
    offered: list[tuple[int, int]] = []
    real = kv.pool.cache_full_blocks

    def spy(blocks, hashes, start, end):
        offered.append((start, end))
        return real(blocks, hashes, start, end)

    monkeypatch.setattr(kv.pool, "cache_full_blocks", spy)
    kv.cache_blocks(request, 10)  # blocks 0 and 1 are full
    request.append_output_token(10)
    kv.allocate_slots(request, 1)
    kv.cache_blocks(request, 11)  # block 2 is not full yet: nothing to offer
    request.append_output_token(11)
    kv.allocate_slots(request, 1)
    kv.cache_blocks(request, 12)
    assert offered == [(0, 2), (2, 3)]
    assert [b.block_hash is not None for b in kv.req_to_blocks["r"]] == [True, True, True]
    kv.free(request)
    again = make_request("r", list(range(12)))
    kv.allocate_slots(again, 12)
    kv.cache_blocks(again, 12)
    assert offered[-1] == (0, 3)


def _pool_with_queue(order: list[int]) -> BlockPool:
    """A pool of len(order) blocks, all handed out, then freed in `order` (the queue's)."""
    pool = BlockPool(len(order))
    blocks = {b.block_id: b for b in pool.get_new_blocks(len(order))}
    pool.free_blocks(blocks[i] for i in order)
    assert pool.free_block_ids() == order
    return pool


def test_requests_that_grew_interleaved_come_back_as_one_run():
    """Two requests that grew a block at a time (0 2 4 and 1 3 5), freed tail-first: taken
    from the front, the next request's three blocks would be 0 2 4, three runs; among the
    six least recently freed, the oldest three consecutive ones are 2 3 4 (ages 1 4 0)."""
    pool = _pool_with_queue([4, 2, 0, 5, 3, 1])
    assert [b.block_id for b in pool.get_new_blocks(3)] == [2, 3, 4]
    assert pool.free_block_ids() == [0, 5, 1]


def test_runs_are_sought_only_among_the_least_recently_freed():
    """n blocks come from the 2n least recently freed: for two blocks, of 9 7 5 3, which
    hold no run: the oldest two, not 8, which would join them but was freed last."""
    pool = _pool_with_queue([9, 7, 5, 3, 1, 0, 2, 4, 6, 8])
    assert [b.block_id for b in pool.get_new_blocks(2)] == [7, 9]
    # then three of 5 3 1 0 2 4 (one run 0-5): the consecutive three freed longest ago
    assert [b.block_id for b in pool.get_new_blocks(3)] == [3, 4, 5]
    assert pool.free_block_ids() == [1, 0, 2, 6, 8]


def test_the_longest_runs_go_first():
    """Of 0 1 | 4 5 6 | 9 (queue 9 0 1 4 5 6 ...), three blocks are the run 4 5 6, though
    9 and 0 were freed before it."""
    pool = _pool_with_queue([9, 0, 1, 4, 5, 6, 2, 3, 7, 8])
    assert [b.block_id for b in pool.get_new_blocks(3)] == [4, 5, 6]
    assert pool.free_block_ids() == [9, 0, 1, 2, 3, 7, 8]
