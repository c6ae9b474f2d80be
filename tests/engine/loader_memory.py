"""The loader's peak memory, measured in a fresh process (tests/engine/test_loader.py).

    python -m tests.engine.loader_memory write DIR    # a ~1B-parameter bf16 model, one shard per layer
    python -m tests.engine.loader_memory load DIR     # prints a JSON line: weight and peak bytes

Why resident memory and not tracemalloc: tracemalloc sees only what Python's own allocator
hands out, and torch's CPU tensors come from its C++ allocator (posix_memalign), so it would
report a few kilobytes for a 2 GB model. Why the kernel's high-water mark (VmHWM) and not a
sampling thread: a sampler misses peaks shorter than its period, while VmHWM is exact. The
process clears it (`/proc/self/clear_refs` "5") after importing everything, so the peak is the
load's alone; resident memory counts every page the process touches, including files it maps
(which the loader no longer does; the page cache its reads fill is not the process's).
"""

from __future__ import annotations

import json
import os
import sys

import torch

# A Llama of 20 layers at TinyLlama's widths: 1.01e9 parameters, 2.02 GB in bf16.
CONFIG = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000, hidden_size=2048,
    intermediate_size=5632, num_hidden_layers=20, num_attention_heads=32, num_key_value_heads=4,
    max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=2,
    torch_dtype="bfloat16",
)  # fmt: skip


def write_model(path: str) -> int:
    """Save a bf16 model of `CONFIG` (zeros and ones: the values do not matter for memory) with
    `safetensors.torch.save_file`, one file per layer so that writing it holds one layer at a
    time; returns its weight bytes."""
    from safetensors.torch import save_file

    from duet.engine.dummy_weights import hf_weight_shapes, save_byte_level_tokenizer
    from duet.engine.model import ModelArchConfig

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    save_byte_level_tokenizer(path, CONFIG["vocab_size"])  # type: ignore[arg-type]
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for name, shape in hf_weight_shapes(ModelArchConfig.from_hf_config(CONFIG)):
        layer = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        make = torch.ones if name.endswith("norm.weight") else torch.zeros
        shards.setdefault(layer, {})[name] = make(shape, dtype=torch.bfloat16)
    weight_map, total = {}, 0
    for layer in list(shards):
        tensors = shards.pop(layer)
        file = f"model-{layer}.safetensors"
        save_file(tensors, os.path.join(path, file))
        for name, t in tensors.items():
            weight_map[name] = file
            total += t.numel() * t.element_size()
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def measure_load(path: str) -> dict[str, int]:
    """Load `path` as the engine does on the CPU (bf16, deterministic: every post-load step,
    packing for oneDNN included) and return the weight bytes and the resident peak above the
    resident memory before loading."""
    from duet.engine.cpu_runtime import configure_cpu_runtime
    from duet.engine.loader import load_model

    configure_cpu_runtime()  # as LLMEngine does first on the CPU: glibc keeps freed memory
    before = _status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    loaded = load_model(path, torch.bfloat16, torch.device("cpu"), progress=False)
    peak = _status_bytes("VmHWM")
    return {"weight_bytes": loaded.weight_bytes, "peak_bytes": peak - before}


if __name__ == "__main__":
    command, folder = sys.argv[1:3]
    if command == "write":
        print(json.dumps({"weight_bytes": write_model(folder)}))
    else:
        print(json.dumps(measure_load(folder)))
