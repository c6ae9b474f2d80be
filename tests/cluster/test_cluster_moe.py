"""Mixtures of experts served disaggregated (issue 44): a prefill worker ships the KV of an MoE
model to a decode worker, and every request's tokens and logprobs equal the aggregated
engine's. Mixtral's and Qwen2-MoE's KV is a dense model's (the experts change the feed-forward
only); DeepSeek's is multi-head latent attention's one compressed entry per token and layer,
over tcp and torch_dist."""

from __future__ import annotations

import asyncio

import pytest

from duet.engine import LLM, SamplingParams
from tests.cluster.test_cluster_engine import ENGINE, Cluster, _logprobs, prompts_of
from tests.engine.test_deepseek import DEEPSEEK_SHAPES
from tests.engine.test_moe import MOE_SHAPES


@pytest.mark.parametrize(
    ("arch", "dtype", "kv_backend"),
    [
        ("qwen2_moe", "bfloat16", "tcp"),
        ("mixtral", "float32", "tcp"),
        ("deepseek_v3", "bfloat16", "tcp"),
        ("deepseek_v2_grouped", "float32", "torch_dist"),
    ],
)
def test_moe_cluster_equals_aggregated(tiny_model_factory, arch, dtype, kv_backend):
    """16 greedy requests at once through a prefill and a decode worker (short prompts prefilled
    on the decode worker itself) equal each request run alone on the aggregated engine: tokens
    and top-3 logprobs bitwise (deterministic inference), in bf16 (Qwen2-MoE: routed, shared
    and dense layers; DeepSeek-V3: MLA's latent cache) and fp32 (Mixtral; DeepSeek-V2 with
    q LoRA and group-limited routing, over torch_dist)."""
    shapes = DEEPSEEK_SHAPES if arch.startswith("deepseek") else MOE_SHAPES
    model = tiny_model_factory(arch, **shapes)
    engine = {**ENGINE, "dtype": dtype}
    prompts = prompts_of([3, 5, 40, 77, 120, 9, 150, 64, 2, 33, 90, 17, 130, 8, 55, 101])
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)
    ref = LLM(model, **engine)
    want = [ref.generate([p], greedy)[0].outputs[0] for p in prompts]

    async def main():
        async with Cluster(model, kv_backend=kv_backend, engine=engine) as c:
            assert c.engine.deterministic
            got = await asyncio.gather(*(c.run(p, greedy) for p in prompts))
            return [o.outputs[0] for o in got], c.engine.cluster_stats

    got, stats = asyncio.run(main())
    assert (stats.num_prefill_workers, stats.num_decode_workers) == (1, 1)
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert _logprobs(g) == _logprobs(w)
