"""Building the CPU kernels is safe across processes and checkouts: checkouts of the same code
share one build, compiled from copies whose paths never change (torch rebuilds a name whose
source paths change, over a .so other processes have mapped), other code gets another build,
a lock left by a killed build does not hang the next one, and the build lock dies with its
holder."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch.utils.cpp_extension

from duet.engine.kernels import cpu


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


def _checkout(tmp_path, name: str, edit: bytes = b"") -> str:
    """A copy of engine/kernels' C++ files, as another checkout has them."""
    there = tmp_path / name
    there.mkdir()
    for path in [*cpu._SOURCES, *cpu._HEADERS]:
        data = open(path, "rb").read()
        if edit and path.endswith("cpu_simd.h"):
            data += edit
        (there / os.path.basename(path)).write_bytes(data)
    return str(there)


def test_checkouts_of_the_same_code_share_one_build_from_fixed_paths(
    fake_load, monkeypatch, tmp_path
):
    here = cpu.build_cpu_kernels()
    copies = tmp_path / here / "src"
    mtimes = {f.name: f.stat().st_mtime_ns for f in copies.iterdir()}
    monkeypatch.setattr(cpu, "_DIR", _checkout(tmp_path, "elsewhere"))
    monkeypatch.setattr(
        cpu, "_SOURCES", [os.path.join(cpu._DIR, os.path.basename(p)) for p in cpu._SOURCES]
    )
    monkeypatch.setattr(
        cpu, "_HEADERS", [os.path.join(cpu._DIR, os.path.basename(p)) for p in cpu._HEADERS]
    )
    there = cpu.build_cpu_kernels()
    assert here == there
    first, second = fake_load
    assert first["sources"] == second["sources"]  # torch sees the same build: no rebuild
    assert all(s.startswith(str(copies)) for s in first["sources"])
    # The copies are the checkout's files, untouched by the second build (ninja reads mtimes).
    assert {f.name: f.stat().st_mtime_ns for f in copies.iterdir()} == mtimes
    for path in [*cpu._SOURCES, *cpu._HEADERS]:
        assert (copies / os.path.basename(path)).read_bytes() == open(path, "rb").read()


def test_other_code_builds_under_another_name(fake_load, monkeypatch, tmp_path):
    here = cpu.build_cpu_kernels()
    monkeypatch.setattr(cpu, "_DIR", _checkout(tmp_path, "edited", b"// another header\n"))
    monkeypatch.setattr(
        cpu, "_SOURCES", [os.path.join(cpu._DIR, os.path.basename(p)) for p in cpu._SOURCES]
    )
    monkeypatch.setattr(
        cpu, "_HEADERS", [os.path.join(cpu._DIR, os.path.basename(p)) for p in cpu._HEADERS]
    )
    there = cpu.build_cpu_kernels()
    assert here != there
    header = tmp_path / there / "src" / "cpu_simd.h"
    assert header.read_bytes().endswith(b"// another header\n")
    assert cpu.build_cpu_kernels(("DUET_SIMD_LANES=8",)) not in (here, there)


def test_a_finished_build_is_imported_without_asking_ninja_again(fake_load, monkeypatch, tmp_path):
    imported: list[tuple[str, str]] = []
    monkeypatch.setattr(
        cpu, "_import_built", lambda name, lib: imported.append((name, lib)) or name
    )
    name = cpu.build_cpu_kernels()
    library = tmp_path / name / f"{name}.so"
    assert (tmp_path / name / "duet-built").exists()
    assert cpu.build_cpu_kernels() == name  # no library yet: the build runs again
    assert len(fake_load) == 2 and not imported
    library.write_bytes(b"")  # what the build left
    assert cpu.build_cpu_kernels() == name
    assert len(fake_load) == 2 and imported == [(name, str(library))]
    # A build killed before it finished leaves no marker: it is built again.
    (tmp_path / name / "duet-built").unlink()
    assert cpu.build_cpu_kernels() == name
    assert len(fake_load) == 3


def test_a_lock_left_by_a_killed_build_is_removed(fake_load, tmp_path):
    name = cpu.build_cpu_kernels()
    stale = tmp_path / name / "lock"
    stale.write_text("")  # what torch leaves when its build is killed
    assert cpu.build_cpu_kernels() == name  # the fake load asserts the lock is gone
    assert not stale.exists()


def _hold(path: str, ready) -> None:
    with cpu.exclusive_lock(path, 5):
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
            with cpu.exclusive_lock(path, 0.3):
                pass
    finally:
        holder.kill()
        holder.join(10)
    start = time.monotonic()
    with cpu.exclusive_lock(path, 5):  # free at once: the kernel released the dead holder's lock
        assert time.monotonic() - start < 1.0
