"""Fixtures of the engine tests."""

from __future__ import annotations

import pytest
import torch

from duet.engine.kernels.cpu import load_cpu_kernels


@pytest.fixture(scope="module")
def kernels():
    module = load_cpu_kernels()
    if module is None:
        pytest.fail("the C++ CPU kernels did not build (g++ and ninja are project dependencies)")
    return module


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """torch's intra-op threads set to 1 and to 2 (restored afterwards)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture(params=["fma", "amx"])
def attention_order(request, kernels):
    """bf16 paged attention in each order the CPU can run: the FMA order (attention_order.h)
    everywhere, the AMX order (attention_amx.h) where the CPU has AMX tiles. Restores the
    default (AMX where available) afterwards."""
    if request.param == "amx" and not kernels.attention_amx_used(64, 16):
        pytest.skip("this CPU has no AMX tiles: bf16 attention runs the FMA order only")
    kernels.attention_amx(request.param == "amx")
    yield request.param
    kernels.attention_amx(True)
