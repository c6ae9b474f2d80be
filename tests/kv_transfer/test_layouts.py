"""KV hand-off between any prefill and decode tensor-parallel layouts: the head routes
(`layout.head_route`) give every decode rank each of its heads exactly once, the handshake
refuses a pair of ranks with nothing to move, and a request's KV moves over every backend from
every prefill rank (`FanOutKVSender`) into exactly the heads each decode rank caches: 1->2,
2->1, 2->4, 4->2, uneven splits (3 KV heads) and replicated heads (TP above the KV heads)."""

from __future__ import annotations

import os

import pytest
import torch

from duet.engine.parallel import kv_head_range
from duet.kv_transfer import HandshakeError, KVLayout, TransferStatus, create_receiver
from duet.kv_transfer import create_sender as make_sender
from duet.kv_transfer.base import TransferResult
from duet.kv_transfer.fanout import FanOutKVSender, combine, join_addresses, split_addresses
from duet.kv_transfer.layout import check_compatible, head_route, num_senders
from duet.kv_transfer.local import LocalHub
from tests.waiting import wait_for

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def layout(num_kv_heads: int, tp_size: int, tp_rank: int) -> KVLayout:
    return KVLayout("m", "float32", 4, 3, num_kv_heads, 8, tp_size, tp_rank)


def routes(k: int, n: int, m: int) -> dict[tuple[int, int], tuple[int, int]]:
    """(sender rank, receiver rank) -> the model heads it moves, for every pair that moves any."""
    out = {}
    for r in range(n):
        for s in range(m):
            route = head_route(layout(k, n, r), layout(k, m, s))
            if route is not None:
                out[r, s] = (route.start, route.end)
    return out


def test_routes_of_the_issue_layouts():
    assert routes(4, 1, 2) == {(0, 0): (0, 2), (0, 1): (2, 4)}
    assert routes(4, 2, 1) == {(0, 0): (0, 2), (1, 0): (2, 4)}
    assert routes(4, 2, 4) == {(0, 0): (0, 1), (0, 1): (1, 2), (1, 2): (2, 3), (1, 3): (3, 4)}
    assert routes(4, 4, 2) == {(0, 0): (0, 1), (1, 0): (1, 2), (2, 1): (2, 3), (3, 1): (3, 4)}
    # SmolLM2's 3 KV heads: rank 0 of 2 caches head 0, rank 1 heads 1-2
    assert routes(3, 2, 1) == {(0, 0): (0, 1), (1, 0): (1, 3)}
    assert routes(3, 1, 2) == {(0, 0): (0, 1), (0, 1): (1, 3)}
    assert routes(3, 2, 3) == {(0, 0): (0, 1), (1, 1): (1, 2), (1, 2): (2, 3)}
    # replicated: 3 heads over 4 ranks (rank 1 repeats rank 0's head and ships nothing)
    assert routes(3, 4, 2) == {(0, 0): (0, 1), (2, 1): (1, 2), (3, 1): (2, 3)}
    assert routes(2, 1, 4) == {(0, 0): (0, 1), (0, 1): (0, 1), (0, 2): (1, 2), (0, 3): (1, 2)}
    assert routes(2, 4, 4) == {(0, 0): (0, 1), (0, 1): (0, 1), (2, 2): (1, 2), (2, 3): (1, 2)}


def test_every_receiver_rank_gets_each_of_its_heads_once():
    for k in range(1, 9):
        for n in range(1, 2 * k + 1):
            for m in range(1, 2 * k + 1):
                table = routes(k, n, m)
                for s in range(m):
                    got = sorted(
                        h for (_, t), (a, b) in table.items() if t == s for h in range(a, b)
                    )
                    assert got == list(range(*kv_head_range(k, m, s))), (k, n, m, s)
                    assert num_senders(layout(k, n, 0), layout(k, m, s)) == len(
                        [1 for (_, t) in table if t == s]
                    )


def test_handshake_refuses_ranks_with_nothing_to_move_and_bad_ranks():
    with pytest.raises(HandshakeError) as info:
        check_compatible(layout(4, 2, 1), layout(4, 2, 0))
    assert str(info.value) == (
        "KV layout mismatch; refusing to transfer: the sender (tp_rank 1 of 2, ships KV heads "
        "[2, 4]) has none of the receiver's (tp_rank 0 of 2, KV heads [0, 2])"
    )
    with pytest.raises(
        HandshakeError, match=r"receiver tp_rank: must be in \[0, tp_size=2\); got 2"
    ):
        check_compatible(layout(4, 1, 0), layout(4, 2, 2))
    with pytest.raises(HandshakeError, match="num_kv_heads: sender 4 != receiver 2"):
        check_compatible(layout(4, 1, 0), layout(2, 1, 0))


