"""Finding and loading a model: HF directory, GGUF file, hub id, or the embedded default."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from duet.engine.dummy_weights import byte_level_tokenizer, dummy_weights, hf_weight_shapes
from duet.engine.errors import InvalidInputError, ModelLoadError
from duet.engine.kernels.cpu import cpu_kernels_enabled
from duet.engine.model import LlamaForCausalLM, ModelArchConfig, row_invariant
from duet.engine.model.dense_cpu_linear import use_dense_kernel_fp32, use_dense_kernel_pairs
from duet.engine.model.mla import group_mla_absorb_cpu
from duet.engine.model.moe import (
    fuse_moe_experts,
    group_moe_experts_cpu,
    use_dense_kernel_for_routers,
)
from duet.engine.model.packed_linear import fp32_packing_forced
from duet.engine.model.quantized_linear import set_kernel_max_rows
from duet.engine.model.weight_bytes import log_weight_bytes
from duet.engine.parallel import SINGLE, TensorParallel
from duet.engine.pooling_config import declared_pooling
from duet.engine.quant.config import QuantizationConfig
from duet.engine.quant.formats import QuantizedWeight
from duet.engine.tokenizer import Tokenizer
from duet.engine.weight_files import ReadStats, SelectSlice, count_tensors, iter_tensors

logger = logging.getLogger(__name__)

_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    arch: ModelArchConfig
    tokenizer: Tokenizer
    name: str  # what users call it (served model id)
    linears_batch_invariant: bool = False  # each row's bits independent of the batch (probed)
    weight_bytes: int = 0  # parameters and quantized weights this rank holds (tied head once)
    checkpoint_bytes_read: int = 0  # of the checkpoint, by this rank (its slices only)


def resolve_model_path(model: str | None) -> str:
    """The local path for `model`: the embedded default when None, a download for a hub id."""
    if model is None:
        from duet.engine.gguf_loader import default_model_path

        return default_model_path()
    if os.path.exists(model):
        return model
    looks_like_hub_id = model.count("/") == 1 and not model.startswith((".", "/", "~"))
    if not looks_like_hub_id:
        raise ModelLoadError(f"model path {model!r} does not exist")
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, allow_patterns=_HUB_PATTERNS)
    except Exception as e:
        raise ModelLoadError(
            f"model {model!r} is not a local path and could not be fetched from the hub: {e}"
        ) from e


WeightSource = Callable[[SelectSlice | None, ReadStats | None], Iterator[tuple[str, torch.Tensor]]]
QuantizedWeightSource = Callable[
    [SelectSlice | None, ReadStats | None], Iterator[tuple[str, torch.Tensor | QuantizedWeight]]
]


@dataclass
class ModelSource:
    """A model's architecture, tokenizer and name, and its weights not yet read."""

    arch: ModelArchConfig
    tokenizer: Tokenizer
    name: str
    rope_freqs: torch.Tensor | None
    weights: WeightSource
    """(select, stats) -> every weight, each cut to `select(name, shape)` where that is not
    None (a tensor-parallel rank's slice: only it is read), the bytes read counted in
    `stats`."""
    count_tensors: Callable[[], int]
    quantized_weights: QuantizedWeightSource | None = None
    """GGUF only: the weights with the file's quantized tensors kept quantized (repacked)."""


