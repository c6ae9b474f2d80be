"""Mean negative log-likelihood of a fixed public-domain text under each weight format.

The text (`public_domain_text.txt`: the first chapter of Pride and Prejudice, the Gettysburg
Address and the Declaration of Independence, transcribed) is tokenized once and cut into windows
of `window` tokens, each scored cold (teacher forcing: every token's NLL given the window's
tokens before it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.quantized.methods import engine_kwargs
from duet.engine.attention import AttentionMetadata
from duet.engine.config import EngineConfig
from duet.engine.loader import load_model
from duet.engine.model import LlamaForCausalLM

TEXT_PATH = Path(__file__).with_name("public_domain_text.txt")
BLOCK_SIZE = 16


def window_nll(
    model: LlamaForCausalLM, ids: torch.Tensor, dtype: torch.dtype
) -> tuple[float, int, torch.Tensor]:
    """(sum of NLLs of tokens 1.. of `ids` given the ones before, how many, the model's top-1
    token at each of those places)."""
    cfg = model.config
    num_tokens = ids.shape[0]
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    caches = [
        torch.zeros(2, num_blocks, BLOCK_SIZE, model.num_kv_heads, cfg.head_dim, dtype=dtype)
        for _ in range(cfg.num_hidden_layers)
    ]
    meta = AttentionMetadata.build(
        [num_tokens], [num_tokens], [list(range(num_blocks))], BLOCK_SIZE, torch.device("cpu")
    )
    with torch.inference_mode():
        hidden = model(ids, torch.arange(num_tokens), caches, meta)
        logits = model.compute_logits(hidden[:-1])  # [T - 1, vocab] fp32
        nll = F.cross_entropy(logits, ids[1:], reduction="sum")
    return float(nll), num_tokens - 1, logits.argmax(-1)


def mean_nll(model_name: str | None, method: str, group_size: int, window: int,
             max_tokens: int | None, lm_head: bool = False) -> dict[str, Any]:  # fmt: skip
    """The format's mean NLL over the text, and (under "top1", not for JSON) its top-1 token
    at every scored place, for `top1_match`."""
    kwargs = engine_kwargs(method, group_size, lm_head)
    config = EngineConfig.from_kwargs(model=model_name, **kwargs)
    loaded = load_model(
        config.model, torch.bfloat16, torch.device("cpu"), progress=False,
        quantization=config.quantization_config(), deterministic=False,
    )  # fmt: skip
    ids = loaded.tokenizer.encode(TEXT_PATH.read_text())
    if max_tokens is not None:
        ids = ids[:max_tokens]
    vocab = loaded.arch.vocab_size
    tokens = torch.tensor([t if t < vocab else 0 for t in ids], dtype=torch.int64)
    total, count, top1 = 0.0, 0, []
    for start in range(0, len(tokens) - 1, window):
        chunk = tokens[start : start + window]
        if chunk.shape[0] < 2:
            continue
        nll, n, best = window_nll(loaded.model, chunk, torch.bfloat16)
        total, count = total + nll, count + n
        top1.append(best)
    return {"method": method, "mean_nll": total / count, "tokens": count,
            "weight_bytes": loaded.weight_bytes, "top1": torch.cat(top1)}  # fmt: skip


def top1_match(rows: list[dict[str, Any]], base: str = "bf16") -> None:
    """Each row's share of places where its top-1 token is `base`'s (the same text, teacher
    forced), as "top1_match_vs_bf16"; drops the rows' "top1" tensors."""
    ref = next((r["top1"] for r in rows if r["method"] == base), None)
    for row in rows:
        top1 = row.pop("top1")
        if ref is not None:
            row[f"top1_match_vs_{base}"] = float((top1 == ref).float().mean())
