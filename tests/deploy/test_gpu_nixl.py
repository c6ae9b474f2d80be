"""On a machine with a CUDA GPU: the one-GPU disaggregated cluster on a local Ray instance (a
prefill and a decode worker sharing the GPU, KV over nixl: UCX's CUDA IPC between the two
processes) gives the aggregated engine's tokens. Skipped without CUDA; `make gpu-check` leaves
it out where Ray is not installed (its one-GPU disaggregated step runs the workers as plain
processes instead)."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from duet.engine import LLM, SamplingParams
from tests.deploy.ray_harness import cluster_spec, running_cluster

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.slow
def test_one_gpu_disaggregated_over_nixl_equals_aggregated(tiny_llama, tmp_path):
    engine = dict(dtype="bfloat16", block_size=16, num_kv_blocks=512, max_num_seqs=16)
    g = torch.Generator().manual_seed(23)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (9, 33, 70, 128, 260)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    want = LLM(tiny_llama, device="cuda", load_progress=False, **engine).generate(prompts, params)
    torch.cuda.empty_cache()
    spec = cluster_spec(
        tiny_llama, tmp_path, {**engine, "device": "cuda"}, prefill_workers=1, decode_workers=1,
        gpus_per_worker=0.5, kv_backend="nixl",
    )  # fmt: skip
    with running_cluster(spec) as (_, url):
        import openai

        api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)

        def complete(p: list[int]) -> str:
            r = api.completions.create(
                model="tiny", prompt=p, max_tokens=16, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            return r.choices[0].text

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(complete, prompts))
    assert got == [w.text for w in want]