def open_model(
    model: str | None,
    tokenizer_path: str | None = None,
    hf_overrides: dict[str, Any] | None = None,
    load_format: str = "auto",
) -> ModelSource:
    """Read what describes `model` (config, tokenizer) without reading its weights: enough
    for a router to tokenize and validate requests. `load_format="dummy"`: a folder with
    config.json is enough (see `_open_dummy`)."""
    if load_format == "dummy":
        return _open_dummy(model, tokenizer_path, hf_overrides)
    path = resolve_model_path(model)
    name = model or "SmolLM2-135M-Instruct"
    if os.path.isfile(path) and path.endswith(".gguf"):
        from duet.engine.gguf_loader import load_gguf

        gguf = load_gguf(path)
        hf_config = {**gguf.hf_config, **(hf_overrides or {})}
        arch = ModelArchConfig.from_hf_config(hf_config)
        tokenizer = Tokenizer(
            gguf.tokenizer(),
            gguf.chat_template,
            gguf.bos_token,
            gguf.eos_token,
            arch.eos_token_ids,
            False,  # the GGUF tokenizer's post-processor already adds BOS where the model wants it
        )
        if model is not None and os.path.exists(model):
            name = os.path.basename(model).removesuffix(".gguf")
        return ModelSource(
            arch,
            tokenizer,
            name,
            gguf.rope_freqs,
            gguf.weights,
            lambda: gguf.num_tensors,
            gguf.quantized_weights,
        )
    if os.path.isdir(path):
        hf_config = {**_read_json(os.path.join(path, "config.json")), **(hf_overrides or {})}
        arch = ModelArchConfig.from_hf_config(hf_config)
        pooling = declared_pooling(path)
        if pooling is not None:
            arch = dataclasses.replace(arch, declared_pooling=pooling)
        eos = list(arch.eos_token_ids)
        gen_file = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen_file):
            gen_eos = _read_json(gen_file).get("eos_token_id")
            eos += (
                gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []
            )
        tokenizer = Tokenizer.from_dir(tokenizer_path or path, eos)
        if os.path.exists(model or ""):
            name = os.path.basename(os.path.normpath(path))

        def read(
            select: SelectSlice | None, stats: ReadStats | None
        ) -> Iterator[tuple[str, torch.Tensor]]:
            if not arch.embedding_only:
                return iter_tensors(_safetensors_files(path), select, stats)
            # A base model's names take the causal LM's `model.` prefix, for `select` too.
            chosen = None
            if select is not None:
                sharded = select
                chosen = lambda name, shape: sharded(_prefixed(name), shape)  # noqa: E731
            tensors = iter_tensors(_safetensors_files(path), chosen, stats)
            return ((_prefixed(name), tensor) for name, tensor in tensors)

        return ModelSource(
            arch, tokenizer, name, None, read, lambda: count_tensors(_safetensors_files(path))
        )
    raise ModelLoadError(f"{path!r} is neither a model directory nor a .gguf file")


def load_model(
    model: str | None,
    dtype: torch.dtype,
    device: torch.device,
    tokenizer_path: str | None = None,
    hf_overrides: dict[str, Any] | None = None,
    progress: bool = True,
    tp: TensorParallel = SINGLE,
    deterministic: bool = True,
    quantization: QuantizationConfig | None = None,
    load_format: str = "auto",
) -> LoadedModel:
    """The model on `device` in `dtype`, its weights read, cast and placed one tensor at a
    time: the memory it takes while loading is the weights plus the largest tensor (and, on
    the host, nothing for a GPU model but that one tensor). `load_format="dummy"`: random
    weights made on the device (engine/dummy_weights.py)."""
    source = open_model(model, tokenizer_path, hf_overrides, load_format)
    arch, name = source.arch, source.name
    with torch.device("meta"):
        net = LlamaForCausalLM(arch, source.rope_freqs, tp, quantization)
    # Each rank reads (or, dummy, makes) only the slices it holds.
    select = net.weight_slice if tp.spans_ranks else None
    stats = ReadStats()
    if quantization is not None and quantization.method == "gguf":
        if source.quantized_weights is None or load_format == "dummy":
            raise InvalidInputError(
                "quantization", "gguf keeps a GGUF file's quantized tensors; this model is not one"
            )
        weights: Iterator[tuple[str, Any]] = source.quantized_weights(select, stats)
    elif load_format == "dummy":
        weights = dummy_weights(arch, dtype, device, select)
    else:
        weights = source.weights(select, stats)
    # Built on meta so no time goes into random init, and cast there, so that the parameters
    # are allocated once, in `dtype` (casting after `to_empty` held the whole model in fp32
    # beside its cast). The rope tables (fp32) are then made for real. NOTE: `Module.to_empty`
    # but for contiguous tensors: `empty_like` of a meta tensor runs torch's Python reference
    # implementation, which imports sympy (0.3-0.7 s of CPU in every engine process).
    net = net.to(dtype)._apply(
        lambda t: (
            torch.empty(t.shape, dtype=t.dtype, device=device)
            if t.is_contiguous()
            else torch.empty_like(t, device=device)
        )
    )
    net.rotary.rebuild(device)
    if progress:
        weights = iter(
            tqdm(
                weights,
                total=source.count_tensors(),
                desc=f"Loading {name}",
                unit="tensor",
                leave=False,
            )
        )
    loaded = net.load_weights(weights)
    _check_complete(net, loaded)
    net.eval()
    if device.type == "cpu" and cpu_kernels_enabled():
        group_moe_experts_cpu(net)  # dense experts: one grouped product per layer, invariant
        use_dense_kernel_for_routers(net)  # a router's few outputs: oneDNN is all overhead
        group_mla_absorb_cpu(net)  # MLA's per-head products: two grouped calls per layer
        if deterministic:
            use_dense_kernel_pairs(net)  # bf16 on AMX tiles or the AVX512-BF16 dot (0 elsewhere)
        if not fp32_packing_forced():
            use_dense_kernel_fp32(net, whole_panels=True)  # both modes (dense_cpu_linear.py)
        net.pack_for_cpu()  # where it pays; DUET_CPU_KERNELS=0 keeps every plain torch path
    if deterministic and device.type == "cpu":
        set_kernel_max_rows(net, None)  # one product at every row count
        invariant = row_invariant.check_model(net, dtype).ok
    elif deterministic and device.type == "cuda":
        # cuBLAS and torch's reductions are not batch-invariant: Triton products and norms with
        # fixed tiles instead (docs/determinism.md). Quantized layers keep their kernels.
        row_invariant.set_min_rows(net, 1)
        invariant = _use_invariant_cuda_kernels(net) and quantization is None
    else:
        row_invariant.set_min_rows(net, 1)
        invariant = False
    if arch.moe is not None:
        fuse_moe_experts(
            net, device
        )  # CUDA: the fused Triton kernel (engine/kernels/triton_moe.py)
    num_bytes = log_weight_bytes(net, name, quantization)
    return LoadedModel(net, arch, source.tokenizer, name, invariant, num_bytes, stats.num_bytes)


