"""`python -m duet.engine.kernels.prebuild` (run by `make install`): every kernel module the
engine loads by default is built or found, and one that cannot be is reported, not fatal."""

from __future__ import annotations

import subprocess
import sys


def test_every_default_kernel_module_is_ready() -> None:
    from duet.engine.kernels.prebuild import kernels, prebuild

    assert set(kernels()) == {
        "duet_cpu_kernels", "duet_dense_linear", "duet_quant_linear", "duet_shm_collectives",
    }  # fmt: skip
    assert prebuild() == dict.fromkeys(kernels(), True)  # built by make install: loads now


def test_kernels_turned_off_are_reported_and_the_run_succeeds() -> None:
    env = {"DUET_CPU_KERNELS": "0", "PATH": "/usr/bin:/bin"}
    run = subprocess.run(
        [sys.executable, "-m", "duet.engine.kernels.prebuild"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.startswith("duet_")]
    assert len(lines) == 4 and all("unavailable (torch's paths serve)" in x for x in lines)
