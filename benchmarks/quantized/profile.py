"""Where a single-stream decode step's time goes, per weight format: the decoder layers'
projections, attention (rotary, the KV store and the paged kernel), the MLP's activation, the
norms, the LM head, the rest of the forward pass, and the step outside it (scheduling,
sampling, output handling: the host work). The projections' and the head's read rate is set
against the machine's (a torch sum over 1 GiB, in the same run).

    python -m benchmarks.quantized.profile                 # bf16, int8, int4, gguf; bf16 activations
    python -m benchmarks.quantized.profile --dtype float32 --tokens 128

The model calls its parts' `forward` directly (not through `nn.Module.__call__`), so hooks
never fire: each projection's and the head's `forward` is wrapped on the instance, and the CPU
kernel module's attention, norm and activation functions on the module (`KERNEL_PARTS`), for
the measured run only. A wrapper costs about a microsecond per call (about 250 calls per token
on SmolLM2), which lands in the parts it wraps. On a path without those kernels (CUDA, or
`DUET_CPU_KERNELS=0`) attention, norms and activation land in `forward_other`. Results: benchmarks/results/quantized_profile.json.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from benchmarks.common.machine import REPO_ROOT, cpu_info, git_commit
from benchmarks.quantized.bandwidth import read_bandwidth_gbs
from benchmarks.quantized.methods import DTYPES, METHODS, applicable, engine_kwargs, label
from duet.engine import LLM, SamplingParams
from duet.engine.kernels.cpu import load_cpu_kernels
from duet.engine.model.llama import Attention
from duet.engine.model.mlp import MLP
from duet.engine.model.weight_bytes import weight_bytes

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class Timers:
    """Seconds per part; `nested` parts are subtracted from the part that contains them."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._undo: list[tuple[Any, str]] = []

    def wrap(self, obj: Any, method: str, part: str, inner: float | None = None) -> None:
        original: Callable[..., Any] = getattr(obj, method)
        seconds = self.seconds

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = original(*args, **kwargs)
            seconds[part] += time.perf_counter() - start
            return out

        # an attribute of the object itself (a kernel module's function) is put back; a
        # method of its class is uncovered again by deleting the wrapper
        own = original if method in vars(obj) else None
        setattr(obj, method, timed)
        self._undo.append((obj, method, own))

    def unwrap(self) -> None:
        for obj, method, own in self._undo:
            if own is None:
                delattr(obj, method)
            else:
                setattr(obj, method, own)
        self._undo.clear()


KERNEL_PARTS = {
    "decode_attention_step": "attention",
    "paged_decode_attention": "attention",
    "paged_prefill_attention": "attention",
    "rotary_embedding": "attention",
    "write_kv": "attention",
    "rms_norm": "norms",
    "fused_add_rms_norm": "norms",
    "silu_and_mul": "mlp_activation",
}
"""The CPU kernel module's functions each part is, whichever Python path calls them (the module
tree's or engine/model/cpu_decode.py's loop)."""


def profile_format(llm: LLM, prompt: list[int], tokens: int, rounds: int) -> dict[str, Any]:
    model = llm.engine.runner.model
    timers = Timers()
    projection_bytes = 0
    for module in model.modules():
        if isinstance(module, Attention | MLP):
            for name in PROJECTIONS:
                proj = getattr(module, name, None)
                if isinstance(proj, nn.Module):
                    timers.wrap(proj, "forward", "projections")
                    projection_bytes += weight_bytes(proj)[0]
    kernels = load_cpu_kernels()
    if kernels is not None:
        for function, part in KERNEL_PARTS.items():
            timers.wrap(kernels, function, part)
    head = model.lm_head if model.lm_head is not None else model.tied_head
    assert head is not None
    head_bytes = weight_bytes(head)[0]
    timers.wrap(head, "forward", "lm_head")
    timers.wrap(model, "forward", "forward")
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    walls = []
    try:
        for _ in range(rounds):
            start = time.perf_counter()
            llm.generate([prompt], params)
            walls.append(time.perf_counter() - start)
    finally:
        timers.unwrap()
    steps = (tokens + 1) * rounds  # a prefill step per round, then a step per further token
    ms = {part: 1e3 * s / steps for part, s in timers.seconds.items()}
    parts = {
        part: ms.get(part, 0.0)
        for part in ("projections", "attention", "mlp_activation", "norms", "lm_head")
    }
    step_ms = 1e3 * sum(walls) / steps
    # the head runs outside `forward` (compute_logits); everything else of the forward pass
    # (embedding, residual adds, metadata) is what the parts above leave of it
    inner = sum(v for k, v in parts.items() if k != "lm_head")
    parts["forward_other"] = ms.get("forward", 0.0) - inner
    parts["host"] = step_ms - ms.get("forward", 0.0) - parts["lm_head"]
    return {
        "step_ms": step_ms,
        "parts_ms": parts,
        "projection_bytes": projection_bytes,
        "head_bytes": head_bytes,
        "projection_gbs": projection_bytes / (parts["projections"] / 1e3) / 1e9,
        "head_gbs": head_bytes / (parts["lm_head"] / 1e3) / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quantized.profile",
                                     description=__doc__)  # fmt: skip
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--out", default=str(REPO_ROOT / "benchmarks/results/quantized_profile.json")
    )
    args = parser.parse_args()
    prompt = [100 + (7 * i) % 20000 for i in range(args.prompt_tokens)]
    limit = read_bandwidth_gbs()
    print(f"memory read bandwidth (torch sum over 1 GiB): {limit:.1f} GB/s")
    rows: dict[str, Any] = {}
    for method in (m for m in args.methods.split(",") if applicable(m, None)):
        llm = LLM(None, load_progress=False, max_num_seqs=1, enable_prefix_caching=False,
                  **engine_kwargs(method, args.group_size, True, args.dtype))  # fmt: skip
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        rows[label(method, args.dtype)] = profile_format(llm, prompt, args.tokens, args.rounds)
        del llm
    names = ["projections", "attention", "mlp_activation", "norms", "lm_head", "forward_other",
             "host"]  # fmt: skip
    print(f"{'format':10} {'step ms':>8} " + " ".join(f"{n:>14}" for n in names)
          + f" {'proj GB/s':>10} {'head GB/s':>10}")  # fmt: skip
    for name, row in rows.items():
        cells = " ".join(f"{row['parts_ms'][n]:14.3f}" for n in names)
        print(f"{name:10} {row['step_ms']:8.3f} {cells} {row['projection_gbs']:10.1f} "
              f"{row['head_gbs']:10.1f}")  # fmt: skip
    record = {"machine": cpu_info(), "commit": git_commit("engine"), "read_bandwidth_gbs": limit,
              "args": vars(args), "formats": rows}  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(record, f, indent=2)
        f.write("\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
