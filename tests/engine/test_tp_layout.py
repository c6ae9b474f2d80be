"""Which heads, rows and vocabulary each tensor-parallel rank holds (engine/parallel.py): whole
KV groups while TP <= KV heads, one replicated KV head per rank beyond; every query head on
exactly one rank; sizes that do not divide split as evenly as they can; impossible TP sizes
refused naming the field and the range."""

from __future__ import annotations

import pytest

from duet.engine.errors import InvalidInputError
from duet.engine.model.mlp import mlp_shard
from duet.engine.parallel import HeadShard, TensorParallel, head_shard, kv_head_range, split


@pytest.mark.parametrize(
    ("heads", "kv_heads", "world", "expected"),
    [
        # SmolLM2-135M: 9 query heads in 3 groups of 3.
        (9, 3, 1, [(0, 9, 0, 3)]),
        (9, 3, 2, [(0, 3, 0, 1), (3, 9, 1, 3)]),
        (9, 3, 3, [(0, 3, 0, 1), (3, 6, 1, 2), (6, 9, 2, 3)]),
        # TP 4 > 3 KV heads: ranks 0 and 1 share group 0 (KV head 0 replicated).
        (9, 3, 4, [(0, 1, 0, 1), (1, 3, 0, 1), (3, 6, 1, 2), (6, 9, 2, 3)]),
        # Llama-3-8B at TP 16: two ranks per KV head, two query heads each.
        (32, 8, 16, [(2 * r, 2 * r + 2, r // 2, r // 2 + 1) for r in range(16)]),
        # Even splits are Megatron's.
        (4, 2, 2, [(0, 2, 0, 1), (2, 4, 1, 2)]),
        (8, 8, 4, [(0, 2, 0, 2), (2, 4, 2, 4), (4, 6, 4, 6), (6, 8, 6, 8)]),
        (4, 1, 4, [(r, r + 1, 0, 1) for r in range(4)]),
    ],
)
def test_head_shards(heads: int, kv_heads: int, world: int, expected: list) -> None:
    shards = [head_shard(heads, kv_heads, world, r) for r in range(world)]
    assert shards == [HeadShard(*e) for e in expected]
    assert [kv_head_range(kv_heads, world, r) for r in range(world)] == [
        (s.kv_start, s.kv_end) for s in shards
    ]
    group = heads // kv_heads
    for s in shards:  # each rank's query heads read its KV heads by one group size
        assert s.num_heads % s.num_kv_heads == 0
        assert s.q_start // group == s.kv_start and (s.q_end - 1) // group == s.kv_end - 1


@pytest.mark.parametrize("world", [0, 10, -1])
def test_impossible_tp_size_is_refused_naming_the_field_and_range(world: int) -> None:
    with pytest.raises(InvalidInputError) as info:
        head_shard(9, 3, world, 0)
    assert info.value.field == "tensor_parallel_size"
    assert "between 1 and the model's num_attention_heads (9)" in str(info.value) or (
        "must be an integer >= 1" in str(info.value)
    )


def test_uneven_sizes_split_as_evenly_as_they_can() -> None:
    assert [split(10, 3, r) for r in range(3)] == [(0, 3), (3, 6), (6, 10)]
    assert [split(49152, 5, r, 1)[1] - split(49152, 5, r, 1)[0] for r in range(5)] == [
        9830, 9830, 9831, 9830, 9831,
    ]  # fmt: skip
    # The MLP keeps whole units of up to 128 columns (quantization groups of down_proj).
    assert [mlp_shard(1536, TensorParallel(r, 2)) for r in range(2)] == [(0, 768), (768, 1536)]
    assert [mlp_shard(1536, TensorParallel(r, 5)) for r in range(5)] == [
        (0, 256), (256, 512), (512, 896), (896, 1152), (1152, 1536),
    ]  # fmt: skip
    assert [mlp_shard(128, TensorParallel(r, 2)) for r in range(2)] == [(0, 64), (64, 128)]
    with pytest.raises(InvalidInputError, match="intermediate_size"):
        mlp_shard(2, TensorParallel(0, 3))
