"""Reading a GGUF file's tensors as duet needs them (engine/gguf_loader.py): a faster reader
over the mapped file, the part of a tensor a rank reads, and llama.cpp's q/k row order undone."""

from __future__ import annotations

import functools
from typing import Any

import gguf
import numpy as np
import torch

from duet.engine.parallel import TensorSlice
from duet.engine.quant.formats import QuantizedWeight


def unpermute_rope_rows(
    weight: torch.Tensor | QuantizedWeight, num_heads: int
) -> torch.Tensor | QuantizedWeight:
    """Undo llama.cpp's q/k row permutation for interleaved (GPT-J style) rope.

    llama.cpp's converter reorders each head's rows from HF's [first half, second half] layout
    (rotate_half rope) to interleaved pairs: row r of half h moves to 2 * r + h. This reads the
    pairs back into halves. Works for weights [out, in] and biases [out].
    """
    if not isinstance(weight, torch.Tensor):  # quantized: move whole rows with their scales
        index = unpermute_rope_rows(torch.arange(weight.shape[0]), num_heads)
        assert isinstance(index, torch.Tensor)
        return weight.permute_rows(index)
    head_rows = weight.shape[0] // num_heads
    pairs = weight.reshape(num_heads, head_rows // 2, 2, *weight.shape[1:])
    return pairs.transpose(1, 2).reshape(weight.shape)


class Reader(gguf.GGUFReader):
    """gguf's reader, parsing from a plain ndarray view of its memmap: slicing a `np.memmap`
    runs its Python `__array_finalize__` on every one of the ~250k fields and strings of a
    49k-token vocabulary (SmolLM2: 5.8 s to open; 1.6 s this way). The parts are the same
    arrays, still views of the mapped file."""

    def _get(
        self, offset: int, dtype: Any, count: int = 1, override_order: Any = None
    ) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        count = int(count)
        dt = np.dtype(dtype)
        arr = plain[offset : offset + dt.itemsize * count].view(dt)[:count]
        order = self.byte_order if override_order is None else override_order
        return arr if order == "I" else arr.view(dt.newbyteorder(order))


def slice_data(
    data: np.ndarray, qtype: gguf.GGMLQuantizationType, part: TensorSlice | None
) -> np.ndarray:
    """The part of a mapped tensor (of type `qtype`) a rank reads: its rows (always
    contiguous, whole blocks), or its columns where they start and end on quantization blocks
    (every row's run of blocks); otherwise the whole tensor, which `load_weights` narrows."""
    if part is None:
        return data
    if part.dim == 0:
        return data[part.start : part.end]
    if data.ndim != 2:
        return data
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if data.dtype != np.uint8:  # F32, F16, ...: one element per column
        return data[:, part.start : part.end]
    if part.start % block or part.end % block:
        return data
    return data[:, part.start // block * type_size : part.end // block * type_size]


@functools.cache
def can_dequantize(qtype: gguf.GGMLQuantizationType) -> bool:
    """Whether `gguf.quants.dequantize` implements `qtype` (probed on one zero block)."""
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
    except (NotImplementedError, ValueError, TypeError):
        return False
    return True


def supported_quant_types() -> list[str]:
    """Names of the GGML tensor types this loader can dequantize."""
    return [t.name for t in gguf.GGMLQuantizationType if can_dequantize(t)]
