"""The expert exchange (engine/model/moe_exchange.py): two ranks, each with its own tokens (as
under data-parallel attention) and half of the routed experts whole, route their tokens' rows
to the experts' owners by all-to-all (through shared memory, and over gloo) and get the
results back. Each token's output has the
same bits as the same layer holding every expert on one rank (fp32 and bf16), including a step
where a rank has no tokens of its own and only serves the other's rows."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from duet.engine.loader import load_model
from duet.engine.model.moe import SparseMoeBlock
from duet.engine.parallel import ExpertExchange, TensorParallel
from duet.engine.quant.config import QuantizationConfig
from tests.engine.moe_exchange_rank import CASES, DTYPES, tokens
from tests.net import free_port

SCRIPT = Path(__file__).with_name("moe_exchange_rank.py")
ROOT = Path(__file__).parents[2]


def run_ranks(model: str, tmp_path: Path, *extra: str) -> list[dict]:
    port = free_port()
    outs = [tmp_path / f"rank{r}.pt" for r in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), model, str(r), "2", str(port), str(outs[r]), *extra],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        for r in range(2)
    ]
    for p in procs:
        assert p.wait(timeout=180) == 0
    return [torch.load(o) for o in outs]


@pytest.mark.parametrize(
    ("arch", "quant", "kernels", "transport"),
    [
        ("qwen3_moe", None, True, "shared memory"),  # duet's grouped dense kernel
        ("qwen3_moe", None, True, "gloo"),  # DUET_SHM_COLLECTIVES=0: torch.distributed's
        ("qwen2_moe", None, True, "shared memory"),  # a gated shared expert
        ("deepseek_v3", None, True, "shared memory"),  # sigmoid routing, a shared expert, MLA
        ("qwen3_moe", "int4", True, "shared memory"),  # duet's grouped quantized kernel
        ("qwen3_moe", None, False, "gloo"),  # the torch path, one MLP per expert (no kernels)
        ("qwen3_moe", "fused", False, "gloo"),  # the fused Triton kernel, interpreted
    ],
)
def test_two_ranks_exchanging_experts_give_one_ranks_bits(
    tiny_model_factory, tmp_path, monkeypatch, arch, quant, kernels, transport
):
    from duet.engine.kernels.cpu import cpu_kernels_enabled

    if not kernels:  # in the ranks (inherited) and here
        monkeypatch.setenv("DUET_CPU_KERNELS", "0")
        cpu_kernels_enabled.cache_clear()
    if kernels and transport == "gloo":
        monkeypatch.setenv("DUET_SHM_COLLECTIVES", "0")
    try:
        model = tiny_model_factory(arch)
        ranks = run_ranks(model, tmp_path, *([quant] if quant else []))
        assert [r["transport"] for r in ranks] == [transport] * 2
        if quant == "fused":
            compare(model, ranks, None, fused=True)
        else:
            compare(model, ranks, QuantizationConfig(quant) if quant else None)
    finally:
        monkeypatch.undo()
        cpu_kernels_enabled.cache_clear()


def compare(
    model: str, ranks: list[dict], quant: QuantizationConfig | None, fused: bool = False
) -> None:
    """Each rank's outputs against one rank holding every expert (`fused`: on the fused
    Triton kernel too, interpreted, fp32 only: the interpreter's 16-bit conversions are not
    torch's, so bf16 is checked bitwise on a GPU, test_triton_moe.py)."""
    for dtype in (torch.float32,) if fused else DTYPES:
        net = load_model(
            model, dtype, torch.device("cpu"), progress=False, quantization=quant
        ).model
        sparse = [i for i, layer in enumerate(net.layers) if isinstance(layer.mlp, SparseMoeBlock)]
        assert sparse
        for i in sparse:
            block = net.layers[i].mlp
            if fused:
                assert block.fuse_experts()
            half = block.num_experts // 2
            for rank, got in enumerate(ranks):
                assert got[(str(dtype), i, "experts")] == (rank * half, half)
            want_counts = torch.zeros(block.num_experts, dtype=torch.int64)
            for rank, got in enumerate(ranks):  # each rank counts its own tokens' choices
                counts = torch.zeros(block.num_experts, dtype=torch.int64)
                block.expert_counts = counts
                for case in range(len(CASES)):
                    x = tokens(case, rank, net.config.hidden_size, dtype)
                    out = got[(str(dtype), i, case)]
                    assert out.shape == x.shape and out.dtype == dtype
                    assert torch.equal(out, block.forward(x)), (dtype, i, case, rank)
                assert torch.equal(got[(str(dtype), i, "counts")], counts)
                want_counts += counts
            assert int(want_counts.sum()) == sum(map(sum, CASES)) * block.top_k


def test_one_rank_exchanges_with_itself(tiny_model_factory):
    """At size 1 the exchange moves nothing and the layer is the plain one."""
    model = tiny_model_factory("qwen3_moe")
    tp = TensorParallel(exchange=ExpertExchange(0, 1))
    alone = load_model(model, torch.float32, torch.device("cpu"), progress=False, tp=tp).model
    plain = load_model(model, torch.float32, torch.device("cpu"), progress=False).model
    x = tokens(0, 0, plain.config.hidden_size, torch.float32)
    for a, b in zip(alone.layers, plain.layers, strict=True):
        if isinstance(a.mlp, SparseMoeBlock):
            assert torch.equal(a.mlp.forward(x), b.mlp.forward(x))
            assert torch.equal(a.mlp.forward(x[:0]), x[:0])
