"""A safetensors checkpoint read one tensor at a time with plain file reads.

`safetensors.safe_open` maps each file and copies tensors out of the mapping, so while a file
is open its pages count in the process's resident memory beside the copies (and a file holding
the whole model doubles the resident bytes while it loads). Here each tensor is read with
`readinto` into a buffer of its own size and handed to the caller, which casts it into its
place and drops it: the loader's resident memory is the model plus one tensor; the file's bytes
stay in the page cache, shared and reclaimable, outside the process.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length,
a JSON header {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}},
then the data, little-endian, offsets counted from the end of the header.
"""

from __future__ import annotations

import io
import json
import mmap
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from duet.engine.errors import ModelLoadError
from duet.engine.parallel import TensorSlice

SelectSlice = Callable[[str, tuple[int, ...]], TensorSlice | None]
"""(tensor name, full shape) -> the part of it to read (None: all of it; an empty part: none of
it, another pipeline stage's tensor, skipped unread: `is_skipped`)."""


def is_skipped(part: TensorSlice | None) -> bool:
    """Whether a `SelectSlice` answer says the tensor is not this rank's at all (the weight
    sources yield nothing for it)."""
    return part is not None and part.start == part.end


@dataclass
class ReadStats:
    """Checkpoint bytes a loader read from disk (what a tensor-parallel rank's test counts)."""

    num_bytes: int = 0


DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER_BYTES = 100 << 20  # the format's own bound on the JSON header


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes lie in its file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute file offset of the first byte
    end: int  # one past the last byte

    @property
    def num_bytes(self) -> int:
        return self.end - self.begin


def read_header(path: str) -> list[TensorEntry]:
    """The tensors of one safetensors file, in the order their bytes lie in it. Raises
    `ModelLoadError` naming the file for a malformed header, an unknown dtype, a size that
    does not match the shape, or data past the end of the file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ModelLoadError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(_MAX_HEADER_BYTES, size - 8):
            raise ModelLoadError(f"{path}: not a safetensors file (header of {header_len} bytes)")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"{path}: unreadable safetensors header ({e})") from e
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path}: unreadable safetensors header (not a JSON object)")
    data_start = 8 + header_len
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise ModelLoadError(
                f"{path}: tensor {name!r} has dtype {info.get('dtype')!r}; supported: "
                f"{', '.join(DTYPES)}"
            )
        shape = tuple(int(x) for x in info["shape"])
        begin, end = (int(x) for x in info["data_offsets"])
        numel = 1
        for x in shape:
            numel *= x
        itemsize = torch.empty((), dtype=dtype).element_size()
        if end - begin != numel * itemsize or begin < 0 or data_start + end > size:
            raise ModelLoadError(
                f"{path}: tensor {name!r} ({info['dtype']} {list(shape)}) has data_offsets "
                f"[{begin}, {end}] that do not fit its shape or the file ({size} bytes)"
            )
        entries.append(TensorEntry(name, dtype, shape, data_start + begin, data_start + end))
    return sorted(entries, key=lambda e: e.begin)


def count_tensors(files: list[str]) -> int:
    return sum(len(read_header(f)) for f in files)


def iter_tensors(
    files: list[str], select: SelectSlice | None = None, stats: ReadStats | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """`(name, tensor)` for every tensor of `files`, each a fresh CPU tensor read from disk
    that nothing else references (the caller drops it once placed). `select`: the part of
    each tensor to read (a tensor-parallel rank's rows or columns; only those bytes are read,
    so N ranks read the checkpoint once between them); `stats` counts the bytes read."""
    for path in files:
        entries = read_header(path)
        with io.FileIO(path, "r") as f:
            for entry in entries:
                part = select(entry.name, entry.shape) if select is not None else None
                if is_skipped(part):
                    continue
                tensor = _read(f, path, entry, part)
                if stats is not None:
                    stats.num_bytes += tensor.nbytes
                yield entry.name, tensor


def _read(f: io.FileIO, path: str, entry: TensorEntry, part: TensorSlice | None) -> torch.Tensor:
    shape = list(entry.shape)
    if part is not None:
        if not 0 <= part.start <= part.end <= shape[part.dim]:
            raise ModelLoadError(
                f"{path}: tensor {entry.name!r} {shape} has no [{part.start}, {part.end}) along "
                f"dimension {part.dim}"
            )
        shape[part.dim] = part.end - part.start
    numel = 1
    for x in shape:
        numel *= x
    itemsize = torch.empty((), dtype=entry.dtype).element_size()
    num_bytes = numel * itemsize
    if num_bytes == 0:
        return torch.empty(shape, dtype=entry.dtype)
    # NOTE: an anonymous mapping of its own, not torch's allocator: the CPU engine tells glibc
    # to keep freed memory in its heap (engine/cpu_runtime.py), where buffers of a hundred
    # sizes left holes that kept ~15% of the model resident after loading; a mapping is
    # returned to the system as soon as the tensor that holds it is dropped.
    region = mmap.mmap(-1, num_bytes)
    buf = torch.frombuffer(region, dtype=torch.uint8)
    view = memoryview(region)
    # Byte runs to read: the whole tensor, a block of rows, or one run per row (columns).
    outer = 1
    for x in entry.shape[: part.dim if part is not None else 0]:
        outer *= x
    inner_bytes = num_bytes // outer  # what each outer index contributes
    stride = entry.num_bytes // outer  # its bytes in the file
    skip = 0 if part is None else inner_bytes // (part.end - part.start) * part.start
    for i in range(outer):
        _read_into(
            f, path, entry, entry.begin + i * stride + skip, view[i * inner_bytes :][:inner_bytes]
        )
    # NOTE: safetensors data is little-endian, as every CPU torch runs on here is.
    return buf.view(entry.dtype).reshape(shape)


def _read_into(f: io.FileIO, path: str, entry: TensorEntry, offset: int, view: memoryview) -> None:
    f.seek(offset)
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise ModelLoadError(f"{path}: ends inside tensor {entry.name!r}")
        done += n
