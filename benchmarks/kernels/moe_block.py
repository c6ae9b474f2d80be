"""One sparse layer of the MoE throughput benchmark's model (benchmarks/offline/moe_model.py's
shapes: hidden 1024, 64 experts of 256, top-8), its experts two ways in one process, calls
interleaved: a product pair per expert on oneDNN's packed layers (the CPU path before the
grouped kernel) against duet's grouped kernel (`SparseMoeBlock.group_experts_cpu`). With
`--quantization int8|int4` the experts are rounded to nearest first: a `QuantizedLinear` pair
per expert on duet's quantized kernels against their grouped calls (grouped_quant_experts_cpu.py).

    python -m benchmarks.kernels.moe_block [--dtype float32] [--threads 1] [--rows 32,2048]
    python -m benchmarks.kernels.moe_block --quantization int8 --rows 1,8,32,256

Prints the mean ms per forward of each and their ratio (per-expert / grouped: above 1, the
grouped kernel is faster), and the load average before and after (the machine may be shared).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from benchmarks.offline.moe_model import MoEShapes
from duet.engine.model import ModelArchConfig, row_invariant
from duet.engine.model.dense_cpu_linear import load_dense_kernel
from duet.engine.model.moe import SparseMoeBlock
from duet.engine.model.packed_linear import pack_linears
from duet.engine.model.quantized_linear import quantize_linear
from duet.engine.parallel import SINGLE
from duet.engine.quant.config import QuantizationConfig


def block(dtype: torch.dtype, shapes: MoEShapes, quantization: str | None) -> SparseMoeBlock:
    """The layer with its random weights (the same every call), rounded to `quantization`'s
    format (to nearest) when given."""
    spec = {**shapes.__dict__, "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe", "intermediate_size": 4 * shapes.moe_intermediate_size,
            "num_hidden_layers": 1, "norm_topk_prob": True}  # fmt: skip
    torch.manual_seed(0)
    out = SparseMoeBlock(ModelArchConfig.from_hf_config(spec), SINGLE, None)
    for p in out.parameters():
        torch.nn.init.normal_(p, std=0.03)
    out = out.to(dtype)
    if quantization is not None:
        config = QuantizationConfig(method=quantization)
        for expert in out.experts:
            for name in ("gate_up_proj", "down_proj"):
                dense = getattr(expert, name).weight.float()
                setattr(expert, name, quantize_linear(dense, None, config, dtype))
    return out


def blocks(
    dtype: torch.dtype, shapes: MoEShapes, quantization: str | None = None
) -> tuple[SparseMoeBlock, SparseMoeBlock]:
    """(per-expert, grouped): the same weights, set up as the loader sets a model outside
    deterministic mode."""
    per_expert, grouped = (block(dtype, shapes, quantization) for _ in range(2))
    if not grouped.group_experts_cpu(load_dense_kernel()):
        raise SystemExit("the grouped kernel does not take these experts here (no kernel, or AMX)")
    for each in (per_expert, grouped):
        pack_linears(each)
        row_invariant.set_min_rows(each, 1)
    return per_expert, grouped


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--rows", default="32,2048", help="comma list of token counts")
    p.add_argument("--reps", type=int, default=10, help="calls of each per row count")
    p.add_argument("--quantization", choices=["int8", "int4"], default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    shapes = MoEShapes()
    per_expert, grouped = blocks(dtype, shapes, args.quantization)
    gen = torch.Generator().manual_seed(1)
    print(f"load average {os.getloadavg()}")
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, shapes.hidden_size, generator=gen).to(dtype)
            per_expert(x), grouped(x)  # warm-up
            spent = {"per_expert": 0.0, "grouped": 0.0}
            for _ in range(args.reps):
                for name, block in (("per_expert", per_expert), ("grouped", grouped)):
                    start = time.perf_counter()
                    block(x)
                    spent[name] += time.perf_counter() - start
            a, b = (spent[k] / args.reps * 1e3 for k in ("per_expert", "grouped"))
            print(f"{args.dtype} {args.quantization or 'dense'} threads {args.threads} rows {rows}: per-expert {a:.3f} ms, "
                  f"grouped {b:.3f} ms, per-expert/grouped {a / b:.2f}", flush=True)  # fmt: skip
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
