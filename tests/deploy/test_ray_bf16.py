"""The disaggregated cluster on a local Ray instance in bf16, the production dtype: one
prefill worker, two decode workers that speculate (ngram) and a router actor, the KV moving
cache to cache over nixl (`duet serve --disaggregated --kv-backend nixl`: NIXL agents over UCX,
CMA between the processes on this host, read by the decode side). Greedy and seeded
completions and chats, sent all at once, give exactly the text (and token counts) of an
aggregated engine without speculation; a decode actor killed mid-stream leaves greedy and
seeded streams identical to an unfailed run (issue 19: the continuation is recomputed as a
prefill on another worker, its KV over nixl too, which must give the decode steps' bits; issue
21: verification rows must give a plain decode's bits), and afterwards no KV block is held
anywhere. The router's /metrics carries the decode workers' speculation counters. (One cluster
for all of it: each Ray instance costs tens of seconds of `make test`.)"""

from __future__ import annotations

import concurrent.futures

import httpx2 as httpx
import pytest

from duet.engine import LLM, SamplingParams
from tests.deploy.ray_harness import cluster_spec, running_cluster
from tests.deploy.test_ray_cluster import (
    client,
    decode_load,
    metric,
    prompts_of,
    read_killing_busiest_decode,
)
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

ENGINE = dict(dtype="bfloat16", block_size=8, num_kv_blocks=256, max_num_seqs=16)
WORDS = "the quick brown fox jumps over a lazy dog while seven tired cats watch".split()
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "disable_by_batch_size": 64}  # fmt: skip


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    spec = cluster_spec(
        tiny_llama, tmp_path_factory.mktemp("sessions"),
        {**ENGINE, "speculative_config": NGRAM}, prefill_workers=1, decode_workers=2,
        kv_backend="nixl",
    )  # fmt: skip
    with running_cluster(spec) as running:
        yield running


@pytest.fixture(scope="module")
def aggregated(tiny_llama) -> LLM:
    return LLM(tiny_llama, load_progress=False, **ENGINE)


def _params(i: int, max_tokens: int) -> dict:
    """Greedy for even i, seeded sampling for odd i."""
    if i % 2 == 0:
        return dict(temperature=0, max_tokens=max_tokens)
    return dict(temperature=0.9, top_p=0.9, seed=1000 + i, max_tokens=max_tokens)


def test_bf16_disaggregated_equals_aggregated(cluster, aggregated):
    _, url = cluster
    prompts = prompts_of([3, 6, 9, 17, 30, 44, 61, 75, 90, 104, 118, 127, 133, 140], 7)
    prompts += [[5, 6, 7, 8, 9] * 6, [42] * 20]  # answered with runs: guesses accepted
    want = [
        aggregated.generate([p], SamplingParams(ignore_eos=True, **_params(i, 16)))[0].text
        for i, p in enumerate(prompts)
    ]
    api = client(url)

    def complete(i: int) -> str:
        r = api.completions.create(
            model="tiny", prompt=prompts[i], extra_body={"ignore_eos": True}, **_params(i, 16)
        )
        assert r.usage.completion_tokens == 16
        return r.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(complete, range(len(prompts))))
    assert got == want

    # The decode workers speculated, and guesses were accepted: their load reports (every
    # poll interval) reach the router's /metrics.
    def accepted() -> float:
        if "duet:spec_decode_num_accepted_tokens_total" not in httpx.get(f"{url}/metrics").text:
            return 0.0
        return metric(url, "duet:spec_decode_num_accepted_tokens_total")

    wait_for(lambda: accepted() > 0, 30, "accepted guesses in /metrics", interval_s=0.25)
    assert metric(url, "duet:spec_decode_num_drafts_total") > 0


def chat(i: int) -> list[dict[str, str]]:
    """The i-th conversation: prompts of 10 to over 100 tokens (most above the local-prefill
    threshold of 8, so their KV travels)."""
    words = [WORDS[(i * 7 + k) % len(WORDS)] for k in range(3 + 9 * i)]
    return [{"role": "user", "content": " ".join(words)}]


def test_bf16_chats_equal_aggregated(cluster, aggregated):
    _, url = cluster
    want = [
        aggregated.chat(chat(i), SamplingParams(ignore_eos=True, **_params(i, 16)))[0]
        for i in range(14)
    ]
    api = client(url)

    def ask(i: int) -> tuple[str, int]:
        r = api.chat.completions.create(
            model="tiny", messages=chat(i), extra_body={"ignore_eos": True}, **_params(i, 16)
        )
        return r.choices[0].message.content, r.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(14) as pool:
        got = list(pool.map(ask, range(14)))
    assert got == [(w.text, len(w.token_ids)) for w in want]


@pytest.mark.parametrize("i", [0, 1], ids=["greedy", "seeded"])
def test_bf16_decode_actor_killed_mid_stream_completes_identically(cluster, aggregated, i):
    duet, url = cluster
    prompt = prompts_of([70], 31 + i)[0]
    want = aggregated.generate([prompt], SamplingParams(ignore_eos=True, **_params(i, 120)))[0]
    stream = client(url).completions.create(
        model="tiny", prompt=prompt, stream=True, extra_body={"ignore_eos": True},
        **_params(i, 120),
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
