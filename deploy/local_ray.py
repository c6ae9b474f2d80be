"""`start_local_ray`: a Ray instance on this machine for a local duet cluster, with a cluster
secret of its own (cluster_auth) that only this user can read.

Ray's own plane stays on this machine: every process Ray starts (GCS, raylet, workers, the
dashboard head, dashboard and runtime-env agents, the autoscaler's metrics) binds loopback, as
Ray does on macOS (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`: a single-node cluster), never every
interface; the dashboard UI is off. Ray's token (it turns token authentication on for a local
cluster) lives in a file only this user reads. Secret directories that a hard-killed run left
behind are removed on the next start.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

import ray
from ray._private import ray_constants

from duet.cluster_auth import ENV_SECRET_FILE, ClusterSecret, write_secret_file
from duet.cluster_auth.secret import remove_stale_secret_dirs
from duet.deploy.cluster_spec import ClusterSpec
from duet.deploy.ray_cluster import NAMESPACE

logger = logging.getLogger(__name__)

LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
"""Read by every Ray process at start: the node's address is loopback and its servers bind
it (Ray 2.60 has no other switch that keeps its gRPC servers off every interface)."""

FORWARDED_ENV = (
    "DUET_KV_EMULATE_NCCL",
    "DUET_KV_NIXL_MODE",
    "DUET_BIND_HOST",
    "DUET_INTERNAL_TLS_CERT",
    "DUET_INTERNAL_TLS_KEY",
    "DUET_INTERNAL_TLS_CA",
)
"""Read by every worker process: the KV transfer's NCCL emulation (both sides of a channel
must agree, or its handshake refuses it), the nixl backend's pull or push mode, where workers listen (deploy/ray_actors.py) and the
internal plane's mTLS files (cluster_auth/tls.py)."""


def start_local_ray(spec: ClusterSpec, num_cpus: int | None = None) -> Path:
    """A Ray instance on this machine with the resources `spec` asks for; workers reach each
    other on loopback (and listen there only) and share its cores (torch threads split evenly
    unless the spec sets `num_threads`). Returns the file holding the cluster's new secret,
    which every Ray process reads (`DUET_CLUSTER_SECRET_FILE`); the caller removes it
    (`cluster_auth.secret.remove_secret_file`) after `ray.shutdown()`."""
    for stale in remove_stale_secret_dirs():
        logger.info("removed %s: its duet serve was killed before it could", stale)
    secure_ray_token()
    num_prefill = spec.prefill_workers if spec.prefill_workers is not None else 1
    num_decode = spec.decode_workers if spec.decode_workers is not None else 1
    cores = num_cpus or os.cpu_count() or 1
    processes = num_prefill * spec.prefill_ranks + num_decode * spec.decode_ranks
    secret_file = write_secret_file(ClusterSecret.generate())
    env = {
        "GLOO_SOCKET_IFNAME": "lo",
        "DUET_ADVERTISE_HOST": "127.0.0.1",
        "OMP_NUM_THREADS": str(max(1, cores // max(1, processes))),
        # NOTE: Ray runs its workers at niceness 15 (RayConfig worker_niceness), which on a
        # box with other busy processes starves duet's engine and router actors: in a loaded
        # make test every rank of a 2x2 cluster answered its supervisor's `info` later than
        # the 5 s a pass waits, pass after pass for 600 s, so no group was ever started. The
        # workers are this machine's service: the priority of any other process.
        "RAY_worker_niceness": "0",
        ENV_SECRET_FILE: str(secret_file),  # the path, never the secret: Ray logs runtime envs
    }
    for name in FORWARDED_ENV:  # settings every worker process must share with the driver
        if name in os.environ:
            env[name] = os.environ[name]
    saved_env = {name: os.environ.get(name) for name in LOOPBACK_ENV}
    saved_cluster = ray_constants.ENABLE_RAY_CLUSTER
    os.environ.update(LOOPBACK_ENV)  # Ray's processes, started by ray.init, inherit it
    # NOTE: this process read the variable when it imported Ray; its node address comes from
    # this constant, read while ray.init runs. Both go back afterwards.
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(
            namespace=NAMESPACE,
            num_cpus=cores,
            resources={
                "prefill": num_prefill * spec.prefill_ranks,
                "decode": num_decode * spec.decode_ranks,
                "router": spec.routers,
            },
            include_dashboard=False,
            runtime_env={"env_vars": env},
            log_to_driver=True,
        )
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_cluster
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return secret_file


def secure_ray_token(home: Path | None = None) -> Path | None:
    """Ray 2.60 turns token authentication on for a local cluster and saves the token it makes
    to `~/.ray/auth_token` with the umask's mode (0644: every user on the machine could read
    it). Make that file first, or tighten it, so only this user reads it; Ray then uses it.
    Returns the file, or None where the user chose otherwise (`RAY_AUTH_TOKEN`,
    `RAY_AUTH_TOKEN_PATH`, or `RAY_AUTH_MODE` other than token)."""
    mode = os.environ.get("RAY_AUTH_MODE", "token").lower()
    if mode != "token" or "RAY_AUTH_TOKEN" in os.environ or "RAY_AUTH_TOKEN_PATH" in os.environ:
        return None
    path = (home or Path.home()) / ".ray" / "auth_token"
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        if path.stat().st_mode & 0o077:
            logger.warning("%s was readable by other users; now 0600", path)
            path.chmod(0o600)
        return path
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))  # what Ray itself makes: 256 bits
    return path