def test_addresses_and_combined_outcomes():
    assert split_addresses(join_addresses(["h:1", "h:2"])) == ["h:1", "h:2"]
    with pytest.raises(ValueError, match="addresses: one non-empty address per rank"):
        join_addresses(["h:1", ""])
    done = TransferResult("r", TransferStatus.DONE, num_chunks=2)
    failed = TransferResult("r", TransferStatus.FAILED, "lost", retryable=True, num_chunks=1)
    assert combine("r", []) == TransferResult("r", TransferStatus.DONE)
    assert combine("r", [done, done]).num_chunks == 4
    assert combine("r", [done, failed]) == TransferResult(
        "r", TransferStatus.FAILED, "lost", retryable=True, num_chunks=3
    )
    aborted = TransferResult("r", TransferStatus.ABORTED)
    assert combine("r", [done, aborted]).status == TransferStatus.ABORTED


def full_caches(k: int, num_blocks: int = 12) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(2, num_blocks, 4, k, 8, generator=g) for _ in range(3)]


def shard(full: list[torch.Tensor], k: int, tp: int, rank: int) -> list[torch.Tensor]:
    start, end = kv_head_range(k, tp, rank)
    return [c[:, :, :, start:end].contiguous() for c in full]


LAYOUTS = [(4, 1, 2), (4, 2, 1), (4, 2, 4), (4, 4, 2), (3, 2, 3), (3, 4, 2), (2, 1, 4)]
CASES = (
    [("tcp", case) for case in LAYOUTS]
    + [
        (backend, case)
        for backend in ("torch_dist", "nixl", "local")
        for case in ((4, 2, 4), (3, 4, 2), (2, 1, 4))
    ]
    + [("nixl-push", (3, 1, 2))]
)


@pytest.mark.parametrize(("backend", "case"), CASES, ids=[f"{b}-{c}" for b, c in CASES])
def test_kv_moves_between_any_layouts_into_exactly_each_ranks_heads(backend, case, monkeypatch):
    k, n, m = case
    if backend == "nixl-push":  # the sender writes into each receiver rank's head slice
        monkeypatch.setenv("DUET_KV_NIXL_MODE", "push")
        backend = "nixl"
    full = full_caches(k)
    hub = LocalHub()
    options = {"hub": hub} if backend == "local" else {}
    dst = [[torch.zeros_like(c) for c in shard(full, k, m, s)] for s in range(m)]
    receivers = [
        create_receiver(
            backend,
            kv_caches=dst[s],
            layout=KVLayout.of_caches("m", dst[s], k, m, s),
            name=f"d{s}",
            timeout_s=10,
            **options,
        )
        for s in range(m)
    ]
    senders = []
    for r in range(n):
        src = shard(full, k, n, r)
        src_layout = KVLayout.of_caches("m", src, k, n, r)

        def make(index, src=src, src_layout=src_layout, r=r):
            return make_sender(
                backend, kv_caches=src, layout=src_layout, name=f"p{r}-{index}", timeout_s=10,
                **options,
            )  # fmt: skip

        senders.append(FanOutKVSender(make, src_layout))
    try:
        dest = join_addresses([recv.address for recv in receivers])
        for recv in receivers:
            recv.expect("req", [7, 2, 9], timeout_s=20)
        for r, sender in enumerate(senders):
            sender.send("req", [1, 4, 5], dest, meta={"first_token": 11, "rank": r})
        table = routes(k, n, m)
        for s, recv in enumerate(receivers):
            [done] = wait_for(recv.poll, 30, "the receiver's outcome")
            assert done.status == TransferStatus.DONE
            lowest = min(r for r, t in table if t == s)  # the metadata of its lowest sender
            assert done.meta == {"first_token": 11, "rank": lowest}
        for sender in senders:
            [sent] = wait_for(sender.poll, 30, "the sender's outcome")
            assert sent.status == TransferStatus.DONE
        for s in range(m):
            want = shard(full, k, m, s)
            for got, w in zip(dst[s], want, strict=True):
                assert torch.equal(got[:, [7, 2, 9]], w[:, [1, 4, 5]])
                untouched = [b for b in range(12) if b not in (7, 2, 9)]
                assert not got[:, untouched].any()
        # a rank with nothing to ship sent nothing: only the routed pairs made senders
        made = {(r, index) for r, sender in enumerate(senders) for index in sender._senders}
        assert made == set(table)
    finally:
        for sender in senders:
            sender.close()
        for recv in receivers:
            recv.close()
