"""A TP=2 prefill group (two processes on loopback gloo, rank 0 serving gRPC) ships the KV
heads of each rank to a TP=1 decode worker, which reassembles them: the same greedy tokens as
the aggregated engine, prefix-cache hits on the prefill side, and whole pools afterwards. The
ranks are given different pool sizes and agree on the smallest."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch

from duet.cluster.prefill_client import PrefillClient
from duet.decode_worker.config import DecodeWorkerConfig
from duet.decode_worker.worker import DecodeWorker
from duet.engine import LLM, SamplingParams
from duet.engine.block_pool import hash_request_blocks
from duet.kv_transfer import TransferStatus
from duet.wire.sampling import sampling_to_proto
from tests.net import free_port

ENGINE = dict(dtype="float32", load_progress=False, block_size=8, num_kv_blocks=256)


@contextlib.contextmanager
def tp2_prefill_group(model: str, backend: str):
    """Two ranks of one prefill group of `model` as processes; yields rank 0's gRPC address.
    The ranks are given 300 and 256 blocks: the group agrees on 256."""
    config = {"model": model, **ENGINE, "tensor_parallel_size": 2, "kv_backend": backend}
    configs = [{**config, "num_kv_blocks": n} for n in (300, 256)]  # rank 0's, rank 1's
    with prefill_group_processes(configs) as address:
        yield address


@contextlib.contextmanager
def prefill_group_processes(configs: list[dict]):
    """One prefill group's ranks as processes (`python -m duet.prefill_worker`), rank r with
    `configs[r]`; yields rank 0's gRPC address once it serves."""
    init = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "duet.prefill_worker",
                "--config",
                json.dumps(config),
                "--tp-rank",
                str(rank),
                "--tp-init-method",
                init,
                "--name",
                "p0",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank, config in enumerate(configs)
    ]
    try:
        address, output = None, []
        for line in procs[0].stdout:
            if line.startswith("DUET_READY "):
                address = line.split()[1]
                break
            output.append(line)
        assert address, "rank 0 exited before serving:\n" + "".join(output[-60:])
        yield address
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture(scope="module", params=["torch_dist", "tcp", "nixl"])
def prefill_group(request, tiny_model_factory):
    """Two ranks of one group; `tcp` lands each rank's head shard in a staging buffer the decode
    worker scatters, torch_dist every transfer; nixl reads each rank's heads straight into
    their slice of the reserved blocks (a descriptor per token)."""
    model = tiny_model_factory("llama")
    with tp2_prefill_group(model, request.param) as address:
        yield model, address, request.param


@pytest.fixture(scope="module")
def decode_worker(prefill_group):
    model, _, backend = prefill_group
    worker = DecodeWorker(DecodeWorkerConfig(model=model, kv_backend=backend, **ENGINE))
    yield worker
    worker.shutdown()


async def run_one(client, decode, request_id, prompt, params):
    remote = await decode.reserve(request_id, prompt, params)
    async with remote:
        outcome, outputs = await asyncio.gather(
            client.prefill(
                request_id, prompt, sampling_to_proto(params), remote.reservation.kv_address, 60
            ),
            collect(remote),
        )
    assert outcome.status == TransferStatus.DONE, outcome
    return outcome, outputs[-1]


async def collect(remote):
    return [o async for o in remote]


def test_tp2_prefill_to_tp1_decode_equals_aggregated(prefill_group, decode_worker):
    model, address, _ = prefill_group
    check_against_aggregated(model, address, decode_worker, 16)


@pytest.mark.parametrize("backend", ["torch_dist", "tcp"])
def test_tp2_mla_prefill_to_tp1_decode_equals_aggregated(tiny_model_factory, backend):
    """DeepSeek-V3 (multi-head latent attention): each prefill rank holds 2 of the 4 heads and
    caches the same latent entries; rank 0 alone ships them (`KVLayout.shipped_range`)."""
    from tests.engine.test_deepseek import DEEPSEEK_SHAPES

    model = tiny_model_factory("deepseek_v3", **DEEPSEEK_SHAPES)
    with tp2_prefill_group(model, backend) as address:
        decode = DecodeWorker(DecodeWorkerConfig(model=model, kv_backend=backend, **ENGINE))
        try:
            check_against_aggregated(model, address, decode, 8)
        finally:
            decode.shutdown()


def check_against_aggregated(
    model: str, address: str, decode_worker: DecodeWorker, num_prompts: int
) -> None:
    """`num_prompts` greedy requests through the group and `decode_worker` at once: the
    aggregated engine's tokens, and every block of both sides free afterwards."""
    g = torch.Generator().manual_seed(21)
    prompts = [torch.randint(3, 512, (int(n),), generator=g).tolist()
               for n in torch.randint(1, 150, (num_prompts,), generator=g)]  # fmt: skip
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    want = LLM(model, **ENGINE).generate(prompts, params)

    async def run():
        client = PrefillClient(address)
        try:
            results = await asyncio.gather(
                *(run_one(client, decode_worker, f"r{i}", p, params) for i, p in enumerate(prompts))
            )
            load = await client.load()
        finally:
            await client.close()
        return results, load

    results, load = asyncio.run(run())
    assert [out.token_ids for _, out in results] == [o.token_ids for o in want]
    assert load.num_free_blocks == load.num_blocks == 256  # every held block released
    assert decode_worker.engine.kv.num_free_blocks == 256


def test_tp2_prefix_cache_hits_and_reported_hashes(prefill_group, decode_worker):
    model, address, _ = prefill_group
    shared = torch.randint(3, 512, (64,), generator=torch.Generator().manual_seed(5)).tolist()
    prompts = [[*shared, 7, 8, 9], [*shared, 10, 11]]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    want = LLM(model, **ENGINE, enable_prefix_caching=False).generate(prompts, params)

    async def run():
        client = PrefillClient(address)
        try:
            first = await run_one(client, decode_worker, "a", prompts[0], params)
            second = await run_one(client, decode_worker, "b", prompts[1], params)
            return first, second, await client.load()
        finally:
            await client.close()

    (o1, out1), (o2, out2), load = asyncio.run(run())
    assert [out1.token_ids, out2.token_ids] == [o.token_ids for o in want]
    assert (o1.num_cached_tokens, o2.num_cached_tokens) == (0, 64)
    assert load.snapshot and load.block_size == 8
    assert set(hash_request_blocks(shared, 8, [])) <= set(load.stored_hashes)
