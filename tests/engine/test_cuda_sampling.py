"""Sampling with temperature > 0 and seeds on CUDA: a seeded request draws the same tokens alone
or in a batch, on every run, and the same as on the CPU (the draw is a counter-based uniform
per row, engine.random, so it does not depend on the device's generator)."""

from __future__ import annotations

import pytest
import torch

from duet.engine import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ENGINE = dict(dtype="float32", num_kv_blocks=256, load_progress=False)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in (4, 31, 90, 150)]


def seeded(seed: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=16, temperature=0.8, top_p=0.9, top_k=40, seed=seed, ignore_eos=True,
        presence_penalty=0.3,
    )  # fmt: skip


def test_seeded_sampling_on_cuda_is_reproducible_and_batch_independent(tiny_llama):
    llm = LLM(tiny_llama, device="cuda", **ENGINE)
    assert llm.engine.runner.device.type == "cuda"
    batch = [o.token_ids for o in llm.generate(prompts(), [seeded(7 + i) for i in range(4)])]
    again = [o.token_ids for o in llm.generate(prompts(), [seeded(7 + i) for i in range(4)])]
    alone = [llm.generate([p], seeded(7 + i))[0].token_ids for i, p in enumerate(prompts())]
    assert batch == again == alone
    assert all(len(t) == 16 and all(0 <= x < 512 for x in t) for t in batch)
    other_seed = llm.generate(prompts()[:1], seeded(1000))[0].token_ids
    assert other_seed != batch[0]  # 16 draws at temperature 0.8: a collision would be a bug


def test_seeded_sampling_on_cuda_matches_cpu(tiny_llama):
    params = [seeded(11 + i) for i in range(4)]
    tokens = {}
    for device in ("cpu", "cuda"):
        llm = LLM(tiny_llama, device=device, attention_backend="torch", **ENGINE)
        tokens[device] = [o.token_ids for o in llm.generate(prompts(), params)]
    assert tokens["cuda"] == tokens["cpu"]


def test_logit_bias_on_cuda_forces_tokens_and_matches_cpu(tiny_llama):
    """The bias is added on the logits' device (the slot's tensors made on join): a forced
    token on CUDA, and seeded biased draws the same as on the CPU."""
    forced = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias={17: 100.0})
    biased = [
        SamplingParams(max_tokens=12, temperature=1.0, seed=3 + i, ignore_eos=True,
                       logit_bias={t: 5.0 for t in range(100, 140)})
        for i in range(4)
    ]  # fmt: skip
    tokens = {}
    for device in ("cpu", "cuda"):
        llm = LLM(tiny_llama, device=device, attention_backend="torch", **ENGINE)
        assert llm.generate(prompts()[:1], forced)[0].token_ids == [17] * 6
        tokens[device] = [o.token_ids for o in llm.generate(prompts(), biased)]
    assert tokens["cuda"] == tokens["cpu"]
