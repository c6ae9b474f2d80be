"""Fixtures of the engine tests."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.cpu import load_cpu_kernels


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
