"""`load_format="dummy"` (vLLM's name): random weights made from a model's config.json alone,
so a GPU run needs no checkpoint on disk; and a byte-level tokenizer for a config that comes
without one.

The weights flow through `LlamaForCausalLM.load_weights` as a checkpoint's would, under HF's
names and full shapes, so tensor-parallel sharding and load-time quantization apply unchanged.
Each tensor is made on the device in the model's dtype from a generator seeded by its name:
the same config gives the same weights in every process, at any tensor-parallel size (a rank
narrows the full tensor, as it narrows a checkpoint's), which lets an aggregated engine and
disaggregated workers be compared token for token.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import torch

from duet.engine.model import ModelArchConfig
from duet.engine.tokenizer import Tokenizer

INIT_STD = 0.02
"""Standard deviation of the random matrices (HF's default `initializer_range`): with the
RMSNorms at 1 the activations stay in range, and distinct logits keep greedy choices stable."""
SEED = 0x5EED
"""Fixed, so that every process makes the same weights (not `EngineConfig.seed`, which seeds
sampling and would change the model with it)."""

DUMMY_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)


def hf_weight_shapes(arch: ModelArchConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of an HF checkpoint of `arch`: (name, full shape), as `_check_complete`
    expects them."""
    h, d, inter = arch.hidden_size, arch.head_dim, arch.intermediate_size
    q, kv = arch.num_attention_heads * d, arch.num_key_value_heads * d
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("model.embed_tokens.weight", (arch.vocab_size, h))
    ]
    for i in range(arch.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (inter, h)),
            (p + "mlp.up_proj.weight", (inter, h)),
            (p + "mlp.down_proj.weight", (h, inter)),
        ]
        if arch.attention_bias:
            biases = (("q", q), ("k", kv), ("v", kv))
            shapes += [(p + f"self_attn.{x}_proj.bias", (n,)) for x, n in biases]
        if arch.qk_norm:
            shapes += [(p + "self_attn.q_norm.weight", (d,)), (p + "self_attn.k_norm.weight", (d,))]
    shapes.append(("model.norm.weight", (h,)))
    if not arch.tie_word_embeddings:
        shapes.append(("lm_head.weight", (arch.vocab_size, h)))
    return shapes


def dummy_weights(
    arch: ModelArchConfig, dtype: torch.dtype, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """`(HF name, tensor)` for every weight of `arch`, one at a time, made on `device` in
    `dtype`: norms 1, biases 0, matrices normal(0, INIT_STD) from a generator seeded by the
    name (see the module's docstring). The caller drops each once placed, so at most one is
    alive beside the model."""
    for name, shape in hf_weight_shapes(arch):
        tensor = torch.empty(shape, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)
        elif name.endswith(".bias"):
            tensor.zero_()
        else:
            generator = torch.Generator(device=device)
            generator.manual_seed(SEED ^ zlib.crc32(name.encode()))
            tensor.normal_(0.0, INIT_STD, generator=generator)
        yield name, tensor


def byte_level_tokenizer(vocab_size: int, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
    """A tokenizer for a model that has none: ids 0-255 are the 256 characters of GPT-2's
    byte-level alphabet, one per byte (no merges: one token per byte of text), sorted by
    character; every further id up to `vocab_size`
    decodes to `<dummy_ID>`. So any text encodes, any sampled id decodes, and prompt lengths
    are easy to reason about. A plain `role: content` chat template."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < len(alphabet):
        raise ValueError(f"vocab_size: the byte-level tokenizer needs >= 256; got {vocab_size}")
    vocab = {char: i for i, char in enumerate(alphabet)}
    # NOTE: '<', '>', '_' and digits are their own byte-level characters, so the filler
    # names decode to themselves.
    vocab.update({f"<dummy_{i}>": i for i in range(len(alphabet), vocab_size)})
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return Tokenizer(tok, DUMMY_CHAT_TEMPLATE, eos_token_ids=eos_token_ids)


def save_byte_level_tokenizer(path: str, vocab_size: int) -> None:
    """Write `byte_level_tokenizer(vocab_size)` as tokenizer.json and tokenizer_config.json in
    the folder `path`, for tools that read a tokenizer from disk (`duet bench serve
    --tokenizer`, a router in front of dummy-weight workers)."""
    import json
    import os

    tok = byte_level_tokenizer(vocab_size)
    tok.backend.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": DUMMY_CHAT_TEMPLATE}, f)
