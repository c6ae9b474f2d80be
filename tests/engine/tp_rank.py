"""One rank of a tensor-parallel engine, run as a script by test_tensor_parallel.py:
python tp_rank.py MODEL RANK WORLD PORT PROMPTS_JSON OUT_JSON KV_CACHE_MEMORY_BYTES [BACKEND DEVICE
[ENGINE_JSON]] (BACKEND gloo and DEVICE cpu by default; nccl and cuda on a machine with two GPUs;
ENGINE_JSON: more EngineConfig fields, e.g. '{"quantization": "int4"}' or '{"dtype": "bfloat16"}'
(float32 by default); '{"pipeline_parallel_size": 2}': WORLD ranks as 2 stages of WORLD / 2);
DUET_TEST_EAGER_GRAPHS=1 in the environment captures decode graphs (and piecewise ones, with
'{"cuda_graph_mode": "piecewise"}') through test_cuda_graphs.py's CPU stand-in. PROMPTS_JSON: a list of prompts, generated as one batch; or
{"batches": [[prompt, ...], ...]}, generated one batch after another, each batch's results in
the output's "batches"."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from duet.engine import LLM, SamplingParams
from duet.engine.tp_group import exit_rank, init_tensor_parallel


def main() -> None:
    model, rank, world, port, prompts_file, out_file, kv_bytes = sys.argv[1:8]
    backend, device = (sys.argv[8], sys.argv[9]) if len(sys.argv) > 9 else ("gloo", "cpu")
    engine = json.loads(sys.argv[10]) if len(sys.argv) > 10 else {}
    rank, world = int(rank), int(world)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    stages = int(engine.get("pipeline_parallel_size", 1))
    # world = stages x TP size; the groups as a serving process makes them (gloo and the
    # shared-memory collectives on the CPU, NCCL on CUDA)
    assert backend == ("nccl" if device.startswith("cuda") else "gloo"), (backend, device)
    tp, _ = init_tensor_parallel(
        rank, world // stages, torch.device(device), init_method=f"tcp://127.0.0.1:{port}",
        timeout_s=60, num_stages=stages,
    )  # fmt: skip
    if os.environ.get("DUET_TEST_EAGER_GRAPHS"):  # test_cuda_graphs.py: graphs as on CUDA
        from tests.engine.graph_standin import fake_cuda_graphs

        fake_cuda_graphs(setattr)
    with open(prompts_file) as f:
        prompts = json.load(f)
    llm = LLM(
        model, tp=tp, tensor_parallel_size=world // stages, load_progress=False,
        kv_cache_memory_bytes=int(kv_bytes), device=device, **{"dtype": "float32", **engine},
    )  # fmt: skip
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=3)
    batches = prompts["batches"] if isinstance(prompts, dict) else [prompts]
    results = []
    for batch in batches:
        outs = llm.generate(batch, params)
        results.append({
            "tokens": [o.token_ids for o in outs],
            "logprobs": [[lp.sampled.logprob for lp in o.logprobs] for o in outs],
        })  # fmt: skip
    graphs = llm.engine.runner.decode_graphs
    pieces = llm.engine.runner.piecewise_graphs
    result = {
        "piece_replays": pieces.num_replays if pieces is not None else None,
        **results[0],
        "graph_buckets": graphs.buckets if graphs is not None else None,
        "graph_replays": graphs.num_replays if graphs is not None else None,
        "batches": results,
        "kv_heads": llm.engine.runner.kv_caches[0].shape[3],
        "num_blocks": llm.engine.num_blocks,
        "block_bytes": sum(c[:, :1].nbytes for c in llm.engine.runner.kv_caches),
    }
    with open(out_file, "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_rank(0)  # as a TP follower ends (engine/tp_group.py says why: not sys.exit)
