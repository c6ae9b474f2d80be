"""The disaggregated cluster on a local Ray instance (this process is the driver): two TP=2
prefill groups, two TP=2 decode workers (each rank an actor, placed as prefill groups are) and a
router actor, driven through the official openai client. Same text as the aggregated engine, prefix-aware routing, and the faults the design
promises to survive: a decode actor killed mid-stream, a prefill rank killed, everything
killed (503 at once, no hang)."""

from __future__ import annotations

import concurrent.futures
import os
import re
import time

import grpc
import httpx2 as httpx
import openai
import psutil
import pytest
import ray
import torch

from duet.cluster_auth import load_cluster_secret
from duet.cluster_auth.grpc_auth import CallSigner
from duet.engine import LLM, SamplingParams
from duet.kv_transfer.fanout import split_addresses
from duet.v1 import worker_pb2, worker_pb2_grpc
from tests.deploy.ray_harness import cluster_spec, running_cluster
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

ENGINE = dict(dtype="float32", block_size=8, num_kv_blocks=256, max_num_seqs=16)


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    spec = cluster_spec(
        tiny_llama, tmp_path_factory.mktemp("sessions"), ENGINE,
        prefill_workers=2, prefill_tp=2, decode_workers=2, decode_tp=2,
    )  # fmt: skip
    with running_cluster(spec) as running:
        yield running


