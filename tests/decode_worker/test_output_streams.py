"""A router's requests on a decode worker share one `Outputs` stream (issue #17): what one
engine step produced for all of them leaves in one message; aborts, a closed stream, errors
and deadlines end exactly the requests they concern, and every block comes back."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import Counter

import grpc
import pytest

from duet.cluster.decode_client import DecodeClient
from duet.cluster_auth import ClusterSecret
from duet.decode_worker import output_streams
from duet.decode_worker.config import DecodeWorkerConfig
from duet.decode_worker.server import DecodeServicer
from duet.decode_worker.worker import DecodeWorker
from duet.engine import LLM, SamplingParams
from duet.kv_transfer.local import LocalHub
from duet.v1 import worker_pb2, worker_pb2_grpc
from duet.wire.sampling import sampling_to_proto as wire
from tests.waiting import wait_for_async

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

SECRET = ClusterSecret("streams-" + "c" * 40)
ENGINE = dict(dtype="float32", load_progress=False, block_size=8, num_kv_blocks=128)


@pytest.fixture(scope="module")
def worker(tiny_llama):
    decode = DecodeWorker(
        DecodeWorkerConfig(model=tiny_llama, kv_backend="local", **ENGINE),
        receiver_options={"hub": LocalHub(), "name": "decode-0"},
    )
    decode.core.wait_ready()
    yield decode
    decode.shutdown()


def run(worker, scenario):
    """Run `scenario(client, servicer)` against the worker served over loopback (no auth
    interceptor: tests/cluster_auth covers it), on a fresh event loop."""

    async def main():
        server = grpc.aio.server()
        servicer = DecodeServicer(worker)
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = DecodeClient(f"127.0.0.1:{port}", SECRET)
        try:
            return await scenario(client, servicer)
        finally:
            await client.close()
            await server.stop(None)

    return asyncio.run(main())


async def drain(stream) -> list[int]:
    tokens: list[int] = []
    async for delta in stream.deltas():
        tokens.extend(delta.token_ids)
    return tokens


def blocks_free(worker) -> bool:
    return worker.load.num_free_blocks == worker.load.num_blocks


def test_one_message_per_step_for_all_requests(worker, tiny_llama, monkeypatch):
    steps: list[list[str]] = []  # per engine step: the requests it produced output for
    batches: list[list[str]] = []  # per message sent: the requests it carried
    real_step = worker.engine.step_outputs
    all_added = threading.Event()

    def step():
        all_added.wait(30)  # the first step waits for every request: they share the steps
        outputs = real_step()
        if outputs:
            steps.append([o.request_id for o in outputs])
        return outputs

    monkeypatch.setattr(worker.engine, "step_outputs", step)
    real_batches = output_streams.OutputStream.batches

    async def recorded(self):
        async for batch in real_batches(self):
            if batch.items:
                batches.append([item.request_id for item in batch.items])
            yield batch

    monkeypatch.setattr(output_streams.OutputStream, "batches", recorded)
    prompts = [[5 + i, 17, 33, 90 + i, 7] for i in range(8)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    async def scenario(client, servicer):
        streams = [
            await client.generate(f"r{i}", p, wire(params), timeout_s=60)
            for i, p in enumerate(prompts)
        ]
        all_added.set()
        return await asyncio.gather(*(drain(s) for s in streams))

    tokens = run(worker, scenario)
    expected = LLM(tiny_llama, **ENGINE).generate(prompts, params)
    assert tokens == [o.outputs[0].token_ids for o in expected]
    # Every message is whole consecutive steps (in any order within a step): never a step
    # split over two messages.
    assert len(batches) <= len(steps)
    i = 0
    for batch in batches:
        want, got = Counter(batch), Counter[str]()
        while got != want:
            assert i < len(steps), (steps, batches)
            got += Counter(steps[i])
            i += 1
            assert all(got[r] <= want[r] for r in got), (steps, batches)
    assert i == len(steps)
    flat_steps = [rid for s in steps for rid in s]
    assert len(flat_steps) >= 8 * 12  # 12 tokens each, one per step once decoding
    assert len(steps) <= 14  # the requests shared their steps: far fewer than the 96+ deltas


def test_cancel_aborts_on_the_worker_and_frees_its_blocks(worker):
    params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)

    async def scenario(client, servicer):
        long = await client.generate("long", [3, 4, 5], wire(params), timeout_s=60)
        short = await client.generate("short", [6, 7], wire(SamplingParams(max_tokens=3)), 60)
        got = 0
        async for delta in long.deltas():
            got += len(delta.token_ids)
            if got >= 3:
                break
        long.cancel()
        assert len(await drain(short)) == 3  # the other request is untouched
        await wait_for_async(lambda: blocks_free(worker), 10, "the aborted request's blocks")
        stream = next(iter(servicer.streams._streams.values()))
        assert stream._pumps == {}

    run(worker, scenario)


def test_a_closed_client_stream_aborts_its_requests(worker):
    params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)

    async def scenario(client, servicer):
        streams = [
            await client.generate(f"c{i}", [3, 4, 5 + i], wire(params), 60) for i in range(3)
        ]
        for s in streams:  # each is running
            await anext(aiter(s.deltas()))
        await client.close()
        await wait_for_async(lambda: not servicer.streams._streams, 10, "the stream closed")
        await wait_for_async(lambda: blocks_free(worker), 10, "all blocks back")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await drain(streams[0])
        assert e.value.code() == grpc.StatusCode.CANCELLED

    run(worker, scenario)


def test_errors_and_deadlines_end_only_their_request(worker, monkeypatch):
    too_long = list(range(3, 3 + 2000))  # past the model's context
    runner = worker.core.engine.runner
    execute = runner.execute

    def slowly(*args, **kwargs):
        # 5 ms a step: the 1,000-token request outlives its 0.3 s deadline however fast the
        # machine (the tiny model steps in about 0.1 ms: a fresh clone's run once finished
        # all 1,000 tokens inside the deadline)
        time.sleep(0.005)
        return execute(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", slowly)

    async def scenario(client, servicer):
        bad = await client.generate("bad", too_long, wire(SamplingParams(max_tokens=2)), 60)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await drain(bad)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "prompt" in e.value.details()
        slow = await client.generate(
            "slow", [3, 4], wire(SamplingParams(max_tokens=1000, ignore_eos=True)), timeout_s=0.3
        )
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await drain(slow)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await wait_for_async(lambda: blocks_free(worker), 10, "the late request's blocks")
        # the shared stream is still good for the next request
        ok = await client.generate("ok", [3, 4], wire(SamplingParams(max_tokens=2)), 60)
        assert len(await drain(ok)) == 2
        # a request naming no open stream is refused
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.stub.Generate(
                worker_pb2.LocalGenerateRequest(
                    request_id="x",
                    prompt_token_ids=[1],
                    sampling=worker_pb2.SamplingParams(),
                    stream_id="nope",
                ),
                metadata=client.signer.metadata("/duet.v1.DecodeWorker/Generate"),
                timeout=5,
            )
        assert e.value.code() == grpc.StatusCode.NOT_FOUND

    run(worker, scenario)


def test_a_bad_sampling_field_is_refused_naming_it(worker):
    bad = wire(SamplingParams(max_tokens=2))
    bad.top_p = 1.5

    async def scenario(client, servicer):
        await client._register("warm", 5)  # opens the shared stream
        stream_id = client._shared.stream_id
        errors = []
        for method, request in (
            ("DecodeRemote", worker_pb2.DecodeRemoteRequest(
                request_id="bad", prompt_token_ids=[3, 4], sampling=bad, stream_id=stream_id)),
            ("Generate", worker_pb2.LocalGenerateRequest(
                request_id="bad", prompt_token_ids=[3, 4], sampling=bad, stream_id=stream_id)),
        ):  # fmt: skip
            metadata = client.signer.metadata(f"/duet.v1.DecodeWorker/{method}")
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await getattr(client.stub, method)(request, metadata=metadata, timeout=5)
            errors.append((e.value.code(), e.value.details()))
        return errors

    for code, details in run(worker, scenario):
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert details.startswith("top_p: must be in (0, 1]")
