"""Helpers of the embedding tests: HF transformers' pooled hidden states, the reference; and a
sentence-transformers configuration written beside a model (engine/pooling_config.py reads
it)."""

from __future__ import annotations

import json
import os

import torch


def hf_vectors(path: str, prompts: list[list[int]], kind: str) -> list[torch.Tensor]:
    """HF's causal LM at `path`, fp32: each prompt's last hidden states (after the final norm)
    pooled `kind` (last, mean, cls) and scaled to unit length."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for ids in prompts:
            hidden = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
            pooled = {"last": hidden[-1], "cls": hidden[0], "mean": hidden.mean(dim=0)}[kind]
            out.append(torch.nn.functional.normalize(pooled, dim=0))
    return out


def write_st_config(path: str, modules: list[dict], pooling: dict | None) -> None:
    """A sentence-transformers configuration in `path`: `modules.json`, and the Pooling
    module's `1_Pooling/config.json` with `pooling`'s flags (None: no such file)."""
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump(modules, f)
    if pooling is not None:
        os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
        with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
            json.dump({"word_embedding_dimension": 64, **pooling}, f)


ST_MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {"idx": 2, "name": "2", "path": "2_Normalize",
     "type": "sentence_transformers.models.Normalize"},
]  # fmt: skip