@pytest.fixture(scope="module")
def aggregated(tiny_llama):
    """The aggregated engine whose text the cluster must give (one for the module)."""
    llm = LLM(tiny_llama, load_progress=False, **ENGINE)
    yield llm
    llm.shutdown()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def prompts_of(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


def test_disaggregated_equals_aggregated(cluster, aggregated):
    _, url = cluster
    prompts = prompts_of([2, 5, 9, 17, 30, 44, 61, 75, 90, 104, 118, 127, 133, 140, 150, 7], 13)
    want = aggregated.generate(
        prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    )
    api = client(url)

    def complete(prompt):
        return api.completions.create(
            model="tiny", prompt=prompt, max_tokens=12, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(complete, prompts))
    assert [r.choices[0].text for r in got] == [o.text for o in want]
    assert [r.usage.completion_tokens for r in got] == [12] * 16
    assert metric(url, "duet:num_prefill_workers") == 2
    assert metric(url, "duet:num_decode_workers") == 2


def test_prefix_routing_reuses_the_cache(cluster):
    duet, url = cluster
    shared = prompts_of([96], 21)[0]
    api = client(url)
    kwargs = dict(model="tiny", max_tokens=2, temperature=0)
    first = api.completions.create(prompt=[*shared, *range(3, 19)], **kwargs)
    second_prompt = [*shared, *range(30, 46)]

    def cached_tokens(router) -> int:  # runs in a RouterActor: what it would route on
        picked = router.engine.pool.pick_prefill(second_prompt)
        return 0 if picked is None else picked[1]

    def routers_know_the_prefix() -> bool:  # the holder's next load report carries its hashes
        known = [r.actor.__ray_call__.remote(cached_tokens) for r in duet.routers]
        return ray.get(known, timeout=30) == [96] * len(known)

    wait_for(routers_know_the_prefix, 30, "the routers to learn the cached prefix", 0.1)
    hits_before = metric(url, "duet:prefix_cache_hits_total")
    second = api.completions.create(prompt=second_prompt, **kwargs)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 96
    assert metric(url, "duet:prefix_cache_hits_total") - hits_before == 96


def actor_env(actor, name: str) -> str:
    """An environment variable of the actor's process. Ray can still call an actor restarted
    by an earlier kill "temporarily unavailable" after it rejoined the router's pool: the
    call is retried for up to 30 s then."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return ray.get(
                actor.__ray_call__.remote(lambda self: os.environ.get(name, "")), timeout=30
            )
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.25)


def decode_load(duet, d, signer: CallSigner | None = None) -> worker_pb2.DecodeLoad:
    """A decode worker's load report, with credentials of the cluster's secret (which the
    actor reads from the file its environment names)."""
    if signer is None:
        path = actor_env(d.actor, "DUET_CLUSTER_SECRET_FILE")
        signer = CallSigner(load_cluster_secret({"DUET_CLUSTER_SECRET_FILE": path}))
    # The cluster refreshes each address on every reconcile pass, from the actor's own report:
    # a pass that could not reach the actor (a restart, a busy machine) leaves None until the
    # next one. CI saw None here after the previous test had seen the address set.
    address = wait_for(lambda: d.address, 60, "the decode worker's address", interval_s=0.25)
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.DecodeWorkerStub(channel).GetLoad(
            worker_pb2.LoadRequest(),
            timeout=5,
            metadata=signer.metadata("/duet.v1.DecodeWorker/GetLoad"),
        )


def busiest_decode(duet) -> int:
    """Index of the decode worker running the most sequences right now."""
    loads = [decode_load(duet, d).num_running for d in duet.decodes]
    return max(range(len(loads)), key=loads.__getitem__)


def read_killing_busiest_decode(duet, url: str, stream) -> str:
    """The text of a streamed completion, read to its end; once more than 5 characters came,
    the decode actor running the most sequences is killed. Returns once Ray restarted it and
    it rejoined the router's pool."""
    pieces, killed = [], None
    for chunk in stream:
        pieces.append(chunk.choices[0].text if chunk.choices else "")
        if killed is None and len("".join(pieces)) > 5:
            killed = duet.decodes[busiest_decode(duet)]
            ray.kill(killed.actor, no_restart=False)
    assert killed is not None
    # Back in the router's pool, and in the cluster's own view (its reconcile loop sets the
    # restarted worker's address; the next test's `busiest_decode` dials it).
    wait_for(
        lambda: (
            metric(url, "duet:num_decode_workers") == 2 and all(d.address for d in duet.decodes)
        ),
        240,
        "the decode worker back",
        interval_s=0.25,
    )
    return "".join(pieces)


def listening(actor) -> dict[int, str]:
    """The actor process's listening TCP sockets: port -> bound address (gRPC binds an IPv6
    socket to an IPv4-mapped address: `::ffff:127.0.0.1` is loopback only, and shown as such)."""
    pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
    sockets = psutil.Process(pid).net_connections(kind="tcp")
    return {
        c.laddr.port: c.laddr.ip.removeprefix("::ffff:")
        for c in sockets
        if c.status == psutil.CONN_LISTEN
    }


def test_workers_listen_on_loopback_and_demand_credentials(cluster):
    duet, _ = cluster
    for d in duet.decodes:
        # each rank's KV receiver, in rank order; rank 0 serves gRPC
        kv_addresses = split_addresses(decode_load(duet, d).kv_address)
        assert len(kv_addresses) == len(d.ranks) == 2
        for rank, kv_address in zip(d.ranks, kv_addresses, strict=True):
            assert listening(rank)[int(kv_address.rsplit(":", 1)[1])] == "127.0.0.1"
        grpc_port = int(d.address.rsplit(":", 1)[1])
        assert listening(d.actor)[grpc_port] == "127.0.0.1"
        with grpc.insecure_channel(d.address) as channel, pytest.raises(grpc.RpcError) as info:
            worker_pb2_grpc.DecodeWorkerStub(channel).GetLoad(worker_pb2.LoadRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    for g in duet.groups:
        grpc_port = int(g.endpoint.rsplit(":", 1)[1])
        assert listening(g.ranks[0])[grpc_port] == "127.0.0.1"
    # one secret per local cluster, in a file only this user reads; the environment names it
    path = actor_env(duet.decodes[0].actor, "DUET_CLUSTER_SECRET_FILE")
    assert actor_env(duet.groups[0].ranks[0], "DUET_CLUSTER_SECRET_FILE") == path
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_decode_actor_killed_mid_stream_completes_identically(cluster, aggregated):
    duet, url = cluster
    prompt = prompts_of([70], 31)[0]
    want = aggregated.generate(
        [prompt], SamplingParams(max_tokens=150, temperature=0, ignore_eos=True)
    )[0]
    stream = client(url).completions.create(
        model="tiny", prompt=prompt, max_tokens=150, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert read_killing_busiest_decode(duet, url, stream) == want.text


def test_prefill_rank_killed_requests_retried_and_group_restarted(cluster):
    duet, url = cluster
    api = client(url)
    ray.kill(duet.groups[0].ranks[1], no_restart=False)
    prompts = prompts_of([40, 50, 60, 70], 41)
    for prompt in prompts:  # every one succeeds, on the other group (or after a retry)
        r = api.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0)
        assert r.usage.completion_tokens == 3
    wait_for(
        lambda: metric(url, "duet:num_prefill_workers") == 2,
        240,
        "the group back",
        interval_s=0.25,
    )


def test_everything_killed_gives_503_at_once(cluster):
    duet, url = cluster
    for actor in [d.actor for d in duet.decodes] + [a for g in duet.groups for a in g.ranks]:
        ray.kill(actor, no_restart=True)
    wait_for(
        lambda: metric(url, "duet:num_decode_workers") == 0,
        30,
        "the router to notice",
        interval_s=0.25,
    )
    start = time.monotonic()
    with pytest.raises(openai.InternalServerError) as info:
        client(url).completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3)
    assert info.value.status_code == 503
    assert time.monotonic() - start < 5
    assert httpx.get(f"{url}/ready", timeout=5).status_code == 503
