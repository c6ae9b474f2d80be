"""The attempt's state machine (cluster/attempt.py) over fake worker clients: which calls it
makes in which order, how each failure ends it (through outcomes.py's table), and that every
way out cancels what still runs, aborts the request and gives the pool's accounting back."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from duet.cluster.attempt import AttemptRunner, RetryAttempt
from duet.cluster.attempt_events import Phase
from duet.cluster.config import ClusterConfig
from duet.cluster.decode_client import rpc_error
from duet.cluster.prefill_client import PrefillOutcome
from duet.cluster.sample import ClusterSample
from duet.cluster.transfer_log import TransferLog
from duet.cluster.worker_pool import DecodeState, PrefillState, WorkerPool
from duet.engine import InvalidInputError, SamplingParams
from duet.engine.async_engine import EngineDeadError
from duet.engine.llm_engine import EngineStats
from duet.engine.output_processor import OutputAssembler
from duet.engine.request import Request
from duet.engine.tokenizer import Tokenizer
from duet.kv_transfer import TransferStatus
from duet.v1 import worker_pb2
from tests.waiting import wait_for_async

PROMPT = list(range(10, 50))  # 40 tokens: 5 blocks of 8
KV_ADDRESS = "decode-0:kv"
WAIT_S = 10.0


class FakeStream:
    """A `DecodeStream`: the test puts deltas, errors or None (the stream ends) on `items`;
    `cancelled` when it was cancelled before it was over (the real one aborts it then)."""

    def __init__(self, kv_address: str | None) -> None:
        self.reserved = None if kv_address is None else worker_pb2.Reserved(kv_address=kv_address)
        self.items: asyncio.Queue[object] = asyncio.Queue()
        self.over = self.cancelled = False

    async def deltas(self):
        while not self.over:
            item = await self.items.get()
            if item is None or isinstance(item, Exception):
                self.over = True
                if item is None:
                    return
                raise item
            self.over = bool(item.finish_reason)
            yield item

    def cancel(self) -> None:
        self.cancelled = self.cancelled or not self.over
        self.over = True


class FakeDecodeClient:
    """Each start call waits for the test to answer it (`answer`: a stream or an error)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []  # (method, transfer id)
        self.answers: asyncio.Queue[object] = asyncio.Queue()
        self.cancelled_calls = 0

    async def _start(self, method: str, transfer_id: str) -> FakeStream:
        self.calls.append((method, transfer_id))
        try:
            answer = await self.answers.get()
        except asyncio.CancelledError:
            self.cancelled_calls += 1
            raise
        if isinstance(answer, Exception):
            raise answer
        assert isinstance(answer, FakeStream)
        return answer

    async def reserve(self, transfer_id, ids, params, kv_wait_s, timeout_s, replayed, priority):
        return await self._start("reserve", transfer_id)

    async def generate(self, transfer_id, ids, params, timeout_s, replayed, priority):
        return await self._start("generate", transfer_id)


class FakePrefillClient:
    def __init__(self) -> None:
        self.destinations: list[str] = []
        self.answers: asyncio.Queue[object] = asyncio.Queue()
        self.cancelled_calls = 0

    async def prefill(self, transfer_id, ids, params, destination, timeout_s, replayed, priority):
        self.destinations.append(destination)
        try:
            answer = await self.answers.get()
        except asyncio.CancelledError:
            self.cancelled_calls += 1
            raise
        if isinstance(answer, Exception):
            raise answer
        return answer


def done(prompt_logprobs=None) -> PrefillOutcome:
    return PrefillOutcome(TransferStatus.DONE, "", False, 7, 0, 640, 0.01, prompt_logprobs)


def delta(*tokens: int, finish: str = "") -> worker_pb2.OutputDelta:
    return worker_pb2.OutputDelta(token_ids=tokens, finish_reason=finish)


