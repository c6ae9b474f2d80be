"""The fused MoE Triton kernel (engine/kernels/triton_moe.py), interpreted on the CPU: the slots'
layout by expert, the result against the torch path (`moe.grouped_experts`), and each token's
bits independent of the other tokens. fp32, and bf16 through the interpreter's emulation
(operands rounded to bf16, exact fp32 products: its own 16-bit `tl.dot` is wrong)."""

from __future__ import annotations

import platform
import sys

import pytest
import torch
from torch import nn

from tests.engine.triton_cases import DEVICE, ON_CUDA, triton_interpreter  # noqa: F401

if not (sys.platform == "linux" and platform.machine() == "x86_64"):
    pytest.skip("triton ships wheels for Linux x86_64 only", allow_module_level=True)

HIDDEN, INTER, EXPERTS, TOP_K, TOKENS = 80, 48, 8, 2, 40
"""Off the tile sizes (64-wide N tiles, 32-wide K steps) so the masks matter."""


def test_slots_are_grouped_by_expert_in_whole_blocks():
    from duet.engine.kernels.triton_moe import align_by_expert

    ids = torch.tensor([[0, 2], [2, 3], [0, 2]])  # slots 0..5; expert 1 gets none
    sorted_slots, block_expert = align_by_expert(ids, num_experts=4, block_m=2)
    pad = 6
    # expert 0: slots 0, 4; expert 2: 1, 2, 5 (+ a pad); expert 3: slot 3 (+ a pad)
    assert sorted_slots.tolist()[:8] == [0, 4, 1, 2, 5, pad, 3, pad]
    assert all(s == pad for s in sorted_slots.tolist()[8:])
    assert block_expert.tolist()[:4] == [0, 2, 2, 3]
    assert all(e == -1 for e in block_expert.tolist()[4:])
    assert sorted_slots.dtype == block_expert.dtype == torch.int32


def test_another_ranks_slots_go_to_blocks_no_program_computes():
    """Expert parallelism: this rank holds the model's experts 2 and 3 (local 0 and 1); the
    slots routed to experts 0 and 1 form a last run whose blocks say -1."""
    from duet.engine.kernels.triton_moe import align_by_expert

    ids = torch.tensor([[0, 2], [2, 3], [0, 2]])  # slots 0..5
    sorted_slots, block_expert = align_by_expert(ids, num_experts=2, block_m=2, first_expert=2)
    pad = 6
    # local 0 (expert 2): slots 1, 2, 5 (+ a pad); local 1 (expert 3): 3 (+ a pad);
    # the others' run (experts 0, 0): slots 0, 4
    assert sorted_slots.tolist()[:8] == [1, 2, 5, pad, 3, pad, 0, 4]
    assert block_expert.tolist()[:4] == [0, 0, 1, -1]
    assert all(e == -1 for e in block_expert.tolist()[3:])


def _operands(dtype: torch.dtype):
    g = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN, generator=g, device=DEVICE).to(dtype)
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g, device=DEVICE) / 9).to(dtype)
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=g, device=DEVICE) / 7).to(dtype)
    logits = torch.randn(TOKENS, EXPERTS, generator=g, device=DEVICE)
    return x, w13, w2, logits


