"""On a machine with two or more NVIDIA GPUs: the disaggregated cluster with KV over NCCL
(`kv_backend="torch_dist"`, one GPU for the prefill worker and one for the decode worker, on a
local Ray instance) gives the aggregated engine's text for 16 mixed-length prompts, greedy, in
bf16. With one GPU it is skipped with the reason (NCCL refuses two ranks of one
communicator on one device); `make gpu-check` reports that reason."""

from __future__ import annotations

import concurrent.futures

import openai
import pytest
import torch

from duet.engine import LLM, SamplingParams
from tests.deploy.ray_harness import cluster_spec, running_cluster

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(
        torch.cuda.device_count() < 2,
        reason=f"the disaggregated NCCL run needs two GPUs (found {torch.cuda.device_count()}): "
        "prefill and decode each take one, and NCCL refuses two ranks on one device",
    ),
]

ENGINE = dict(dtype="bfloat16", block_size=16, num_kv_blocks=1024, max_num_seqs=16)


def test_disaggregated_over_nccl_equals_aggregated(tiny_llama, tmp_path):
    g = torch.Generator().manual_seed(17)
    lengths = [9, 16, 33, 70, 128, 200, 301, 450, 12, 64, 95, 180, 260, 20, 40, 500]
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    want = LLM(tiny_llama, device="cuda", load_progress=False, **ENGINE).generate(prompts, params)
    torch.cuda.empty_cache()

    spec = cluster_spec(
        tiny_llama, tmp_path, ENGINE, prefill_workers=1, decode_workers=1, gpus_per_worker=1,
        kv_backend="torch_dist",
    )  # fmt: skip
    with running_cluster(spec) as (_, url):
        api = openai.OpenAI(
            base_url=f"{url}/v1", api_key="unused", max_retries=0,
            timeout=300,
        )  # fmt: skip

        def complete(prompt: list[int]) -> str:
            reply = api.completions.create(
                model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            return reply.choices[0].text

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            got = list(pool.map(complete, prompts))
    assert got == [o.text for o in want]
