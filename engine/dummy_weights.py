"""`load_format="dummy"` (vLLM's name): random weights made from a model's config.json alone,
so a GPU run needs no checkpoint on disk; and a byte-level tokenizer for a config that comes
without one.

The weights flow through `LlamaForCausalLM.load_weights` as a checkpoint's would, under HF's
names and full shapes, so tensor-parallel sharding and load-time quantization apply unchanged.
Each element is a function of the tensor's name and the element's index in the full tensor
(a counter-based hash, as `engine.random` draws tokens), computed on the device in the model's
dtype: the same config gives the same weights in every process, and a tensor-parallel rank
makes only its own slice of each tensor, the same values the full tensor has there. So an
aggregated engine, disaggregated workers and every TP layout can be compared token for token,
and no rank spends time or memory on the other ranks' shards.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import torch

from duet.engine.model import ModelArchConfig
from duet.engine.model.mla import mla_weight_shapes
from duet.engine.model.moe_names import moe_weight_shapes
from duet.engine.parallel import TensorSlice
from duet.engine.tokenizer import Tokenizer
from duet.engine.weight_files import SelectSlice, is_skipped

INIT_STD = 0.02
"""Standard deviation of the random matrices (HF's default `initializer_range`): with the
RMSNorms at 1 the activations stay in range, and distinct logits keep greedy choices stable."""
SEED = 0x5EED
"""Fixed, so that every process makes the same weights (not `EngineConfig.seed`, which seeds
sampling and would change the model with it)."""
_CHUNK_ELEMENTS = 1 << 20
"""Elements hashed at once: bounds the temporaries (a few int64 and float32 tensors of this
many elements, ~40 MiB together) whatever the tensor. At 1 << 22 they came to ~250 MB beside
a 1B model's 131 MB LM head on an H200: 1.17x the weights at the peak, over the loader's
1.15x."""
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB

DUMMY_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)


def hf_weight_shapes(arch: ModelArchConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of an HF checkpoint of `arch`: (name, full shape), under the names its
    architecture's checkpoints use (what the loader's `_check_complete` expects)."""
    h, d, inter = arch.hidden_size, arch.head_dim, arch.intermediate_size
    q, kv = arch.num_attention_heads * d, arch.num_key_value_heads * d
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("model.embed_tokens.weight", (arch.vocab_size, h))
    ]
    for i in range(arch.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.append((p + "input_layernorm.weight", (h,)))
        if arch.mla is not None:
            shapes += mla_weight_shapes(arch, p)
        else:
            shapes += [
                (p + "self_attn.q_proj.weight", (q, h)),
                (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, q)),
            ]
        shapes.append((p + "post_attention_layernorm.weight", (h,)))
        if arch.moe is not None and arch.moe.is_sparse(i):
            shapes += moe_weight_shapes(arch.moe, h, p)
        else:
            shapes += [
                (p + "mlp.gate_proj.weight", (inter, h)),
                (p + "mlp.up_proj.weight", (inter, h)),
                (p + "mlp.down_proj.weight", (h, inter)),
            ]
        if arch.attention_bias and arch.mla is None:
            biases = (("q", q), ("k", kv), ("v", kv))
            shapes += [(p + f"self_attn.{x}_proj.bias", (n,)) for x, n in biases]
        if arch.qk_norm:
            shapes += [(p + "self_attn.q_norm.weight", (d,)), (p + "self_attn.k_norm.weight", (d,))]
    shapes.append(("model.norm.weight", (h,)))
    if not arch.tie_word_embeddings:
        shapes.append(("lm_head.weight", (arch.vocab_size, h)))
    return shapes


def dummy_weights(
    arch: ModelArchConfig,
    dtype: torch.dtype,
    device: torch.device,
    select: SelectSlice | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """`(HF name, tensor)` for every weight of `arch`, one at a time, made on `device` in
    `dtype`: norms 1, biases 0, matrices normal(0, INIT_STD) seeded by the name (see the
    module's docstring). `select`: the slice of each tensor to make (a tensor-parallel rank's;
    None: whole). The caller drops each once placed, so at most one is alive beside the
    model."""
    for name, shape in hf_weight_shapes(arch):
        part = select(name, shape) if select is not None else None
        if is_skipped(part):
            continue
        out_shape = list(shape)
        if part is not None:
            out_shape[part.dim] = part.end - part.start
        tensor = torch.empty(out_shape, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)
        elif name.endswith("bias"):  # biases and DeepSeek-V3's e_score_correction_bias
            tensor.zero_()
        else:
            _fill_normal(tensor, shape, part, SEED ^ zlib.crc32(name.encode()))
        yield name, tensor


def _fill_normal(
    out: torch.Tensor, shape: tuple[int, ...], part: TensorSlice | None, seed: int
) -> None:
    """Fill `out` (the slice `part` of a tensor of `shape`) with normal(0, INIT_STD) values,
    element i of the full tensor from splitmix64(seed, i) by Box-Muller, a chunk of rows at
    a time."""
    rows, cols = shape[0], (shape[1] if len(shape) > 1 else 1)
    r0, r1, c0, c1 = 0, rows, 0, cols
    if part is not None and part.dim == 0:
        r0, r1 = part.start, part.end
    elif part is not None:
        c0, c1 = part.start, part.end
    flat = out.view(r1 - r0, c1 - c0)
    device = out.device
    col_index = torch.arange(c0, c1, dtype=torch.int64, device=device)
    base = _signed(_mix64_int((seed + _GOLDEN) & _MASK64))
    step = max(1, _CHUNK_ELEMENTS // max(1, c1 - c0))
    for lo in range(r0, r1, step):
        hi = min(r1, lo + step)
        row_index = torch.arange(lo, hi, dtype=torch.int64, device=device)
        index = row_index[:, None] * cols + col_index[None, :]  # [rows, cols] in the full tensor
        z = _mix64(index * _signed(_GOLDEN) + base)
        u1 = (((z >> 40) & 0xFFFFFF).to(torch.float32) + 0.5) / (1 << 24)  # (0, 1)
        u2 = (((z >> 16) & 0xFFFFFF).to(torch.float32) + 0.5) / (1 << 24)
        normal = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2 * torch.pi) * u2)
        flat[lo - r0 : hi - r0].copy_(normal * INIT_STD)


_MASK64 = (1 << 64) - 1


def _signed(x: int) -> int:
    """A 64-bit pattern as the int64 torch stores it."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _mix64_int(z: int) -> int:
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's `>>` is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (multiplication wraps modulo 2**64)."""
    z = (z ^ _shr(z, 30)) * _signed(_MIX1)
    z = (z ^ _shr(z, 27)) * _signed(_MIX2)
    return z ^ _shr(z, 31)


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
