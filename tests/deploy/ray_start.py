"""Ray node start-ups in the test suite, one at a time across xdist workers."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

from duet.engine.kernels.cpu import exclusive_lock

RAY_START_LOCK = Path(tempfile.gettempdir()) / "duet-tests-ray-start.lock"


@contextlib.contextmanager
def one_ray_start_at_a_time(timeout_s: float = 600.0) -> Iterator[None]:
    """Hold the machine-wide lock under which a test starts a Ray node, so the Ray tests'
    nodes (each a module of its own on another xdist worker) never start at the same moment:
    Ray waits a fixed 30 s for a new raylet to register with its GCS (`ray._private.node`),
    and three starting together beside the other tests on 2 cores overran it (`ray start`
    exited, 43 s). Waits `timeout_s` at most for another test's start to finish (the C++
    kernel builds' lock: released by the kernel if its holder dies)."""
    with exclusive_lock(str(RAY_START_LOCK), timeout_s):
        yield