class Harness:
    """One decode and one prefill worker in a pool, both healthy, as the attempt sees them."""

    def __init__(self, tokenizer: Tokenizer, threshold: int = 8, beside: bool = False) -> None:
        self.config = ClusterConfig(
            local_prefill_threshold=threshold, prefill_with_reservation=beside
        )
        self.pool = WorkerPool()
        self.decode_client, self.prefill_client = FakeDecodeClient(), FakePrefillClient()
        self.decode = DecodeState("d0", self.decode_client, healthy=True, block_size=8,  # type: ignore[arg-type]
                                  max_num_seqs=4, num_free_blocks=100, kv_address=KV_ADDRESS)  # fmt: skip
        self.prefill = PrefillState("p0", self.prefill_client, healthy=True, block_size=8)  # type: ignore[arg-type]
        self.pool.decode["d0"], self.pool.prefill["p0"] = self.decode, self.prefill
        self.transfers = TransferLog()
        self.runner = AttemptRunner(self.config, self.pool, EngineStats(), self.transfers)
        self.tokenizer = tokenizer
        self.updates: asyncio.Queue[BaseException | None] = asyncio.Queue()

    def sample(self, params: SamplingParams) -> ClusterSample:
        request = Request("r1", PROMPT, params, params.max_tokens or 16)
        assembler = OutputAssembler(self.tokenizer, "r1", None, PROMPT, params)
        return ClusterSample(0, request, assembler)

    def start(self, sample: ClusterSample) -> asyncio.Task[None]:
        return asyncio.create_task(
            self.runner.run(sample, PROMPT, self.decode, 1, _deadline(), self.updates)
        )

    @property
    def accounting(self) -> tuple[int, int, int]:
        return self.decode.num_sent, self.decode.num_sent_blocks, self.prefill.num_sent_tokens


def _deadline() -> float:
    return asyncio.get_running_loop().time() + 60.0


@pytest.fixture(scope="module")
def tokenizer(tiny_llama) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama)


GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


async def _finish(h: Harness, task: asyncio.Task[None], stream: FakeStream) -> None:
    stream.items.put_nowait(delta(7))
    stream.items.put_nowait(delta(8, 9, finish="length"))
    await asyncio.wait_for(task, WAIT_S)


def test_reserve_then_prefill_then_stream(tokenizer):
    async def main():
        h = Harness(tokenizer)
        sample = h.sample(GREEDY)
        task = h.start(sample)
        await wait_for_async(lambda: h.decode_client.calls, WAIT_S, "the reservation call")
        assert h.accounting == (1, 5, 0)  # counted from the call on
        assert h.prefill_client.destinations == []  # nothing before the reservation's answer
        stream = FakeStream("decode-0:reserved")
        h.decode_client.answers.put_nowait(stream)
        await wait_for_async(lambda: h.prefill_client.destinations, WAIT_S, "the prefill call")
        assert h.accounting == (1, 5, 40)
        h.prefill_client.answers.put_nowait(done())
        await _finish(h, task, stream)
        return h, sample, stream

    h, sample, stream = asyncio.run(main())
    assert h.decode_client.calls == [("reserve", "r1@1")]
    assert h.prefill_client.destinations == ["decode-0:reserved"]
    assert sample.request.output_token_ids == [7, 8, 9]
    assert sample.finish_reason == "length"
    assert [r.status for r in h.transfers.recent] == ["done"]
    assert h.accounting == (0, 0, 0)
    assert not stream.cancelled  # it ended on its own


def test_prefill_beside_the_reservation(tokenizer):
    async def main():
        h = Harness(tokenizer, beside=True)
        task = h.start(h.sample(GREEDY))
        await wait_for_async(lambda: h.prefill_client.destinations, WAIT_S, "the prefill call")
        assert h.decode_client.calls == [("reserve", "r1@1")]  # both out, neither answered
        stream = FakeStream(KV_ADDRESS)
        h.decode_client.answers.put_nowait(stream)
        h.prefill_client.answers.put_nowait(done())
        await _finish(h, task, stream)
        return h

    h = asyncio.run(main())
    assert h.prefill_client.destinations == [KV_ADDRESS]  # from the load report
    assert h.accounting == (0, 0, 0)


def test_beside_waits_for_the_reservation_where_the_report_shows_no_room(tokenizer):
    async def main():
        h = Harness(tokenizer, beside=True)
        h.decode.num_free_blocks = 4  # the prompt needs 5
        task = h.start(h.sample(GREEDY))
        await wait_for_async(lambda: h.decode_client.calls, WAIT_S, "the reservation call")
        # A prefill call started beside it would have been created first, so run first.
        before = list(h.prefill_client.destinations)
        stream = FakeStream("decode-0:reserved")
        h.decode_client.answers.put_nowait(stream)
        await wait_for_async(lambda: h.prefill_client.destinations, WAIT_S, "the prefill call")
        h.prefill_client.answers.put_nowait(done())
        await _finish(h, task, stream)
        return h, before

    h, before = asyncio.run(main())
    assert before == []
    assert h.prefill_client.destinations == ["decode-0:reserved"]


