"""Tiny GGUF files written as llama.cpp's converter would, from known HF-layout weights, for the
GGUF loader, tokenizer and repacking tests."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from duet.engine import gguf_tensors

Q = gguf.GGMLQuantizationType


@contextlib.contextmanager
def quick_gguf_reading_in_transformers() -> Iterator[None]:
    """transformers reading a GGUF (the oracle of the loader and tokenizer tests), quicker:
    it parses the file with gguf's reader, a Python loop over every part of every field (about
    4 s for SmolLM2's 49k-token vocabulary here), once for the config and again for the
    weights, and builds gguf's tensor-name map anew for each of the 272 tensors (6 s in all).
    Inside this context it parses with duet's reader, whose parse equals gguf's field for field
    and tensor for tensor (test_gguf_loader.py::test_the_reader_parses_what_ggufs_own_reader_
    parses, on the same file), and builds each map once: the same model, config and tokenizer
    (checked equal when this was written), 12 s -> 4 s for the model."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", gguf_tensors.Reader)
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield


HIDDEN, NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, FFN = 64, 2, 4, 2, 128
HEAD_DIM = HIDDEN // NUM_HEADS

_GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_GGUF_GLOBAL_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}


def gguf_name(hf_name: str) -> str:
    stem, suffix = hf_name.rsplit(".", 1)
    if stem in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[stem]}.{suffix}"
    _, _, layer, part = stem.split(".", 3)
    return f"blk.{layer}.{_GGUF_LAYER_NAMES[part]}.{suffix}"


def permute_like_llama_cpp(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute for q/k (HF rows -> interleaved)."""
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def hf_weights(
    vocab_rows: int, *, lm_head: bool = False, bias: bool = False, qk_norm: bool = False
) -> dict[str, np.ndarray]:
    """Random HF-layout weights of a tiny Llama-family model."""
    rng = np.random.default_rng(0)
    q_rows, kv_rows = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab_rows, HIDDEN)}
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q_rows, HIDDEN),
            p + "self_attn.k_proj.weight": (kv_rows, HIDDEN),
            p + "self_attn.v_proj.weight": (kv_rows, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, q_rows),
            p + "mlp.gate_proj.weight": (FFN, HIDDEN),
            p + "mlp.up_proj.weight": (FFN, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, FFN),
            p + "input_layernorm.weight": (HIDDEN,),
            p + "post_attention_layernorm.weight": (HIDDEN,),
        }
        if bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_rows,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_rows,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_rows,)
        if qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (HEAD_DIM,)}
            shapes |= {p + "self_attn.k_norm.weight": (HEAD_DIM,)}
    shapes["model.norm.weight"] = (HIDDEN,)
    if lm_head:
        shapes["lm_head.weight"] = (vocab_rows, HIDDEN)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def quant_type_for(hf_name: str) -> Q:
    """A mix of the types real GGUFs use; 1-D tensors stay F32 as llama.cpp keeps them."""
    if hf_name.endswith("norm.weight") or hf_name.endswith(".bias"):
        return Q.F32
    layer_zero = ".layers.0." in hf_name
    for part, (first, other) in {
        "q_proj": (Q.F32, Q.Q8_0),
        "k_proj": (Q.F16, Q.Q4_0),
        "v_proj": (Q.Q4_1, Q.Q5_1),
        "o_proj": (Q.BF16, Q.Q5_0),
        "gate_proj": (Q.Q8_0, Q.F16),
        "up_proj": (Q.Q4_1, Q.Q8_0),
        "down_proj": (Q.Q5_0, Q.F32),
    }.items():
        if part in hf_name:
            return first if layer_zero else other
    return Q.Q8_0  # embed_tokens, lm_head


def encode(array: np.ndarray, qtype: Q) -> np.ndarray:
    if qtype == Q.F32:
        return array.astype(np.float32)
    if qtype == Q.F16:
        return array.astype(np.float16)
    return gguf.quants.quantize(array, qtype)


def expected_dequantized(array: np.ndarray, qtype: Q) -> torch.Tensor:
    """What the loader must return for an HF weight written as `qtype`.

    Row-permuting q/k before quantizing does not change this: ggml quantizes each row on its own.
    """
    return torch.from_numpy(np.array(gguf.quants.dequantize(encode(array, qtype), qtype)))


def byte_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode characters, in byte order."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


BYTE_LEVEL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BYTE_LEVEL_MERGES = [
    "Ġ t", "h e", "Ġt he", "l l", "ll o", "he llo", "Ġ hello", "Ġ Ġ", "ĠĠ Ġ", "1 2", "12 3",
    "Ġ 1", "' s", "o r", "Ġw or", "Ġ w", "Ġwor ld", "l d", "Ċ Ċ", "Ġ Ċ", "i t",
]  # fmt: skip


def byte_level_tokens() -> list[str]:
    """Control tokens, the 256 bytes, one token per merge, and a user-defined `<think>`."""
    merged = [m.replace(" ", "") for m in BYTE_LEVEL_MERGES]
    return BYTE_LEVEL_SPECIALS + byte_alphabet() + merged + ["<think>"]


def add_byte_level_vocab(writer: gguf.GGUFWriter, pre: str) -> int:
    tokens = byte_level_tokens()
    types = [3] * len(BYTE_LEVEL_SPECIALS) + [1] * (len(tokens) - 4) + [4]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(BYTE_LEVEL_MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    return len(tokens)


SP_PIECES = [
    "▁", "h", "e", "l", "o", "w", "r", "d", "é", "▁h", "▁w", "he", "ll", "lo", "or", "ld",
    "▁he", "llo", "▁hello", "▁wor", "▁world",
]  # fmt: skip


def add_sentencepiece_vocab(writer: gguf.GGUFWriter, pre: str) -> int:
    del pre
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SP_PIECES
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(SP_PIECES))
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(SP_PIECES))])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_space_prefix(True)
    return len(tokens)


def write_tiny_gguf(
    path: Path,
    arch: str = "llama",
    *,
    vocab: Callable[[gguf.GGUFWriter, str], int] = add_byte_level_vocab,
    pre: str = "llama-bpe",
    lm_head: bool = False,
    extra_kv: Callable[[gguf.GGUFWriter], None] | None = None,
    extra_tensors: dict[str, tuple[np.ndarray, Q | None]] | None = None,
    qtypes: Callable[[str], Q] = quant_type_for,
) -> dict[str, np.ndarray]:
    """Write a 2-layer model as llama.cpp's converter would; return its HF-layout weights."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    num_tokens = vocab(writer, pre)
    writer.add_block_count(NUM_LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(NUM_HEADS)
    writer.add_head_count_kv(NUM_KV_HEADS)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    if extra_kv is not None:
        extra_kv(writer)
    weights = hf_weights(num_tokens, lm_head=lm_head, bias=arch == "qwen2", qk_norm=arch == "qwen3")
    for name, array in weights.items():
        if arch == "llama" and "q_proj" in name:
            array = permute_like_llama_cpp(array, NUM_HEADS)
        elif arch == "llama" and "k_proj" in name:
            array = permute_like_llama_cpp(array, NUM_KV_HEADS)
        qtype = qtypes(name) if len(array.shape) == 2 else Q.F32
        raw_dtype = qtype if qtype not in (Q.F32, Q.F16) else None
        writer.add_tensor(gguf_name(name), encode(array, qtype), raw_dtype=raw_dtype)
    for name, (array, raw_dtype) in (extra_tensors or {}).items():
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights
