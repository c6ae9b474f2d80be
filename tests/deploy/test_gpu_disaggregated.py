"""On a machine with two or more NVIDIA GPUs: the disaggregated cluster with KV over NCCL
(`kv_backend="torch_dist"`, one GPU for the prefill worker and one for the decode worker, on a
local Ray instance) gives the aggregated engine's text for 16 mixed-length prompts, greedy, in
bf16. With one GPU it is skipped with the reason (NCCL refuses two ranks of one
communicator on one device); `make gpu-check` reports that reason."""

from __future__ import annotations

import concurrent.futures
import threading

import openai
import pytest
import ray
import torch

from engine import LLM, SamplingParams
from tests.net import free_port

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
    from deploy.local_ray import start_local_ray
    from deploy.ray_cluster import ClusterSpec, DuetCluster
    from router.cluster_engine import ClusterConfig
    from router.server import RouterConfig

    g = torch.Generator().manual_seed(17)
    lengths = [9, 16, 33, 70, 128, 200, 301, 450, 12, 64, 95, 180, 260, 20, 40, 500]
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    want = LLM(tiny_llama, device="cuda", load_progress=False, **ENGINE).generate(prompts, params)
    torch.cuda.empty_cache()

    spec = ClusterSpec(
        model=tiny_llama, served_model_name="tiny", engine=ENGINE, prefill_workers=1,
        decode_workers=1, gpus_per_worker=1, kv_backend="torch_dist",
        router=RouterConfig(port=free_port(), grpc_port=free_port(),
                            session_store_url=f"sqlite:///{tmp_path / 's.db'}"),
        cluster=ClusterConfig(local_prefill_threshold=8, poll_interval_s=0.2,
                              num_decode_workers=1, max_num_seqs_per_decode_worker=16),
    )  # fmt: skip
    start_local_ray(spec)
    duet = DuetCluster(spec)
    stop = threading.Event()
    try:
        duet.start(timeout_s=600)
        threading.Thread(target=duet.run, args=(stop, 0.5), daemon=True).start()
        api = openai.OpenAI(
            base_url=f"http://127.0.0.1:{spec.router.port}/v1", api_key="unused", max_retries=0,
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
    finally:
        stop.set()
        duet.shutdown()
        ray.shutdown()
    assert got == [o.text for o in want]