def test_a_reservation_elsewhere_than_the_report_retries(tokenizer):
    async def main():
        h = Harness(tokenizer, beside=True)
        task = h.start(h.sample(GREEDY))
        await wait_for_async(lambda: h.prefill_client.destinations, WAIT_S, "the prefill call")
        stream = FakeStream("decode-0:restarted")
        h.decode_client.answers.put_nowait(stream)
        with pytest.raises(RetryAttempt, match="moved its KV address to 'decode-0:restarted'"):
            await asyncio.wait_for(task, WAIT_S)
        return h, stream

    h, stream = asyncio.run(main())
    assert stream.cancelled  # aborted on the decode worker
    assert h.prefill_client.cancelled_calls == 1  # and on the prefill worker
    assert [(r.status, r.reason) for r in h.transfers.recent] == [("failed", "decode_lost")]
    assert h.decode.healthy and h.accounting == (0, 0, 0)


def test_a_full_decode_worker_is_skipped_a_moment(tokenizer):
    async def main():
        h = Harness(tokenizer, beside=True)
        task = h.start(h.sample(GREEDY))
        await wait_for_async(lambda: h.prefill_client.destinations, WAIT_S, "the prefill call")
        h.decode_client.answers.put_nowait(rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "full"))
        with pytest.raises(RetryAttempt, match="decode worker d0: RESOURCE_EXHAUSTED: full"):
            await asyncio.wait_for(task, WAIT_S)
        return h, asyncio.get_running_loop().time()

    h, now = asyncio.run(main())
    assert now < h.decode.full_until <= now + 0.2
    assert h.decode.healthy
    assert h.prefill_client.cancelled_calls == 1  # the prefill started beside it is aborted
    assert h.accounting == (0, 0, 0)


def test_a_failed_transfer_retries_and_aborts_the_reservation(tokenizer):
    async def main():
        h = Harness(tokenizer)
        task = h.start(h.sample(GREEDY))
        stream = FakeStream(KV_ADDRESS)
        h.decode_client.answers.put_nowait(stream)
        await wait_for_async(lambda: h.prefill_client.destinations, WAIT_S, "the prefill call")
        failed = PrefillOutcome(TransferStatus.FAILED, "peer lost", True, 0, 0)
        h.prefill_client.answers.put_nowait(failed)
        with pytest.raises(RetryAttempt) as e:
            await asyncio.wait_for(task, WAIT_S)
        return h, stream, str(e.value)

    h, stream, message = asyncio.run(main())
    assert message == "prefill worker p0: KV transfer failed: peer lost"
    assert stream.cancelled
    assert h.prefill.healthy and h.decode.healthy
    assert [(r.status, r.reason) for r in h.transfers.recent] == [("failed", "peer_lost")]
    assert h.accounting == (0, 0, 0)


@pytest.mark.parametrize(
    ("item", "raised", "message", "decode_healthy"),
    [
        (
            rpc_error(grpc.StatusCode.UNAVAILABLE, "gone"),
            RetryAttempt,
            "decode worker d0: UNAVAILABLE: gone",
            False,
        ),
        (None, RetryAttempt, "decode worker d0 ended the stream early", False),
        (
            rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"),
            EngineDeadError,
            "request timed out after 600.0s",
            True,
        ),
        (
            rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "prompt: too long"),
            InvalidInputError,
            "prompt: too long",
            True,
        ),
    ],
    ids=["lost", "cut-short", "deadline", "invalid"],
)
def test_how_a_decode_stream_ends_the_attempt(tokenizer, item, raised, message, decode_healthy):
    async def main():
        h = Harness(tokenizer, threshold=64)  # prefilled on the decode worker
        task = h.start(h.sample(GREEDY))
        stream = FakeStream(None)
        h.decode_client.answers.put_nowait(stream)
        stream.items.put_nowait(delta(7))
        stream.items.put_nowait(item)
        with pytest.raises(raised) as e:
            await asyncio.wait_for(task, WAIT_S)
        return h, str(e.value)

    h, got = asyncio.run(main())
    assert h.decode_client.calls == [("generate", "r1@1")]
    assert message in got
    assert h.decode.healthy is decode_healthy
    assert h.prefill_client.destinations == []
    assert h.accounting == (0, 0, 0)


