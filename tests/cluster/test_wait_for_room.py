"""A decode worker without room is a reason to wait, not a failure (`ClusterEngine._attempts`):
a request refused for lack of room more often than it has attempts still completes once room
frees up, spending none of them; one that never finds room ends at its own timeout with a
retryable error that says why."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from duet.cluster.config import ClusterConfig
from duet.cluster.decode_client import rpc_error
from duet.cluster.engine import ClusterEngine
from duet.cluster.worker_pool import DecodeState
from duet.engine import SamplingParams
from duet.engine.async_engine import EngineDeadError
from tests.cluster.test_attempt import FakeDecodeClient, FakeStream, delta

PROMPT = list(range(10, 50))
GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
NO_ROOM = "no room for 40 prompt tokens (3 free blocks, 4/4 sequences)"


def engine_with_one_decode_worker(model: str, config: ClusterConfig) -> ClusterEngine:
    """No prefill worker (the decode worker prefills) and no polling: the test is the pool."""
    engine = ClusterEngine(model, config)
    state = DecodeState("d0", FakeDecodeClient(), healthy=True, block_size=8,  # type: ignore[arg-type]
                        max_num_seqs=4, num_free_blocks=100, num_blocks=100)  # fmt: skip
    engine.pool.decode["d0"] = state
    return engine


def test_a_full_decode_worker_is_waited_for_not_failed(tiny_llama: str) -> None:
    engine = engine_with_one_decode_worker(tiny_llama, ClusterConfig(max_attempts=2))
    client: FakeDecodeClient = engine.pool.decode["d0"].client  # type: ignore[assignment]

    async def main() -> list[int]:
        for _ in range(5):  # more refusals than the request has attempts
            client.answers.put_nowait(rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, NO_ROOM))
        stream = FakeStream(None)
        client.answers.put_nowait(stream)
        for item in (delta(7), delta(8), delta(9, finish="length")):
            stream.items.put_nowait(item)
        last = None
        async with asyncio.timeout(30):
            async for out in engine.generate(PROMPT, GREEDY):
                last = out
        assert last is not None and last.outputs[0].finish_reason == "length"
        return list(last.outputs[0].token_ids)

    assert asyncio.run(main()) == [7, 8, 9]
    request_id = client.calls[0][1].split("@")[0]
    assert client.calls == [("generate", f"{request_id}@{i}") for i in range(1, 7)]
    assert sum(engine.transfers.num_migrations.values()) == 0  # waiting is no migration


def test_a_request_that_never_finds_room_ends_at_its_timeout(tiny_llama: str) -> None:
    config = ClusterConfig(max_attempts=2, request_timeout_s=0.6, kv_wait_s=0.3)
    engine = engine_with_one_decode_worker(tiny_llama, config)
    client: FakeDecodeClient = engine.pool.decode["d0"].client  # type: ignore[assignment]

    async def main() -> None:
        for _ in range(100):
            client.answers.put_nowait(rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, NO_ROOM))
        async with asyncio.timeout(30):
            async for _ in engine.generate(PROMPT, GREEDY):
                pass

    with pytest.raises(EngineDeadError, match=r"timed out after 0\.6s waiting for room") as e:
        asyncio.run(main())
    assert NO_ROOM in str(e.value)
    assert len(client.calls) > 2  # past its attempts: every try was a wait
