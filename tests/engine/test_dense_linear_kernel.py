"""duet's dense CPU linear (engine/kernels/dense_linear_cpu.cpp): close to F.linear, and a row's
bits do not depend on the batch, the row's place in it, the rows' stride or the thread count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from duet.engine.model import dense_cpu_linear, row_invariant
from duet.engine.model.dense_cpu_linear import (
    load_dense_kernel,
    use_dense_kernel,
    use_dense_kernel_fp32,
    use_dense_kernel_pairs,
)
from duet.engine.model.packed_linear import PackedLinear, packing_supported

DTYPES = [torch.float32, torch.bfloat16]
# SmolLM2's; K off the lanes; on AMX tiles, K in uneven parts (11 steps of 32: 6 + 5) and more
# channel blocks than a thread's group (69 blocks, the last of a group alone)
SHAPES = [(960, 576, True), (576, 1536, False), (37, 70, True), (1100, 352, True)]


@pytest.fixture(scope="module")
def kernel():
    module = load_dense_kernel()
    assert module is not None, "the dense kernel did not build"
    return module


def _case(out: int, inp: int, bias: bool, dtype: torch.dtype, rows: int = 300):
    g = torch.Generator().manual_seed(out * inp)
    w = torch.randn(out, inp, generator=g).to(dtype)
    b = torch.randn(out, generator=g).to(dtype) if bias else None
    x = torch.randn(rows, inp, generator=g).to(dtype)
    return x, w, b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("out", "inp", "bias"), SHAPES)
def test_close_to_f_linear_and_rows_alone_equal_rows_in_a_batch(kernel, dtype, out, inp, bias):
    x, w, b = _case(out, inp, bias, dtype)
    y = kernel.dense_linear(x, w, b)
    assert y.dtype == dtype and y.shape == (300, out)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    tol = 4e-3 if dtype == torch.bfloat16 else 1e-6  # one bf16 rounding at the end
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < tol
    for m in (1, 7, 64, 299):
        assert torch.equal(kernel.dense_linear(x[:m], w, b), y[:m]), m
    for i in (0, 5, 77, 299):
        assert torch.equal(kernel.dense_linear(x[i : i + 1], w, b)[0], y[i]), i
    assert torch.equal(kernel.dense_linear(x[::3], w, b), y[::3])  # rows a stride apart


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return set(next(line for line in f if line.startswith("flags")).split())


def _cpu_has_amx() -> bool:
    return {"amx_tile", "amx_bf16", "avx512_bf16"} <= _cpu_flags()


def test_bf16_weights_pack_as_column_pairs_where_the_cpu_has_amx_or_a_bf16_dot(kernel):
    """AMX's tiles and, without AMX, AVX512-BF16's `vdpbf16ps` (engine/kernels/dense_dot.h)
    read bf16 weights as column pairs; elsewhere bf16 takes the FMA panels."""
    amx = _cpu_has_amx()
    dot = not amx and {"avx512_bf16", "avx512f"} <= _cpu_flags()
    assert bool(kernel.amx()) is amx and bool(kernel.bf16_dot()) is dot
    w = torch.randn(40, 64).bfloat16()  # 3 blocks of 16 channels, the last padded
    packed = kernel.pack_dense(w)
    assert kernel.pack_dense(w.float()).dim() == 3  # fp32: FMA panels everywhere
    off_tiles = kernel.pack_dense(torch.randn(40, 70).bfloat16()).dim()
    assert off_tiles == (4 if dot else 3)  # K off AMX's tiles; the dot needs K even only
    assert kernel.pack_dense(torch.randn(40, 71).bfloat16()).dim() == 3  # K odd: panels
    if not (amx or dot):
        assert packed.dim() == 3
        return
    padded = torch.cat([w, w.new_zeros(8, 64)])
    pairs = padded.view(3, 16, 32, 2).permute(0, 2, 1, 3)  # [block, pair, channel, column]
    assert packed.shape == (3, 32, 16, 2) and torch.equal(packed, pairs)
    x = torch.randn(33, 64).bfloat16()  # a full 32-row chunk and a chunk of one
    b = torch.randn(40)
    y = kernel.dense_linear_packed(x, packed, 40, b)
    ref = F.linear(x.double(), w.double(), b.double())
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 4e-3
    assert torch.equal(kernel.dense_linear_packed(x[32:], packed, 40, b), y[32:])
    with pytest.raises(RuntimeError, match="panels must be pack_dense's"):
        kernel.dense_linear_packed(x.float(), packed, 40, None)  # pairs take bf16 only


@pytest.mark.parametrize("deterministic", [True, False])
def test_deterministic_bf16_layers_take_the_column_pairs(kernel, tiny_llama, deterministic):
    """AMX's tiles or, without AMX, AVX512-BF16's dot: in deterministic mode every bf16 dense
    product takes them; otherwise oneDNN's packed layers stay."""
    from duet.engine.loader import load_model
    from duet.engine.model.packed_linear import PackedLinear, packing_supported

    model = load_model(tiny_llama, torch.bfloat16, torch.device("cpu"), progress=False,
                       deterministic=deterministic).model  # fmt: skip
    gate_up = model.layers[0].mlp.gate_up_proj
    if deterministic and (kernel.amx() or kernel.bf16_dot()):  # invariant by construction
        assert gate_up.cpu_kernel is kernel and gate_up.weight.dim() == 4
        assert model.tied_head is None or model.tied_head.cpu_kernel is kernel
        assert use_dense_kernel_pairs(model) == 0  # nothing left to move
    else:
        assert isinstance(gate_up, PackedLinear) is packing_supported(torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_thread_count_does_not_change_a_bit(kernel, dtype):
    x, w, b = _case(576, 1536, True, dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel.dense_linear(x, w, b)
        torch.set_num_threads(2)
        two = kernel.dense_linear(x, w, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_bad_operands_are_refused(kernel):
    x, w, _ = _case(16, 32, False, torch.float32)
    with pytest.raises(RuntimeError, match="w must be a contiguous CPU"):
        kernel.dense_linear(x, w.bfloat16())
    with pytest.raises(RuntimeError, match="x's dtype and K"):
        kernel.dense_linear(x[:, :16], w)
    with pytest.raises(RuntimeError, match="bias must be"):
        kernel.dense_linear(x, w, torch.zeros(3))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernel.dense_linear(x.double(), w.double())


@pytest.mark.parametrize("native_bf16", [True, False])
def test_bf16_layers_take_the_kernel_only_without_native_bf16(monkeypatch, native_bf16):
    monkeypatch.setattr(dense_cpu_linear, "cpu_has_native_bf16", lambda: native_bf16)
    model = torch.nn.Sequential(
        row_invariant.Linear(64, 32).bfloat16(), row_invariant.Linear(32, 64), torch.nn.ReLU()
    )
    plain = model[0].weight.detach().clone()
    assert use_dense_kernel(model) == (0 if native_bf16 else 1)
    assert (model[0].cpu_kernel is None) is native_bf16
    assert model[1].cpu_kernel is None  # fp32: the vendor GEMM unless its probe fails
    if not native_bf16:
        kernel = load_dense_kernel()
        assert torch.equal(model[0].weight, kernel.pack_dense(plain))  # panels replace it
        x = torch.randn(5, 64).bfloat16()
        assert torch.equal(model[0](x), kernel.dense_linear(x, plain, model[0].bias))


def test_fp32_layers_take_the_kernel_outside_deterministic_mode(kernel):
    model = torch.nn.Sequential(
        row_invariant.Linear(64, 32), row_invariant.Linear(32, 64).bfloat16(), torch.nn.ReLU()
    )
    model[0].min_rows = 1
    plain = model[0].weight.detach().clone()
    assert use_dense_kernel_fp32(model) == 1  # the fp32 layer only
    assert model[0].cpu_kernel is kernel and model[1].cpu_kernel is None
    assert torch.equal(model[0].weight, kernel.pack_dense(plain))
    for rows in (1, 48, 300):
        x = torch.randn(rows, 64)
        assert torch.equal(model[0](x), kernel.dense_linear(x, plain, model[0].bias))
    assert use_dense_kernel_fp32(model) == 0  # on it already: not packed twice


def test_a_tied_head_gets_panels_of_its_own_and_the_table_stays(kernel):
    table = torch.randn(100, 64)
    head = row_invariant.TiedLinear(table)
    assert use_dense_kernel_fp32(torch.nn.Sequential(head)) == 1
    assert head.weight_ref[0] is table and head.cpu_kernel_panels is not None
    x = torch.randn(3, 64)
    assert torch.equal(head(x), kernel.dense_linear(x, table))


@pytest.mark.parametrize("deterministic", [True, False])
def test_the_loader_puts_fp32_layers_on_the_kernel(tiny_llama, deterministic, monkeypatch):
    """Every fp32 projection and the head on the kernel in both modes, on every CPU (no oneDNN
    packed layer); `DUET_PACK_FP32=1` keeps oneDNN's packed path where it is supported."""
    from duet.engine.loader import load_model

    def load():
        return load_model(tiny_llama, torch.float32, torch.device("cpu"), progress=False,
                          deterministic=deterministic).model  # fmt: skip

    model = load()
    assert not [m for m in model.modules() if isinstance(m, PackedLinear)]
    linears = [m for m in model.modules() if isinstance(m, row_invariant.Linear)]
    assert len(linears) == 9  # qkv, o, gate|up, down x 2 layers; the LM head
    assert all(m.cpu_kernel is not None and m.weight.dim() == 3 for m in linears)
    monkeypatch.setenv("DUET_PACK_FP32", "1")
    packing_supported.cache_clear()
    try:
        packed = [m for m in load().modules() if isinstance(m, PackedLinear)]
        assert len(packed) == (9 if packing_supported(torch.float32) else 0)
    finally:
        monkeypatch.delenv("DUET_PACK_FP32")
        packing_supported.cache_clear()


@pytest.mark.slow
@pytest.mark.parametrize("lanes", [8, 4])
def test_other_vector_widths_build_and_keep_the_order(kernel, lanes):
    """The AVX2 (8 lanes: its own transpose) and 4-lane (the portable transpose) builds: close
    to F.linear, rows alone equal rows in a batch."""
    if kernel.simd_lanes() == lanes:
        pytest.skip(f"the native build has {lanes} lanes: the other tests run it")
    other = dense_cpu_linear.build_dense_kernel((f"DUET_SIMD_LANES={lanes}",))
    assert other.simd_lanes() == lanes
    for dtype in DTYPES:
        x, w, b = _case(37, 70, True, dtype, rows=50)
        y = other.dense_linear(x, w, b)
        ref = F.linear(x.double(), w.double(), b.double())
        tol = 4e-3 if dtype == torch.bfloat16 else 1e-6
        assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < tol
        for i in (0, 13, 49):
            assert torch.equal(other.dense_linear(x[i : i + 1], w, b)[0], y[i]), i
        assert torch.equal(other.dense_linear_packed(x, other.pack_dense(w), 37, b), y)


def test_kernels_off_holds_after_the_kernel_was_built(kernel, request):
    """DUET_CPU_KERNELS=0 after a build in the same process: the loaders answer None, and a
    layer stays on torch's product (the cached module was handed out anyway, and a test
    counting a tied head's weights saw the kernel's copy only after another test built it)."""
    from duet.engine.kernels.cpu import load_cpu_kernels
    from duet.engine.quant.cpu_linear import load_quant_kernels

    assert load_dense_kernel() is kernel
    request.getfixturevalue("cpu_kernels_off")
    assert (load_dense_kernel(), load_cpu_kernels(), load_quant_kernels()) == (None, None, None)
    layer = row_invariant.Linear(64, 32, bias=False)
    assert use_dense_kernel_fp32(layer) == 0 and layer.cpu_kernel is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_packing_in_place_gives_the_new_tensors_bits_in_the_weights_storage(kernel, dtype):
    """`pack_dense_` writes pack_dense's layout over the weight's own bytes (whole blocks of
    channels: 16 for column pairs, a panel's otherwise), and where the layout is padded returns
    a new tensor, leaving the weight as it was."""
    block = 16 if kernel.pack_dense(torch.zeros(16, 64, dtype=dtype)).dim() == 4 else None
    block = block or kernel.pack_dense(torch.zeros(1, 16, dtype=dtype)).shape[-1]
    w = torch.randn(3 * block, 96).to(dtype)
    want = kernel.pack_dense(w)
    plain = w.clone()
    got = kernel.pack_dense_(w)
    assert got.data_ptr() == w.data_ptr() and torch.equal(got, want)
    assert not torch.equal(w, plain)  # the weight's bytes are the panels now
    padded = torch.randn(3 * block + 1, 96).to(dtype)
    before = padded.clone()
    got = kernel.pack_dense_(padded)
    assert got.data_ptr() != padded.data_ptr() and torch.equal(got, kernel.pack_dense(before))
    assert torch.equal(padded, before)
