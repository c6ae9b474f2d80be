"""`DecodeClient.reserve` against a decode worker that grants a reservation after the router
gave up: the client aborts it there instead of leaving its blocks held until `kv_wait_s`. And
`DecodeClient.num_streams`, the requests it knows to be running on the worker, as their
outputs arrive."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from duet.cluster.decode_client import DecodeClient
from duet.cluster_auth import ClusterSecret
from duet.engine import SamplingParams
from duet.v1 import worker_pb2, worker_pb2_grpc
from duet.wire.sampling import sampling_to_proto
from tests.waiting import wait_for_async

SECRET = ClusterSecret("reserve-" + "d" * 40)
WAIT_S = 10.0


class SlowGrantServicer(worker_pb2_grpc.DecodeWorkerServicer):
    """Grants every reservation at once (holds it until aborted) and answers `DecodeRemote`
    only when `answer` is set, or refuses it with `refuse`."""

    def __init__(self, refuse: grpc.StatusCode | None = None) -> None:
        self.refuse = refuse
        self.held: set[str] = set()
        self.aborts: list[tuple[str, str]] = []
        self.answer = asyncio.Event()

    async def Outputs(self, request, context):
        yield worker_pb2.OutputBatch()
        await asyncio.Event().wait()  # open until the client goes

    async def DecodeRemote(self, request, context):
        if self.refuse is not None:
            await context.abort(self.refuse, "no room")
        self.held.add(request.request_id)
        await self.answer.wait()
        return worker_pb2.Reserved(kv_address="kv")

    async def Abort(self, request, context):
        self.aborts.append((request.request_id, request.stream_id))
        self.held.discard(request.request_id)
        return worker_pb2.Aborted()


def run(servicer, scenario):
    async def main():
        server = grpc.aio.server()
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = DecodeClient(f"127.0.0.1:{port}", SECRET)
        try:
            return await scenario(client)
        finally:
            await client.close()
            await server.stop(None)

    return asyncio.run(main())


def _reserve(client: DecodeClient, timeout_s: float = 60.0):
    params = sampling_to_proto(SamplingParams(max_tokens=2))
    return client.reserve("r1@1", [1, 2, 3], params, 30.0, timeout_s)


@pytest.mark.parametrize("how", ["cancelled", "deadline"])
def test_a_reservation_the_router_gave_up_on_is_aborted(how):
    servicer = SlowGrantServicer()

    async def scenario(client):
        if how == "cancelled":
            call = asyncio.create_task(_reserve(client))
            await wait_for_async(lambda: servicer.held, WAIT_S, "the reservation granted")
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
        else:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await _reserve(client, timeout_s=0.5)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await wait_for_async(lambda: servicer.aborts, WAIT_S, "the abort")
        return client._shared.stream_id

    stream_id = run(servicer, scenario)
    assert servicer.aborts == [("r1@1", stream_id)]
    assert servicer.held == set()


def test_a_refused_reservation_is_not_aborted():
    servicer = SlowGrantServicer(refuse=grpc.StatusCode.RESOURCE_EXHAUSTED)

    async def scenario(client):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await _reserve(client)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        servicer.answer.set()
        servicer.refuse = None  # the next one is granted and answered: the channel is idle
        stream = await _reserve(client)
        stream.cancel()
        await wait_for_async(lambda: servicer.aborts, WAIT_S, "the second one's abort")

    run(servicer, scenario)
    assert servicer.aborts == [("r1@1", servicer.aborts[0][1])]  # the granted one only


class ScriptedServicer(worker_pb2_grpc.DecodeWorkerServicer):
    """Accepts `Generate` calls (refusing request ids in `refuse`); its one `Outputs` stream
    sends the batches put on `batches`, and ends at None."""

    def __init__(self, refuse: set[str]) -> None:
        self.refuse = refuse
        self.batches: asyncio.Queue[worker_pb2.OutputBatch | None] = asyncio.Queue()

    async def Outputs(self, request, context):
        yield worker_pb2.OutputBatch()
        while (batch := await self.batches.get()) is not None:
            yield batch

    async def Generate(self, request, context):
        if request.request_id in self.refuse:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no room")
        return worker_pb2.Started()


def _item(request_id: str, finish: str = "", error: bool = False) -> worker_pb2.RequestOutputItem:
    if error:
        return worker_pb2.RequestOutputItem(
            request_id=request_id, error=worker_pb2.RequestError(code=13, details="failed")
        )
    delta = worker_pb2.OutputDelta(token_ids=[7], finish_reason=finish)
    return worker_pb2.RequestOutputItem(request_id=request_id, output=delta)


def test_num_streams_counts_requests_until_their_last_output_arrives():
    servicer = ScriptedServicer(refuse={"refused"})
    params = sampling_to_proto(SamplingParams(max_tokens=4))

    async def scenario(client):
        async def streams(n: int, what: str) -> None:
            await wait_for_async(lambda: client.num_streams == n, WAIT_S, what)

        assert client.num_streams == 0
        for rid in ("a", "b", "c"):
            await client.generate(rid, [1, 2], params, 30.0)
        with pytest.raises(grpc.aio.AioRpcError):
            await client.generate("refused", [1, 2], params, 30.0)
        assert client.num_streams == 3  # a refused start is not counted
        # outputs without a finish reason leave it; the last output or an error ends one,
        # before anyone reads its queue
        await servicer.batches.put(worker_pb2.OutputBatch(items=[_item("a"), _item("b")]))
        await servicer.batches.put(worker_pb2.OutputBatch(items=[_item("a", "length")]))
        await streams(2, "a's last output")
        await servicer.batches.put(worker_pb2.OutputBatch(items=[_item("b", error=True)]))
        await streams(1, "b's error")
        await servicer.batches.put(None)  # the stream ends: c is over as far as we know
        await streams(0, "the stream's end")

    run(servicer, scenario)
