"""CPU kernels in C++, compiled on first use with torch's cpp_extension (needs g++ and ninja):
paged decode and prefill attention (paged_decode_cpu.cpp, paged_prefill_cpu.cpp), the Llama block's elementwise ops
(elementwise_cpu.cpp), row copies by index for moving KV blocks (copy_cpu.cpp) and the
sampler's argmax, top-p threshold and inverse-CDF draw (sampling_cpu.cpp), bound in
cpu_module.cpp. `build_cpu_kernels` also builds the quantized linears' own module
(quant_linear_cpu.cpp, engine/quant/cpu_linear.py).

When the build is impossible (no compiler) the engine keeps the torch paths, which compute the
same thing; `DUET_CPU_KERNELS=0` forces them.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch

from duet.engine.config import cpuinfo_field

logger = logging.getLogger(__name__)

_DIR = os.path.dirname(__file__)
_SOURCES = [
    os.path.join(_DIR, name)
    for name in (
        "cpu_module.cpp",
        "paged_decode_cpu.cpp",
        "paged_prefill_cpu.cpp",
        "elementwise_cpu.cpp",
        "copy_cpu.cpp",
        "sampling_cpu.cpp",
    )
]
_HEADERS = [
    os.path.join(_DIR, name)
    for name in (
        "amx_tiles.h",
        "attention_amx.h",
        "attention_order.h",
        "cpu_ops.h",
        "cpu_simd.h",
        "dense_dot.h",
        "dense_panels.h",
        "paged_common.h",
    )
]
BUILD_TIMEOUT_S = 1800.0  # another process building the same kernels: wait at most this
# float32 and bfloat16 only: the kernels' element formats.
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def cpu_kernels_enabled() -> bool:
    """False when `DUET_CPU_KERNELS=0` asks for the plain torch paths everywhere. Read once per
    process (the model asks before each of its ops, and reading `os.environ` costs Python
    calls); `cpu_kernels_enabled.cache_clear()` rereads it."""
    return os.environ.get("DUET_CPU_KERNELS", "1") != "0"


def load_cpu_kernels() -> Any | None:
    """The compiled module, or None when kernels are off or cannot be built."""
    # NOTE: the setting is read before the cache: a process that built the module once still
    # honours `DUET_CPU_KERNELS=0` afterwards (and one that started with it off builds later).
    if not cpu_kernels_enabled():
        return None
    return _cpu_kernels()


@functools.cache
def _cpu_kernels() -> Any | None:
    try:
        return build_cpu_kernels()
    except Exception as e:  # any build failure: fall back to the torch paths
        logger.warning("CPU kernels unavailable (%s); using the torch reference paths", e)
        return None


_COMMON_CFLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",
    # a * b + c as one FMA (the kernels' products, acc += w * x) in every module alike, so the
    # inline code they share (cpu_simd.h) gives the same bits in each, whatever the compiler's
    # default: GCC 12 contracts even under -std=c++20, other compilers or modes may not.
    "-ffp-contract=fast",
)


def build_cpu_kernels(
    defines: tuple[str, ...] = (),
    module: str = "duet_cpu_kernels",
    sources: tuple[str, ...] | None = None,
) -> Any:
    """Compile (or load the cached build of) the module. `defines` (e.g. "DUET_SIMD_LANES=16")
    make a separate build, for tests of other SIMD widths. `module` and `sources` (file names in
    this directory): another extension built the same way, with the same flags (the quantized
    linears', engine/quant/cpu_linear.py). Raises when the build fails."""
    paths = _SOURCES if sources is None else [os.path.join(_DIR, s) for s in sources]
    from torch.utils.cpp_extension import is_ninja_available, load

    if not is_ninja_available():
        # ninja is a dependency, installed beside this interpreter, which may not be on PATH.
        os.environ["PATH"] = (
            os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
        )
    # Keyed on what is compiled (sources, headers, defines, flags), not on where it lives: every
    # checkout of the same code shares one build. torch rebuilds a name whose build arguments
    # (the source paths) change, and a rebuild rewrites a .so that other processes have mapped
    # (SIGBUS), so the build compiles copies of the sources kept in the build directory, whose
    # paths are the same for every checkout.
    key = (defines, _COMMON_CFLAGS)
    digest = hashlib.sha1(repr(key).encode())
    contents = {}
    for path in paths + _HEADERS:
        with open(path, "rb") as f:
            contents[os.path.basename(path)] = f.read()
        digest.update(contents[os.path.basename(path)])
    # -march=native code must never run on another CPU: key the build on the CPU's flags too.
    name = f"{module}_{digest.hexdigest()[:10]}_{_cpu_fingerprint()}"
    build_dir = _build_directory(name)
    with exclusive_lock(os.path.join(build_dir, "duet-build.flock"), BUILD_TIMEOUT_S):
        # torch's own lock file, if present now, was left by a build that was killed (we hold
        # the only lock on this directory): torch would wait for it forever.
        stale = os.path.join(build_dir, "lock")
        if os.path.exists(stale):
            logger.warning("removing %s, left by an interrupted kernel build", stale)
            os.remove(stale)
        # A finished build is imported as it is: ninja is not asked again, since processes
        # whose environments differ (Ray's workers, say) write other compiler command lines,
        # and ninja recompiled the whole module at every switch between them (60-90 s each).
        # The name already hashes everything compiled; the marker is written only after a
        # build succeeded, so a build killed mid-link is redone.
        built = os.path.join(build_dir, "duet-built")
        library = os.path.join(build_dir, f"{name}.so")
        if os.path.exists(built) and os.path.exists(library):
            return _import_built(name, library)
        with contextlib.suppress(FileNotFoundError):
            os.remove(built)
        sources_dir = os.path.join(build_dir, "src")
        _write_sources(sources_dir, contents)
        module = load(
            name=name,
            sources=[os.path.join(sources_dir, os.path.basename(p)) for p in paths],
            extra_cflags=[
                *_COMMON_CFLAGS,
                *(f"-D{d}" for d in defines),
            ],
            extra_ldflags=["-fopenmp"],
            build_directory=build_dir,
            verbose=False,
        )
        with open(built, "w"):
            pass
        return module


def _import_built(name: str, library: str) -> Any:
    """The extension module `name` from its built library (what torch's `load` imports)."""
    spec = importlib.util.spec_from_file_location(name, library)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_sources(directory: str, contents: dict[str, bytes]) -> None:
    """The build's copies of its sources and headers. A file already there is left alone (its
    content is what the build's name hashes; a new mtime would make ninja recompile); each
    new one is written whole, then renamed into place."""
    os.makedirs(directory, exist_ok=True)
    for file_name, data in contents.items():
        path = os.path.join(directory, file_name)
        if os.path.exists(path):
            with open(path, "rb") as f:
                if f.read() == data:
                    continue
        with open(path + ".tmp", "wb") as f:
            f.write(data)
        os.replace(path + ".tmp", path)


def _build_directory(name: str) -> str:
    from torch.utils.cpp_extension import _get_build_directory

    path = _get_build_directory(name, verbose=False)
    os.makedirs(path, exist_ok=True)
    return path


@contextlib.contextmanager
def exclusive_lock(path: str, timeout_s: float) -> Iterator[None]:
    """An advisory lock across processes that the kernel releases when its holder dies (a
    killed build cannot leave it behind). Raises TimeoutError after `timeout_s`."""
    with open(path, "a") as f:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no lock on {path} within {timeout_s:g}s") from None
                time.sleep(0.1)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def kernels_for(x: torch.Tensor) -> Any | None:
    """The compiled module when it can run on `x` (a CPU tensor of a kernel dtype), else None:
    the caller then takes its torch path. Cheap after the first call (the build is cached)."""
    if not x.is_cpu or x.dtype not in KERNEL_DTYPES:
        return None
    return load_cpu_kernels()


def _cpu_fingerprint() -> str:
    return hashlib.sha1(cpuinfo_field("flags").encode()).hexdigest()[:8]


def paged_decode_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    token_indices: torch.Tensor,
    scale: float,
) -> None:
    """Write attention of query rows `token_indices` (one per sequence) into the same rows
    of `out`. query/out: [T, H, D]; caches: [num_blocks, block_size, Hkv, D]."""
    kernels = load_cpu_kernels()
    assert kernels is not None
    kernels.paged_decode_attention(
        out, query, key_cache, value_cache, block_tables, seq_lens, token_indices, scale
    )


def prefill_kernel_supports(head_dim: int) -> bool:
    """Whether `paged_prefill_attention` takes this head size (a multiple of the vector width
    times 1, 2, 4, 8 or 16); other sizes keep the SDPA path."""
    kernels = load_cpu_kernels()
    return kernels is not None and bool(kernels.prefill_head_dim_supported(head_dim))


def paged_prefill_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start: torch.Tensor,
    query_lens: torch.Tensor,
    scale: float,
) -> None:
    """Causal attention of request i's `query_lens[i]` rows from `query_start[i]` (the last
    tokens of its `seq_lens[i]`) over its paged KV, written into the same rows of `out`.
    query/out: [T, H, D]; caches: [num_blocks, block_size, Hkv, D]."""
    kernels = load_cpu_kernels()
    assert kernels is not None
    kernels.paged_prefill_attention(
        out, query, key_cache, value_cache, block_tables, seq_lens, query_start, query_lens, scale
    )
