"""`duet serve --disaggregated --kv-backend nixl` on a local Ray instance (this process is the
driver), in bf16: one prefill worker and two decode workers, each a process of its own, whose
KV moves cache to cache between NIXL agents (UCX: CMA between processes on this host), read by
the decode side (pull, the default). Fourteen chats sent at once, greedy and seeded, give
exactly the aggregated engine's text and token counts; a decode actor killed mid-stream loses
no request (the router continues it elsewhere, and the KV of the continuation moves over nixl
too); afterwards no KV block is held anywhere."""

from __future__ import annotations

import concurrent.futures

import pytest

from duet.engine import LLM, SamplingParams
from tests.deploy.ray_harness import cluster_spec, running_cluster
from tests.deploy.test_ray_cluster import client, decode_load, read_killing_busiest_decode
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

ENGINE = dict(dtype="bfloat16", block_size=8, num_kv_blocks=256, max_num_seqs=16)
WORDS = "the quick brown fox jumps over a lazy dog while seven tired cats watch".split()


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    spec = cluster_spec(
        tiny_llama, tmp_path_factory.mktemp("sessions"), ENGINE,
        prefill_workers=1, decode_workers=2, kv_backend="nixl",
    )  # fmt: skip
    with running_cluster(spec) as running:
        yield running


@pytest.fixture(scope="module")
def aggregated(tiny_llama) -> LLM:
    return LLM(tiny_llama, load_progress=False, **ENGINE)


def chat(i: int) -> list[dict[str, str]]:
    """The i-th conversation: prompts of 10 to over 100 tokens (most above the local-prefill
    threshold of 8, so their KV travels)."""
    words = [WORDS[(i * 7 + k) % len(WORDS)] for k in range(3 + 9 * i)]
    return [{"role": "user", "content": " ".join(words)}]


def sampling(i: int, max_tokens: int) -> dict:
    """Greedy for even i, seeded sampling for odd i."""
    if i % 2 == 0:
        return dict(temperature=0, max_tokens=max_tokens)
    return dict(temperature=0.9, top_p=0.9, seed=500 + i, max_tokens=max_tokens)


def test_bf16_chats_over_nixl_equal_aggregated(cluster, aggregated):
    _, url = cluster
    want = [
        aggregated.chat(chat(i), SamplingParams(ignore_eos=True, **sampling(i, 16)))[0]
        for i in range(14)
    ]
    api = client(url)

    def ask(i: int) -> tuple[str, int]:
        r = api.chat.completions.create(
            model="tiny", messages=chat(i), extra_body={"ignore_eos": True}, **sampling(i, 16)
        )
        return r.choices[0].message.content, r.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(14) as pool:
        got = list(pool.map(ask, range(14)))
    assert got == [(w.text, len(w.token_ids)) for w in want]


@pytest.mark.parametrize("i", [0, 1], ids=["greedy", "seeded"])
def test_decode_actor_killed_mid_stream_loses_nothing(cluster, aggregated, i):
    duet, url = cluster
    messages = chat(8 + i)
    want = aggregated.chat(messages, SamplingParams(ignore_eos=True, **sampling(i, 120)))[0]
    stream = client(url).completions.create(
        model="tiny", prompt=aggregated.engine.encode_chat(messages), stream=True,
        extra_body={"ignore_eos": True}, **sampling(i, 120),
    )  # fmt: skip
    assert read_killing_busiest_decode(duet, url, stream) == want.text
    # Nothing is left reserved or held on any decode worker (the restarted one included).
    wait_for(
        lambda: all(
            (load := decode_load(duet, d)).num_free_blocks == load.num_blocks for d in duet.decodes
        ),
        30,
        "every decode worker's blocks free",
        interval_s=0.25,
    )
