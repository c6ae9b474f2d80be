"""Ray hygiene of a local cluster (deploy/local_ray.py): every process Ray starts listens on
loopback only, its token file is private, its workers are not deprioritised, and the secret
directory a killed run left behind is gone after the next start (one a live process owns is
kept)."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import psutil
import pytest
import ray

from duet.cluster_auth.secret import OWNER_FILE, remove_secret_file, remove_stale_secret_dirs
from duet.deploy.cluster_spec import ClusterSpec
from duet.deploy.local_ray import secure_ray_token, start_local_ray
from tests.deploy.ray_start import one_ray_start_at_a_time


def _niceness() -> int:
    return os.nice(0)


def _secret_dir(owner_pid: int) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="duet-secret-"))
    (folder / OWNER_FILE).write_text(str(owner_pid))
    (folder / "cluster-secret").write_text("x" * 64)
    return folder


def test_ray_listens_on_loopback_only_and_stale_secrets_go(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE"):
        monkeypatch.delenv(name, raising=False)
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale, live = _secret_dir(dead.pid), _secret_dir(os.getppid())
    with one_ray_start_at_a_time():
        spec = ClusterSpec(model="unused", prefill_workers=0, decode_workers=1)
        secret_file = start_local_ray(spec)
    try:
        me = psutil.Process()
        ray_pids = {p.pid for p in me.children(recursive=True)} | {me.pid}
        listening = {
            (c.laddr.ip.removeprefix("::ffff:"), c.pid)
            for c in psutil.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.pid in ray_pids
        }
        assert len({pid for _, pid in listening}) >= 4  # GCS, raylet, agents, this driver
        assert {ip for ip, _ in listening} == {"127.0.0.1"}
        token = Path.home() / ".ray" / "auth_token"
        assert token.stat().st_mode & 0o777 == 0o600
        assert not stale.exists() and live.exists()
        assert os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") is None  # restored
        # duet's workers run at the machine's priority, not Ray's niceness 15 (starved beside
        # busy processes, a cluster never formed)
        assert ray.get(ray.remote(num_cpus=0)(_niceness).remote(), timeout=120) == 0
    finally:
        ray.shutdown()
        remove_secret_file(secret_file)
        remove_secret_file(live / "cluster-secret")
    assert not secret_file.parent.exists() and not live.exists()


def test_the_ray_token_is_made_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE"):
        monkeypatch.delenv(name, raising=False)
    made = secure_ray_token(tmp_path)
    assert made == tmp_path / ".ray" / "auth_token"
    assert made.stat().st_mode & 0o777 == 0o600 and len(made.read_text()) == 64
    made.chmod(0o644)  # as Ray 2.60 writes it
    assert secure_ray_token(tmp_path) == made
    assert made.stat().st_mode & 0o777 == 0o600
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert secure_ray_token(tmp_path / "other") is None
    assert not (tmp_path / "other").exists()


def test_only_dead_owners_secret_dirs_are_removed(tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / "duet-secret-a"
    live = tmp_path / "duet-secret-b"
    unknown = tmp_path / "duet-secret-c"  # an older duet's: no owner file
    for folder, owner in ((stale, dead.pid), (live, os.getpid()), (unknown, None)):
        folder.mkdir()
        if owner is not None:
            (folder / OWNER_FILE).write_text(str(owner))
    assert remove_stale_secret_dirs(str(tmp_path)) == [stale]
    assert (stale.exists(), live.exists(), unknown.exists()) == (False, True, True)
