"""A random-weight Qwen3-MoE model for the mixture-of-experts throughput benchmark, built with
HF transformers' own `Qwen3MoeForCausalLM` from a config and saved as fp32 safetensors.

The default shapes scale Qwen3-30B-A3B (hidden 2048, 48 layers, 32 query / 4 KV heads of
128, 128 experts, top-8, expert intermediate 768, vocabulary 151,936) down to about 1.4B
parameters, to fit a 24 GiB machine in fp32 one system at a time: hidden 1024, 24 layers,
16 query / 2 KV heads of 128, 64 experts, top-8, expert intermediate 256, a 32,768-token
byte-level tokenizer (engine/dummy_weights.py; the prompts are random ids anyway).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_DIR = Path(os.path.expanduser("~/.cache/duet/qwen3-moe-bench"))
_DONE_MARKER = ".build-complete"


@dataclass(frozen=True)
class MoEShapes:
    """A Qwen3-MoE model's sizes (HF config names)."""

    hidden_size: int = 1024
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 128
    num_experts: int = 64
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 256
    vocab_size: int = 32768

    def num_parameters(self) -> int:
        """Every weight of the model: embedding and LM head (untied), and per layer the
        attention (q, k, v, o and q/k norms), the router, the experts and two norms."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        attention = h * q + 2 * h * kv + q * h + 2 * d
        experts = self.num_experts * 3 * h * self.moe_intermediate_size
        layer = attention + self.num_experts * h + experts + 2 * h
        return 2 * self.vocab_size * h + self.num_hidden_layers * layer + h

    def num_active_parameters(self) -> int:
        """The weights one token's forward reads: all but the unchosen experts (and the
        embedding table, of which it reads one row)."""
        unchosen = self.num_experts - self.num_experts_per_tok
        per_layer = unchosen * 3 * self.hidden_size * self.moe_intermediate_size
        return (
            self.num_parameters()
            - self.num_hidden_layers * per_layer
            - self.vocab_size * self.hidden_size
        )


def build_moe_dir(out_dir: Path, shapes: MoEShapes, seed: int = 0) -> Path:
    """Write config.json, fp32 safetensors and a tokenizer for `shapes` to `out_dir`, once per
    shapes and seed (a finished build is marked with them; another is rebuilt). Returns it."""
    spec = {**dataclasses.asdict(shapes), "seed": seed}
    marker = out_dir / _DONE_MARKER
    if marker.is_file() and json.loads(marker.read_text()) == spec:
        return out_dir
    import torch
    from transformers import AutoConfig, Qwen3MoeForCausalLM

    from duet.engine.dummy_weights import save_byte_level_tokenizer

    config = AutoConfig.for_model(
        "qwen3_moe",
        **dataclasses.asdict(shapes),
        intermediate_size=4 * shapes.moe_intermediate_size,  # unused: every layer is sparse
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        norm_topk_prob=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config)
    out_dir.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    model.save_pretrained(str(out_dir))
    del model
    save_byte_level_tokenizer(str(out_dir), shapes.vocab_size)
    marker.write_text(json.dumps(spec) + "\n")
    return out_dir
