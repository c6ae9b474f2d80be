"""How close single-stream decode comes to the memory-bandwidth limit: the machine's read
bandwidth, measured in the same run as the decode, and the bytes each format streams per token.

At one stream a decode step reads every weight a token passes through once (the linears and
the LM head; the embedding only a row; of a mixture's routed experts only the top k it is sent
to) and the KV of its context, and computes little per byte:
tokens/s x bytes per token is the read rate it reaches. The limit is what a torch sum over
1 GiB reads per second with the same threads (the best of a few tries)."""

from __future__ import annotations

import time

import gguf
import torch
from torch import nn

from duet.engine import LLM

PROBE_BYTES = 1 << 30


def read_bandwidth_gbs(tries: int = 5) -> float:
    """GB/s (10^9 bytes) a torch sum over 1 GiB of fp32 reads, at torch's thread count."""
    data = torch.ones(PROBE_BYTES // 4)
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return PROBE_BYTES / best / 1e9


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    out = list(module.parameters()) + list(module.buffers())
    for sub in module.modules():
        for attr in ("packed", "cpu_kernel_panels"):
            t = getattr(sub, attr, None)
            if isinstance(t, torch.Tensor):
                out.append(t)
    return out


def _address(t: torch.Tensor) -> int | None:
    try:
        return t.data_ptr()
    except RuntimeError:  # an opaque tensor (oneDNN's packed layout): no table of ours
        return None


def streamed_bytes_per_token(llm: LLM, context_tokens: float) -> int:
    """Bytes one single-stream decode step reads: the weights less an embedding table that no
    product reads whole (a row per token is looked up; a tied head that computes from the
    table itself reads it whole), plus the KV of `context_tokens` (the mean context)."""
    engine = llm.engine
    model = engine.runner.model
    total = engine.weight_bytes
    embed = getattr(model, "embed_tokens", None)
    if isinstance(embed, nn.Embedding):
        table = embed.weight
        head = model.lm_head if model.lm_head is not None else model.tied_head
        head_ptrs = {_address(t) for t in _tensors(head)} if head is not None else set()
        if table.numel() and table.data_ptr() not in head_ptrs:
            total -= table.nbytes
    total -= unchosen_expert_bytes(model)
    kv = engine.runner.kv_caches
    per_token_kv = sum(c[:, 0, 0].nbytes for c in kv)  # K and V of one token, every layer
    return int(total + per_token_kv * context_tokens)


def unchosen_expert_bytes(model: nn.Module) -> int:
    """The routed experts' bytes one token does not read: of each sparse block's E experts it
    reads its top k, so (E - k) / E of their weights (in whatever form they are held: per
    expert, stacked, or per-expert views of stacks, each storage counted once)."""
    from duet.engine.model.moe import SparseMoeBlock

    out = 0.0
    for block in model.modules():
        if not isinstance(block, SparseMoeBlock):
            continue
        storages: dict[int, int] = {}
        for part in (block.experts, block.cpu_experts):
            if part is None:
                continue
            for t in _tensors(part):
                _add_storage(storages, t)
        for name in ("w13", "w2"):  # the fused Triton kernel's stacks (CUDA)
            t = getattr(block, name, None)
            if isinstance(t, torch.Tensor):
                _add_storage(storages, t)
        out += sum(storages.values()) * (block.num_experts - block.top_k) / block.num_experts
    return int(out)


def _add_storage(storages: dict[int, int], t: torch.Tensor) -> None:
    try:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    except RuntimeError:  # an opaque tensor (oneDNN's packed layout): counted by itself
        storages[id(t)] = t.nbytes


def gguf_streamed_bytes(path: str) -> int:
    """llama.cpp's weights per token from a GGUF's tensors: all but a token embedding that an
    `output.weight` of its own makes a lookup table only (KV not counted)."""
    reader = gguf.GGUFReader(path)
    names = {t.name for t in reader.tensors}
    untied = "output.weight" in names
    return sum(
        int(t.n_bytes) for t in reader.tensors if not (untied and t.name == "token_embd.weight")
    )
