"""Building the CPU kernels is safe across processes and checkouts: each checkout gets its own
build (two checkouts under one name rebuilt it over each other's mapped .so), a lock left by a
killed build does not hang the next one, and the build lock dies with its holder."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch.utils.cpp_extension

from engine.kernels import cpu


@pytest.fixture
def fake_load(monkeypatch, tmp_path):
    """torch's `load`, recorded instead of compiling; build directories under `tmp_path`."""
    calls: list[dict] = []

    def load(**kwargs):
        assert not os.path.exists(os.path.join(kwargs["build_directory"], "lock"))
        calls.append(kwargs)
        return kwargs["name"]

    def build_directory(name):
        path = tmp_path / name
        path.mkdir(exist_ok=True)
        return str(path)

    monkeypatch.setattr(torch.utils.cpp_extension, "load", load)
    monkeypatch.setattr(cpu, "_build_directory", build_directory)
    return calls


def test_each_checkout_builds_under_its_own_name(fake_load, monkeypatch):
    here = cpu.build_cpu_kernels()
    monkeypatch.setattr(cpu, "_DIR", "/elsewhere/duet/engine/kernels")
    there = cpu.build_cpu_kernels()
    assert here != there
    assert [c["name"] for c in fake_load] == [here, there]
    assert all(c["build_directory"].endswith(c["name"]) for c in fake_load)


def test_a_lock_left_by_a_killed_build_is_removed(fake_load, tmp_path):
    name = cpu.build_cpu_kernels()
    stale = tmp_path / name / "lock"
    stale.write_text("")  # what torch leaves when its build is killed
    assert cpu.build_cpu_kernels() == name  # the fake load asserts the lock is gone
    assert not stale.exists()


def _hold(path: str, ready) -> None:
    with cpu._exclusive(path, 5):
        ready.set()
        time.sleep(60)


def test_the_build_lock_dies_with_its_holder_and_waits_are_bounded(tmp_path):
    path = str(tmp_path / "build.flock")
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    holder = ctx.Process(target=_hold, args=(path, ready), daemon=True)
    holder.start()
    try:
        assert ready.wait(60)
        with pytest.raises(TimeoutError, match=r"build\.flock"):
            with cpu._exclusive(path, 0.3):
                pass
    finally:
        holder.kill()
        holder.join(10)
    start = time.monotonic()
    with cpu._exclusive(path, 5):  # free at once: the kernel released the dead holder's lock
        assert time.monotonic() - start < 1.0
