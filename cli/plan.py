"""`duet plan --model CONFIG --gpus 8 --gpu-memory 80GiB`: every rank's memory under each
tensor x pipeline layout the GPUs allow, and which layouts fit (engine/memory_plan.py)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from duet.cli.engine_flags import parse_bytes
from duet.engine.config import CUDA_GRAPH_MODES

ROLES = ("aggregated", "prefill", "decode")
_GIB = 1 << 30


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = commands.add_parser(
        "plan",
        help="memory plan: weights, activations, graphs, staging and KV per rank for every "
        "TP x PP layout of N GPUs, and which fit",
    )
    parser.add_argument(
        "--model",
        default=None,
        metavar="CONFIG",
        help="a folder with a config.json, a config.json, a .gguf file, or a hub id whose "
        "config.json is in the local cache (default: embedded SmolLM2-135M-Instruct); no weights "
        "are read",
    )
    parser.add_argument("--gpus", type=int, default=1, help="GPUs (default 1)")
    parser.add_argument(
        "--gpu-memory",
        type=parse_bytes,
        default=80 * _GIB,
        metavar="BYTES",
        help="memory of one GPU, e.g. 80GiB (default), 141GB",
    )
    parser.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        default="bfloat16",
        help="weights and KV dtype (default bfloat16)",
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="default: the model's context"
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument(
        "--enforce-eager", action="store_true", help="no CUDA graphs (their pool not counted)"
    )
    parser.add_argument(
        "--cuda-graph-mode",
        choices=CUDA_GRAPH_MODES,
        default="decode",
        help="piecewise: the pieces' graph pool is counted too (serve's --cuda-graph-mode)",
    )
    parser.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="a mixture's routed experts sharded whole over each layout's TP ranks "
        "(--expert-parallel-size = --tensor-parallel-size); layouts whose TP does not divide "
        "the experts are left out",
    )
    parser.add_argument(
        "--data-parallel",
        action="store_true",
        help="a mixture of experts: also its data-parallel attention layouts (duet serve -dp D "
        "--expert-parallel-size D): each of D ranks the whole attention, 1/D of the experts and "
        "its own KV, no CUDA graphs; aggregated serving only",
    )
    parser.add_argument(
        "--role",
        choices=ROLES,
        default="aggregated",
        help="aggregated (default), or a prefill or decode worker, which also leaves room for "
        "its KV staging pool and NCCL communicators (the worker defaults) and runs one "
        "pipeline stage (a prefill worker: no CUDA graphs)",
    )
    parser.set_defaults(run=run, command_parser=parser)
    return parser


def read_hf_config(model: str | None) -> dict[str, Any]:
    """The config.json dict of `model` (see `--model`), without reading weights."""
    from duet.engine.errors import ModelLoadError

    if model is not None and os.path.isdir(model):
        model = os.path.join(model, "config.json")
    if model is not None and os.path.basename(model) == "config.json":
        if not os.path.isfile(model):
            raise ModelLoadError(f"{model} not found")
        with open(model) as f:
            config: dict[str, Any] = json.load(f)
        return config
    if model is None or model.endswith(".gguf"):
        from duet.engine.gguf_loader import load_gguf
        from duet.engine.loader import resolve_model_path

        return dict(load_gguf(resolve_model_path(model)).hf_config)
    if os.path.exists(model):
        raise ModelLoadError(f"{model!r} is neither a folder with a config.json nor a .gguf file")
    try:
        from huggingface_hub import hf_hub_download

        with open(hf_hub_download(model, "config.json")) as f:
            config = json.load(f)
        return config
    except Exception as e:
        raise ModelLoadError(f"no config.json for {model!r} locally or on the hub: {e}") from e


def run(args: argparse.Namespace) -> int:
    import torch

    from duet.decode_worker.config import DecodeWorkerConfig
    from duet.engine.memory_plan import PlanSettings, plan_layouts
    from duet.engine.model.arch import ModelArchConfig
    from duet.kv_transfer.staging import NCCL_COMM_BYTES
    from duet.prefill_worker.config import PrefillWorkerConfig

    parser: argparse.ArgumentParser = args.command_parser
    for flag in ("gpus", "block_size", "max_num_batched_tokens", "max_num_seqs"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}: must be an integer >= 1")
    if not 0 < args.gpu_memory_utilization <= 1:
        parser.error("--gpu-memory-utilization: must be a number in (0, 1]")
    arch = ModelArchConfig.from_hf_config(read_hf_config(args.model))
    if args.enable_expert_parallel and arch.moe is None:
        parser.error("--enable-expert-parallel: the model is dense (it has no routed experts)")
    if args.data_parallel and arch.moe is None:
        parser.error("--data-parallel: the model is dense (it has no routed experts to exchange)")
    if args.data_parallel and args.role != "aggregated":
        parser.error("--data-parallel: only aggregated serving runs data-parallel attention yet")
    dtype = getattr(torch, args.dtype)
    reserved: dict[str, int] = {}
    graphs = not args.enforce_eager
    if args.role != "aggregated":
        worker = PrefillWorkerConfig() if args.role == "prefill" else DecodeWorkerConfig()
        reserved = worker.device_reservations(0, 0)
        graphs = graphs and worker.decodes  # a prefill worker decodes nothing
    # Workers run one pipeline stage (KVWorkerConfig refuses more), aggregated engines any.
    max_pp = None if args.role == "aggregated" else 1
    settings = PlanSettings(
        dtype=dtype,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        cuda_graphs=graphs,
        piecewise_graphs=args.cuda_graph_mode == "piecewise" and not args.enforce_eager,
        reserved=reserved,
        expert_parallel=args.enable_expert_parallel,
        data_parallel=args.data_parallel,
    )
    layouts = plan_layouts(arch, args.gpus, args.gpu_memory, settings, NCCL_COMM_BYTES, max_pp)
    print(render_plan(args.model or "SmolLM2-135M-Instruct", args, layouts))
    return 0


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / _GIB:.2f}"


def _ranges(values: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    parts: list[str] = []
    start = prev = values[0]
    for v in [*values[1:], None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ",".join(parts)


def render_plan(name: str, args: argparse.Namespace, layouts: list[Any]) -> str:
    """The plan as text: a header, then per layout its verdict and one row per group of ranks
    with the same numbers."""
    lines = [
        f"memory plan: {name}, {args.gpus} GPU(s) of {_gib(args.gpu_memory)} GiB, "
        f"{args.dtype}, utilization {args.gpu_memory_utilization}, role {args.role}, "
        f"{args.max_num_batched_tokens} batched tokens, {args.max_num_seqs} sequences, "
        f"block {args.block_size}"
        + (", experts sharded over the TP ranks" if args.enable_expert_parallel else "")
        + (", data-parallel layouts too" if args.data_parallel else "")
        + "; GiB per rank",
    ]
    for layout in layouts:
        each = " a rank" if layout.dp > 1 else ""
        if layout.fits:
            verdict = (
                f"fits: {layout.kv_tokens} KV tokens{each}, context {layout.max_context}, "
                f"{layout.max_concurrent_seqs} sequences of {layout.max_model_len} at once"
            )
        elif layout.num_kv_blocks > 0:
            verdict = (
                f"fits only a shorter context: {layout.kv_tokens} KV tokens, context at most "
                f"{layout.max_context} of {layout.max_model_len}"
            )
        else:
            verdict = "does not fit: no room for a KV block"
        name = f"TP={layout.tp} x PP={layout.pp}"
        if layout.dp > 1:
            name = f"DP={layout.dp} x EP={layout.dp}"
        lines += ["", f"{name} ({layout.num_gpus} GPUs): {verdict}"]
        ranks = "stage / dp ranks" if layout.dp > 1 else "stage / tp ranks"
        lines.append(
            f"  {ranks:<22} {'layers':>9} {'weights':>8} {'activ':>7} "
            f"{'graphs':>7} {'other':>7} {'staging':>8} {'KV blk MiB':>10} {'KV blocks':>9}"
        )
        groups: dict[tuple[Any, ...], list[int]] = {}
        for r in layout.ranks:
            key = (
                r.layers[1] - r.layers[0], r.weights_bytes, r.activation_bytes,
                r.graph_pool_bytes, r.others_bytes, sum(r.reserved.values()), r.kv_block_bytes,
                r.num_kv_blocks, r.pp_stage,
            )  # fmt: skip
            groups.setdefault(key, []).append(r.tp_rank)
        for key, tp_ranks in groups.items():
            layers, weights, act, graphs, others, staging, block, blocks, stage = key
            shown = f"{stage} / {_ranges(tp_ranks)}"
            lines.append(
                f"  {shown:<22} {layers:>9} {_gib(weights):>8} {_gib(act):>7} {_gib(graphs):>7} "
                f"{_gib(others):>7} {_gib(staging):>8} {block / (1 << 20):>10.3f} {blocks:>9}"
            )
    return "\n".join(lines)
