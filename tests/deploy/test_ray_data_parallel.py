"""`duet serve --disaggregated --decode-dp 2` on a local Ray instance: one decode group of two
whole decode workers (each its own actor, server, KV receiver and requests, half of a
Qwen3-MoE's routed experts, exchanging them as peers) and a prefill worker holding every
expert, driven through the official openai client: the aggregated engine's text in bf16, both
workers decoding, each published to the router as a worker of its own."""

from __future__ import annotations

import concurrent.futures

import openai
import pytest
import ray

from duet.engine import LLM, SamplingParams
from tests.deploy.ray_harness import cluster_spec, running_cluster

pytestmark = pytest.mark.slow

ENGINE = dict(dtype="bfloat16", block_size=8, num_kv_blocks=256, max_num_seqs=16)
PROMPTS = [[(11 * i + 5 * j) % 400 + 50 for j in range(12 + 4 * i)] for i in range(8)]


def test_a_data_parallel_decode_group_serves_the_aggregated_text(tiny_model_factory, tmp_path):
    model = tiny_model_factory("qwen3_moe")
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    want = [o.text for o in LLM(model, load_progress=False, **ENGINE).generate(PROMPTS, greedy)]
    spec = cluster_spec(model, tmp_path, ENGINE, prefill_workers=1, decode_workers=1, decode_dp=2)
    with running_cluster(spec) as (duet, url):
        (group,) = duet.decodes
        assert len(group.ranks) == 2 and len(group.endpoints) == 2
        # A data-parallel group may span nodes (PACK); a tensor-parallel one may not.
        strategies = {g.role: ray.util.placement_group_table(g.pg)["strategy"]
                      for g in (group, *duet.groups)}  # fmt: skip
        assert strategies == {"decode": "PACK", "prefill": "STRICT_PACK"}
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)

        def complete(prompt: list[int]) -> str:
            reply = api.completions.create(
                model="tiny", prompt=prompt, max_tokens=10, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            return str(reply.choices[0].text)

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            assert list(pool.map(complete, PROMPTS)) == want

        def decoded_on(router) -> list[str]:  # runs in the RouterActor
            return sorted({t.decode_worker for t in router.engine.transfers.recent})

        names = ray.get(duet.routers[0].actor.__ray_call__.remote(decoded_on), timeout=30)
        assert names == [f"{group.name}-dp0", f"{group.name}-dp1"]
