"""The one table of attempt failures (cluster/outcomes.py) and what `AttemptRunner.settle`
makes of each outcome: the pool's marks and the error that ends the attempt."""

from __future__ import annotations

import grpc
import pytest

from duet.cluster.attempt import AttemptRunner, RetryAttempt
from duet.cluster.config import ClusterConfig
from duet.cluster.decode_client import rpc_error
from duet.cluster.outcomes import Failure, Outcome, Side
from duet.cluster.transfer_log import TransferLog
from duet.cluster.worker_pool import DecodeState, PrefillState, WorkerPool
from duet.engine import InvalidInputError
from duet.engine.async_engine import EngineDeadError
from duet.engine.llm_engine import EngineStats
from duet.kv_transfer import TransferStatus

Code = grpc.StatusCode
NOT_RETRY = {
    Side.DECODE: {
        Code.INVALID_ARGUMENT: Outcome.INVALID_INPUT,
        Code.RESOURCE_EXHAUSTED: Outcome.WORKER_FULL,
        Code.DEADLINE_EXCEEDED: Outcome.TIMED_OUT,
        Code.UNAVAILABLE: Outcome.WORKER_LOST,
        Code.CANCELLED: Outcome.WORKER_LOST,
    },
    Side.PREFILL: {
        Code.INVALID_ARGUMENT: Outcome.INVALID_INPUT,
        Code.UNAVAILABLE: Outcome.WORKER_LOST,
        Code.CANCELLED: Outcome.WORKER_LOST,
    },
}


@pytest.mark.parametrize("side", list(Side))
def test_every_status_code_of_either_side(side):
    got = {code: Failure.of_rpc(side, "w", rpc_error(code, "why")).outcome for code in Code}
    want = {code: NOT_RETRY[side].get(code, Outcome.RETRY) for code in Code}
    assert got == want


def test_the_other_causes():
    assert Failure.of_transfer("p0", TransferStatus.FAILED, "x").outcome is Outcome.RETRY
    assert Failure.of_transfer("p0", TransferStatus.ABORTED, "x").outcome is Outcome.RETRY
    assert Failure.stream_ended("d0").outcome is Outcome.WORKER_LOST
    assert Failure.no_prompt_logprobs("p0").outcome is Outcome.RETRY
    assert Failure.kv_address_moved("d0", "a").outcome is Outcome.RETRY
    odd = Failure.of_error(Side.PREFILL, "p0", RuntimeError("boom"))
    assert (odd.cause, odd.outcome, odd.message) == (
        None,
        Outcome.RETRY,
        "prefill worker p0: RuntimeError('boom')",
    )


def _runner() -> tuple[AttemptRunner, DecodeState, PrefillState]:
    pool = WorkerPool()
    decode = DecodeState("d0", None, healthy=True)  # type: ignore[arg-type]
    prefill = PrefillState("p0", None, healthy=True)  # type: ignore[arg-type]
    return AttemptRunner(ClusterConfig(), pool, EngineStats(), TransferLog()), decode, prefill


def test_settle_marks_the_pool_and_names_the_error():
    runner, decode, prefill = _runner()
    lost = runner.settle(Failure.stream_ended("d0"), decode)
    assert (type(lost), str(lost)) == (RetryAttempt, "decode worker d0 ended the stream early")
    assert not decode.healthy and prefill.healthy

    runner, decode, prefill = _runner()
    full = Failure.of_rpc(Side.DECODE, "d0", rpc_error(Code.RESOURCE_EXHAUSTED, "no room"))
    assert isinstance(runner.settle(full, decode), RetryAttempt)
    assert decode.healthy and decode.full_until > 0

    bad = Failure.of_rpc(Side.PREFILL, "p0", rpc_error(Code.INVALID_ARGUMENT, "prompt: bad id"))
    error = runner.settle(bad, prefill)
    assert isinstance(error, InvalidInputError) and error.field == "prompt"
    assert "prompt: bad id" in str(error)
    assert prefill.healthy

    late = Failure.of_rpc(Side.DECODE, "d0", rpc_error(Code.DEADLINE_EXCEEDED, "late"))
    error = runner.settle(late, decode)
    assert (type(error), str(error)) == (EngineDeadError, "request timed out after 600.0s")
