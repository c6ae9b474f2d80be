"""The workers' gRPC services behind `AuthInterceptor`, on real servers over loopback: every
worker RPC without credentials, with another cluster's secret, with expired or replayed
credentials ends UNAUTHENTICATED before the servicer runs; the router's clients get through;
health checks stay open; a refused peer is logged once, without the secret."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from duet.cluster.decode_client import DecodeClient
from duet.cluster.prefill_client import PrefillClient
from duet.cluster_auth import ClusterSecret
from duet.cluster_auth.grpc_auth import CallSigner
from duet.decode_worker.server import start_decode_server
from duet.engine import SamplingParams
from duet.prefill_worker.server import start_prefill_server
from duet.v1 import worker_pb2, worker_pb2_grpc
from duet.wire.sampling import sampling_to_proto
from tests.cluster_auth.fake_worker import FakeWorker
from tests.waiting import wait_for_async

SECRET = ClusterSecret("right-" + "a" * 40)
OTHER = ClusterSecret("wrong-" + "b" * 40)
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


def rpcs(stub_decode, stub_prefill):
    """Every worker RPC, as (name, call(metadata) -> awaitable)."""
    params = sampling_to_proto(SamplingParams(max_tokens=1))

    async def outputs(md):
        call = stub_decode.Outputs(worker_pb2.OutputsRequest(stream_id="s"), metadata=md, timeout=5)
        return await call.read()  # the opening batch

    return {
        "DecodeWorker/Outputs": outputs,
        "DecodeWorker/Generate": lambda md: stub_decode.Generate(
            worker_pb2.LocalGenerateRequest(
                request_id="r", prompt_token_ids=[1], sampling=params, stream_id="s"
            ),
            metadata=md,
            timeout=5,
        ),
        "DecodeWorker/DecodeRemote": lambda md: stub_decode.DecodeRemote(
            worker_pb2.DecodeRemoteRequest(
                request_id="r", prompt_token_ids=[1], sampling=params, stream_id="s"
            ),
            metadata=md,
            timeout=5,
        ),
        "DecodeWorker/Abort": lambda md: stub_decode.Abort(
            worker_pb2.AbortDecodeRequest(request_id="r", stream_id="s"), metadata=md, timeout=5
        ),
        "DecodeWorker/GetLoad": lambda md: stub_decode.GetLoad(
            worker_pb2.LoadRequest(), metadata=md, timeout=5
        ),
        "PrefillWorker/Prefill": lambda md: stub_prefill.Prefill(
            worker_pb2.PrefillRequest(request_id="r", prompt_token_ids=[1], sampling=params),
            metadata=md,
            timeout=5,
        ),
        "PrefillWorker/GetLoad": lambda md: stub_prefill.GetLoad(
            worker_pb2.LoadRequest(), metadata=md, timeout=5
        ),
    }


SERVICE = worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"]


def stub_outputs(channel, signer):
    """An open `Outputs` stream with id "s"."""
    return worker_pb2_grpc.DecodeWorkerStub(channel).Outputs(
        worker_pb2.OutputsRequest(stream_id="s"),
        metadata=signer.metadata("/duet.v1.DecodeWorker/Outputs"),
        timeout=10,
    )


async def status_of(awaitable) -> grpc.StatusCode:
    try:
        await awaitable
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_worker_rpcs_need_credentials(caplog):
    async def scenario():
        worker = FakeWorker()
        decode, decode_port = await start_decode_server(worker, secret=SECRET)
        prefill, prefill_port = await start_prefill_server(worker, secret=SECRET)  # type: ignore[arg-type]
        try:
            async with (
                grpc.aio.insecure_channel(f"127.0.0.1:{decode_port}") as dch,
                grpc.aio.insecure_channel(f"127.0.0.1:{prefill_port}") as pch,
            ):
                calls = rpcs(
                    worker_pb2_grpc.DecodeWorkerStub(dch), worker_pb2_grpc.PrefillWorkerStub(pch)
                )
                wrong = CallSigner(OTHER)
                old = CallSigner(SECRET, clock=lambda: time.time() - 120)
                future = CallSigner(SECRET, clock=lambda: time.time() + 120)
                right = CallSigner(SECRET)
                for name, call in calls.items():
                    method = f"/duet.v1.{name}"
                    assert await status_of(call(None)) == UNAUTHENTICATED, name
                    assert await status_of(call((("x-duet-auth", "v1.1.2.3"),))) == UNAUTHENTICATED
                    assert await status_of(call(wrong.metadata(method))) == UNAUTHENTICATED, name
                    assert await status_of(call(old.metadata(method))) == UNAUTHENTICATED, name
                    assert await status_of(call(future.metadata(method))) == UNAUTHENTICATED
                    # signed for another method: refused (the HMAC covers the method)
                    signed_elsewhere = right.metadata("/duet.v1.Duet/Chat")
                    assert await status_of(call(signed_elsewhere)) == UNAUTHENTICATED, name
                assert worker.calls == 0  # nothing reached the servicer
                assert {m.name for m in SERVICE.methods} == {
                    n.split("/")[1] for n in calls if n.startswith("DecodeWorker/")
                }  # every decode RPC was tried
                # the right secret: served; the very same credentials again: a replay
                opened = stub_outputs(dch, right)
                assert list((await opened.read()).items) == []
                md = right.metadata("/duet.v1.DecodeWorker/Generate")
                assert await status_of(calls["DecodeWorker/Generate"](md)) == grpc.StatusCode.OK
                await wait_for_async(lambda: worker.calls == 1, 5, "the call served")
                assert await status_of(calls["DecodeWorker/Generate"](md)) == UNAUTHENTICATED
                assert worker.calls == 1
                opened.cancel()
                md = right.metadata("/duet.v1.PrefillWorker/GetLoad")
                load = await calls["PrefillWorker/GetLoad"](md)
                assert load.num_free_blocks == 7
                assert await status_of(calls["PrefillWorker/GetLoad"](md)) == UNAUTHENTICATED
                # health stays open, without credentials
                for ch in (dch, pch):
                    reply = await health_pb2_grpc.HealthStub(ch).Check(
                        health_pb2.HealthCheckRequest(service=""), timeout=5
                    )
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING
            # the router's clients carry credentials
            dclient = DecodeClient(f"127.0.0.1:{decode_port}", SECRET)
            pclient = PrefillClient(f"127.0.0.1:{prefill_port}", SECRET)
            try:
                assert (await dclient.load()).num_blocks == 9
                assert (await pclient.load()).num_blocks == 9
                bad = DecodeClient(f"127.0.0.1:{decode_port}", OTHER)
                assert await status_of(bad.load()) == UNAUTHENTICATED
                await bad.close()
            finally:
                await dclient.close()
                await pclient.close()
        finally:
            await decode.stop(None)
            await prefill.stop(None)

    with caplog.at_level(logging.WARNING, logger="cluster_auth"):
        asyncio.run(scenario())
    refusals = [r.getMessage() for r in caplog.records if "refused a peer" in r.getMessage()]
    # once per server for the one peer address (127.0.0.1), however many calls it made
    assert len(refusals) == 2, refusals
    assert all("127.0.0.1" in m for m in refusals)
    assert not any(s in caplog.text for s in ("a" * 40, "b" * 40))


def test_a_secret_is_never_printed_or_pickled():
    import pickle

    assert "a" * 40 not in repr(SECRET)
    with pytest.raises(TypeError, match="not sent between processes"):
        pickle.dumps(SECRET)
    with pytest.raises(ValueError, match="at least 32 characters"):
        ClusterSecret("short")
