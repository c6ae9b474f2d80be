"""A prefill group split into pipeline stages (processes on loopback gloo, global rank 0
serving gRPC): each stage's ranks ship the KV of their layers, as the pass computes them, to
one decode worker, which puts each stage's into its layers: the same greedy tokens as the
aggregated engine, and whole pools on both sides afterwards."""

from __future__ import annotations

import pytest

from duet.decode_worker.config import DecodeWorkerConfig
from duet.decode_worker.worker import DecodeWorker
from tests.prefill_worker.test_tensor_parallel_prefill import (
    ENGINE,
    check_against_aggregated,
    prefill_group_processes,
)


@pytest.mark.parametrize(
    ("backend", "tp_size"), [("torch_dist", 1), ("tcp", 1), ("nixl", 1), ("tcp", 2)]
)
def test_staged_prefill_group_to_a_decode_worker_equals_aggregated(
    tiny_model_factory, backend, tp_size
):
    """Two stages (of the tiny model's 2 layers: one each), of 1 or 2 TP ranks; the ranks are
    given different pool sizes and agree on the smallest, 256. The 2 x 2 group prefills in
    chunks of at most 64 tokens, so a prompt's earlier chunks' layers leave during its last
    pass, stage by stage."""
    model = tiny_model_factory("llama")
    config = {"model": model, **ENGINE, "kv_backend": backend,
              "tensor_parallel_size": tp_size, "pipeline_parallel_size": 2}  # fmt: skip
    if tp_size == 2:
        config["max_num_batched_tokens"] = 64
    sizes = [300, 256, 280, 300][: 2 * tp_size]
    with prefill_group_processes([{**config, "num_kv_blocks": n} for n in sizes]) as address:
        decode = DecodeWorker(DecodeWorkerConfig(model=model, kv_backend=backend, **ENGINE))
        try:
            check_against_aggregated(model, address, decode, 8)
        finally:
            decode.shutdown()