class _Expert(nn.Module):
    """The torch path's expert (moe.py calls `forward` on an `MLP`-like module)."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        super().__init__()
        self.w13, self.w2 = w13, w2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = nn.functional.linear(x, self.w13).split(INTER, dim=-1)
        return nn.functional.linear(nn.functional.silu(gate) * up, self.w2)


@pytest.mark.parametrize(
    ("dtype", "in_model_dtype", "tol"),
    [(torch.float32, False, 1e-5), (torch.float32, True, 1e-5), (torch.bfloat16, True, 2e-2)],
)
def test_fused_experts_equal_the_torch_path_and_rows_do_not_depend_on_the_batch(
    dtype, in_model_dtype, tol
):
    from duet.engine.kernels.triton_moe import fused_experts
    from duet.engine.model.moe import grouped_experts, route

    x, w13, w2, logits = _operands(dtype)
    weights, ids = route(logits, TOP_K, renormalize=True)
    fused = fused_experts(x, w13, w2, weights, ids, in_model_dtype)
    experts = nn.ModuleList(_Expert(w13[e], w2[e]) for e in range(EXPERTS))
    ref = grouped_experts(x, experts, weights, ids, in_model_dtype)
    assert fused.dtype == dtype
    torch.testing.assert_close(fused.float(), ref.float(), atol=tol, rtol=tol)
    for rows in (slice(0, 1), slice(17, 18), slice(5, 29)):  # alone, and among others
        part = fused_experts(x[rows], w13, w2, weights[rows], ids[rows], in_model_dtype)
        assert torch.equal(part, fused[rows]), rows


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA: compiled bf16 (the interpreter emulates it)")
@pytest.mark.parametrize("in_model_dtype", [False, True], ids=["mixtral", "qwen"])
def test_fused_experts_compiled_in_bf16_on_gpu(in_model_dtype):
    test_fused_experts_equal_the_torch_path_and_rows_do_not_depend_on_the_batch(
        torch.bfloat16, in_model_dtype, 2e-2
    )


def test_a_block_on_the_fused_kernel_equals_it_per_expert():
    """`SparseMoeBlock.fuse_experts` (what the loader does on CUDA): the stacked weights on the
    fused kernel give the per-expert path's output (fp32), a row alone its bits in the batch;
    fused, the block reads nothing on the host (`experts_read_on_host`: CUDA graphs allowed)."""
    from duet.engine.model import ModelArchConfig
    from duet.engine.model.moe import SparseMoeBlock, experts_read_on_host
    from duet.engine.parallel import SINGLE
    from tests.conftest import ARCH_CONFIGS

    spec = {**ARCH_CONFIGS["qwen2_moe"], "vocab_size": 512, "hidden_size": HIDDEN,
            "intermediate_size": 128, "moe_intermediate_size": INTER, "num_attention_heads": 4}  # fmt: skip
    torch.manual_seed(0)
    block = SparseMoeBlock(ModelArchConfig.from_hf_config(spec), SINGLE, None)
    for p in block.parameters():
        nn.init.normal_(p, std=0.1)
    x = torch.randn(TOKENS, HIDDEN)
    with torch.no_grad():
        per_expert = block(x)
        assert experts_read_on_host(block)  # each expert's row count: no CUDA graph
        assert block.fuse_experts() and len(block.experts) == 0
        assert not experts_read_on_host(block)  # the fused kernel's: graphs may hold it
        assert block.w13 is not None and block.w13.shape == (8, 2 * INTER, HIDDEN)
        fused = block(x)
        torch.testing.assert_close(fused, per_expert, atol=1e-5, rtol=1e-5)
        assert torch.equal(block(x[9:10]), fused[9:10])


def _qwen3_moe_block() -> tuple:
    """(arch, a whole Qwen3-MoE sparse block of EXPERTS experts, seeded random weights)."""
    from duet.engine.model import ModelArchConfig
    from duet.engine.model.moe import SparseMoeBlock
    from duet.engine.parallel import SINGLE
    from tests.conftest import ARCH_CONFIGS

    spec = {**ARCH_CONFIGS["qwen3_moe"], "vocab_size": 512, "hidden_size": HIDDEN,
            "intermediate_size": 128, "moe_intermediate_size": INTER, "num_attention_heads": 4,
            "num_experts": EXPERTS, "num_hidden_layers": 2}  # fmt: skip
    arch = ModelArchConfig.from_hf_config(spec)
    torch.manual_seed(0)
    whole = SparseMoeBlock(arch, SINGLE, None)
    for p in whole.parameters():
        nn.init.normal_(p, std=0.1)
    return arch, whole


@pytest.mark.parametrize("rank", [0, 1])
def test_an_expert_parallel_rank_on_the_fused_kernel_equals_its_per_expert_path(rank, monkeypatch):
    """EP over 2 ranks: each rank's block holds 4 of the 8 experts; on the fused kernel its
    output (the products of its experts, zeros for the others', before the all-reduce, which
    is left out here) equals its per-expert path's (fp32), a row alone its bits in the batch."""
    from duet.engine.model.moe import SparseMoeBlock
    from duet.engine.parallel import TensorParallel

    arch, whole = _qwen3_moe_block()
    monkeypatch.setattr(TensorParallel, "all_reduce", lambda self, x: x)  # the rank's part
    tp = TensorParallel(rank, 2, None, expert_parallel=True)
    part = SparseMoeBlock(arch, tp, None)
    assert part.first_expert == 4 * rank and len(part.experts) == 4
    part.gate.weight.data.copy_(whole.gate.weight)
    for e, expert in enumerate(part.experts):
        expert.load_state_dict(whole.experts[part.first_expert + e].state_dict())
    x = torch.randn(TOKENS, HIDDEN)
    with torch.no_grad():
        per_expert = part(x)
        assert part.fuse_experts() and part.w13.shape == (4, 2 * INTER, HIDDEN)
        fused = part(x)
        torch.testing.assert_close(fused, per_expert, atol=1e-5, rtol=1e-5)
        assert torch.equal(part(x[9:10]), fused[9:10])