def test_prompt_logprobs_hold_the_tokens_until_the_prefill_answer(tokenizer):
    """The whole stream (its finishing delta included) may come before the prefill worker's
    answer, which carries the prompt logprobs: nothing goes out before them, and a stream
    that ended with its finishing delta is not one cut short."""
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=0)
    entries = [None] + [(-1.0, 1, [])] * (len(PROMPT) - 1)

    async def main():
        h = Harness(tokenizer)
        sample = h.sample(params)
        task = h.start(sample)
        stream = FakeStream(KV_ADDRESS)
        h.decode_client.answers.put_nowait(stream)
        await wait_for_async(lambda: h.prefill_client.destinations, WAIT_S, "the prefill call")
        stream.items.put_nowait(delta(7))
        stream.items.put_nowait(delta(8, finish="length"))
        await wait_for_async(lambda: stream.items.empty(), WAIT_S, "the stream read")
        held = (h.updates.qsize(), list(sample.request.output_token_ids))
        h.prefill_client.answers.put_nowait(done(entries))
        await asyncio.wait_for(task, WAIT_S)
        return h, sample, held

    h, sample, held = asyncio.run(main())
    assert held == (0, [])
    assert sample.request.output_token_ids == [7, 8]
    assert sample.assembler.prompt_logprobs is not None
    assert h.updates.qsize() == 2


def test_a_cancelled_attempt_cancels_its_reservation(tokenizer):
    async def main():
        h = Harness(tokenizer)
        task = h.start(h.sample(GREEDY))
        await wait_for_async(lambda: h.decode_client.calls, WAIT_S, "the reservation call")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, WAIT_S)
        return h

    h = asyncio.run(main())
    assert h.decode_client.cancelled_calls == 1  # DecodeClient.reserve then aborts it there
    assert h.accounting == (0, 0, 0)
    assert list(h.transfers.recent) == []  # no prefill call, no transfer


def test_the_phases_in_order(tokenizer, monkeypatch):
    seen: list[Phase] = []
    from duet.cluster import attempt

    real_on = attempt.Attempt._on

    def on(self, event):
        real_on(self, event)
        if not seen or seen[-1] is not self.phase:
            seen.append(self.phase)

    monkeypatch.setattr(attempt.Attempt, "_on", on)

    async def main():
        h = Harness(tokenizer)
        task = h.start(h.sample(GREEDY))
        stream = FakeStream(KV_ADDRESS)
        h.decode_client.answers.put_nowait(stream)
        await wait_for_async(lambda: h.prefill_client.destinations, WAIT_S, "the prefill call")
        h.prefill_client.answers.put_nowait(done())
        await _finish(h, task, stream)

    asyncio.run(main())
    assert seen == [Phase.PREFILL, Phase.STREAM, Phase.DONE]


def test_a_retry_goes_to_a_decode_worker_that_has_not_failed_the_request(tiny_llama):
    """A decode worker cut off from the prefill workers still looks healthy to the router
    (its polls answer): every attempt there fails its transfer. The retries go elsewhere, and
    back to it only once every worker has failed the request."""
    from duet.cluster.engine import ClusterEngine

    engine = ClusterEngine(tiny_llama, ClusterConfig(max_attempts=4))
    for name, load in (("d0", 0), ("d1", 1), ("d2", 2)):  # d0 the least loaded
        engine.pool.decode[name] = DecodeState(name, FakeDecodeClient(), healthy=True,  # type: ignore[arg-type]
                                               block_size=8, max_num_seqs=4, num_running=load,
                                               num_free_blocks=100)  # fmt: skip
    tried: list[str] = []

    async def run(sample, prompt_ids, decode, attempt, deadline, updates):
        tried.append(decode.name)
        if len(tried) < 4:
            raise RetryAttempt(f"prefill worker p0: KV transfer failed: {decode.name}")

    engine._attempt.run = run  # type: ignore[method-assign]
    sample = Harness(Tokenizer.from_dir(tiny_llama)).sample(GREEDY)
    asyncio.run(engine._attempts(sample, PROMPT, asyncio.Queue()))
    assert tried == ["d0", "d1", "d2", "d0"]
