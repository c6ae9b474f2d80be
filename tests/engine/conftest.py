"""Fixtures of the engine tests."""

from __future__ import annotations

import pytest

from engine.kernels.cpu import load_cpu_kernels


@pytest.fixture(scope="module")
def kernels():
    module = load_cpu_kernels()
    if module is None:
        pytest.fail("the C++ CPU kernels did not build (g++ and ninja are project dependencies)")
    return module