@pytest.mark.slow
def test_every_variant_compiles_for_sm90_without_spills():
    """tests/engine/moe_sm90_compile.py in its own process (compiling needs Triton imported
    without TRITON_INTERPRET): each dtype's gate|up and down variants, top-1 (the expert
    exchange's rows), top-2 and top-8."""
    import json
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, os.path.join(root, "tests/engine/moe_sm90_compile.py")],
        capture_output=True, text=True, timeout=300, env={**env, "PYTHONPATH": path}, cwd=root,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    usage = json.loads(proc.stdout)
    assert len(usage) == 3 * 3 * 3
    for name, u in usage.items():
        assert (u["spill_stores"], u["spill_loads"], u["stack"]) == (0, 0, 0), (name, u)
        assert u["regs"] <= 255 and u["shared_bytes"] <= 227 * 1024, name


def _exchanged_against_fused(dtype: torch.dtype) -> None:
    """A block under the expert exchange (size 1 here: every row stays, but goes the exchange's
    way: sorted by expert, `triton_moe.expert_rows`, then scaled and added by
    `moe_combine.combine_choices`) against the same weights on `fused_experts` directly."""
    from duet.engine.model.moe import SparseMoeBlock
    from duet.engine.parallel import ExpertExchange, TensorParallel

    arch, whole = _qwen3_moe_block()
    whole = whole.to(DEVICE, dtype)
    exchanged = SparseMoeBlock(arch, TensorParallel(exchange=ExpertExchange(0, 1)), None)
    exchanged.load_state_dict(whole.state_dict())
    exchanged = exchanged.to(DEVICE, dtype)
    x = (torch.randn(TOKENS, HIDDEN) * 2).to(DEVICE, dtype)
    with torch.no_grad():
        assert whole.fuse_experts() and exchanged.fuse_experts()
        assert exchanged.exchange is not None and len(exchanged.experts) == 0
        want = whole(x)
        assert torch.equal(exchanged(x), want)
        assert torch.equal(exchanged(x[9:10]), want[9:10])
        assert exchanged(x[:0]).shape == (0, HIDDEN)  # a step with no tokens of its own


def test_the_exchange_on_the_fused_kernel_gives_its_bits_interpreted():
    _exchanged_against_fused(torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA: compiled bf16 (the interpreter emulates it)")
def test_the_exchange_on_the_fused_kernel_gives_its_bits_in_bf16_on_gpu():
    _exchanged_against_fused(torch.bfloat16)