def _use_invariant_cuda_kernels(net: LlamaForCausalLM) -> bool:
    """Batch-invariant Triton matmuls and RMSNorms for `net` on CUDA; False (and nothing set)
    where Triton cannot run."""
    from duet.engine.kernels.triton_runtime import triton_unusable_reason
    from duet.engine.model.norm import RMSNorm

    if triton_unusable_reason(torch.device("cuda")) is not None:
        return False
    row_invariant.use_invariant_gemm(net)
    for module in net.modules():
        if isinstance(module, RMSNorm):
            module.invariant = True
    return True


def _prefixed(name: str) -> str:
    """A base model's tensor under the causal LM's name: HF's `LlamaModel` saves `layers.0...`
    and `norm.weight`, which `LlamaForCausalLM` holds under `model.`."""
    return name if name.startswith("model.") else f"model.{name}"


def _check_complete(net: LlamaForCausalLM, loaded: set[str]) -> None:
    expected = {name for name, _ in hf_weight_shapes(net.config)}
    missing = sorted(n for n in expected - loaded if net.holds_tensor(n))
    if missing:
        raise ModelLoadError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path} not found")
    with open(path) as f:
        data: dict[str, Any] = json.load(f)
    return data


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        names = sorted(set(_read_json(index)["weight_map"].values()))
        return [os.path.join(path, n) for n in names]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"no .safetensors weights in {path}")
    return [os.path.join(path, f) for f in files]


def _open_dummy(
    model: str | None, tokenizer_path: str | None, hf_overrides: dict[str, Any] | None
) -> ModelSource:
    """A model of random weights: `model` is a folder with a config.json (weights, if any, are
    not read) or a config.json itself. The tokenizer: `tokenizer_path`, else the folder's
    tokenizer.json, else a byte-level one covering the vocabulary (logged)."""
    if model is None:
        raise InvalidInputError("load_format", "dummy needs --model: a folder with a config.json")
    path = os.path.dirname(model) if os.path.basename(model) == "config.json" else model
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelLoadError(f"load_format dummy: no config.json in {path!r}")
    arch = ModelArchConfig.from_hf_config(
        {**_read_json(os.path.join(path, "config.json")), **(hf_overrides or {})}
    )
    tok_dir = tokenizer_path or path
    if os.path.isfile(os.path.join(tok_dir, "tokenizer.json")):
        tokenizer = Tokenizer.from_dir(tok_dir, arch.eos_token_ids)
    else:
        logger.info(
            "load_format dummy: no tokenizer.json in %s; using a byte-level tokenizer of %d ids",
            tok_dir, arch.vocab_size,
        )  # fmt: skip
        tokenizer = byte_level_tokenizer(arch.vocab_size, arch.eos_token_ids)
    shapes = hf_weight_shapes(arch)

    def no_checkpoint(
        select: SelectSlice | None, stats: ReadStats | None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        raise ModelLoadError("load_format dummy reads no checkpoint; its weights are made")

    name = os.path.basename(os.path.normpath(path))
    return ModelSource(arch, tokenizer, name, None, no_checkpoint, lambda: len(shapes))
