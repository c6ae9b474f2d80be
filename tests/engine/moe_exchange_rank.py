"""One rank of an expert exchange (data-parallel attention), run as a script by
test_moe_exchange.py: python moe_exchange_rank.py MODEL RANK WORLD PORT OUT [OPTION].

Loads MODEL with this rank's share of the routed experts (`TensorParallel.exchange`), then runs
every sparse layer's block on this rank's own tokens of each case in `CASES` (fp32 and bf16),
and saves the outputs, the experts it holds and the expert counts to OUT. OPTION: int8 or int4
weights (quantized experts), or `fused`: the experts stacked for the fused Triton MoE kernel
(TRITON_INTERPRET=1 on the CPU); else the dtype's weights as loaded."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from duet.engine.loader import load_model
from duet.engine.model.moe import SparseMoeBlock
from duet.engine.parallel import ExpertExchange, TensorParallel
from duet.engine.quant.config import QuantizationConfig
from duet.engine.shm_collectives import LocalCollectives
from duet.engine.tp_group import exit_rank

CASES = [(5, 3), (0, 4), (7, 0), (1, 1), (0, 0)]
"""Tokens of rank 0 and rank 1 per case (a rank with none still serves its experts; a step
where neither has any moves nothing)."""
DTYPES = (torch.float32, torch.bfloat16)


def tokens(case: int, rank: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """This rank's hidden states of `case` (the test makes the same to compare)."""
    g = torch.Generator().manual_seed(1000 * case + rank)
    return (torch.randn(CASES[case][rank], hidden, generator=g) * 2).to(dtype)


def main() -> None:
    model, rank, world, port, out_file = sys.argv[1:6]
    option = sys.argv[6] if len(sys.argv) > 6 else None
    fused = option == "fused"
    quant = QuantizationConfig(option) if option and not fused else None
    rank, world = int(rank), int(world)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    group = dist.group.WORLD
    assert group is not None
    # shared memory unless DUET_SHM_COLLECTIVES=0 (or the CPU kernels are off): as
    # init_data_parallel makes it
    local = LocalCollectives.create(group, rank, world, 60.0)
    exchange = ExpertExchange(rank, world, group, local)
    result: dict = {"transport": "gloo" if local is None else "shared memory"}
    for dtype in (torch.float32,) if fused else DTYPES:  # (the interpreter's bf16 is not torch's)
        net = load_model(
            model, dtype, torch.device("cpu"), progress=False, quantization=quant,
            tp=TensorParallel(exchange=exchange),
        ).model  # fmt: skip
        blocks = {i: m for i, m in enumerate(net.layers) if isinstance(m.mlp, SparseMoeBlock)}
        for i, layer in blocks.items():
            block = layer.mlp
            if fused:  # the experts stacked for the fused Triton kernel (interpreted here)
                assert block.fuse_experts()
            block.expert_counts = torch.zeros(block.num_experts, dtype=torch.int64)
            held = (
                block.cpu_experts.num_experts if block.cpu_experts
                else block.w13.shape[0] if block.w13 is not None
                else len(block.experts)
            )  # fmt: skip
            result[(str(dtype), i, "experts")] = (block.first_expert, held)
            for case in range(len(CASES)):
                x = tokens(case, rank, net.config.hidden_size, dtype)
                result[(str(dtype), i, case)] = block.forward(x)
            result[(str(dtype), i, "counts")] = block.expert_counts.clone()
    torch.save(result, out_file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_rank(0)
