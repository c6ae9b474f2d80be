"""`start_local_ray`: a Ray instance on this machine for a local duet cluster, with a cluster
secret of its own (cluster_auth) that only this user can read."""

from __future__ import annotations

import os
from pathlib import Path

import ray

from duet.cluster_auth import ENV_SECRET_FILE, ClusterSecret, write_secret_file
from duet.deploy.ray_cluster import NAMESPACE, ClusterSpec

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
    num_prefill = spec.prefill_workers if spec.prefill_workers is not None else 1
    num_decode = spec.decode_workers if spec.decode_workers is not None else 1
    cores = num_cpus or os.cpu_count() or 1
    processes = num_prefill * spec.prefill_tp + num_decode * spec.decode_tp
    secret_file = write_secret_file(ClusterSecret.generate())
    env = {
        "GLOO_SOCKET_IFNAME": "lo",
        "DUET_ADVERTISE_HOST": "127.0.0.1",
        "OMP_NUM_THREADS": str(max(1, cores // max(1, processes))),
        ENV_SECRET_FILE: str(secret_file),  # the path, never the secret: Ray logs runtime envs
    }
    for name in FORWARDED_ENV:  # settings every worker process must share with the driver
        if name in os.environ:
            env[name] = os.environ[name]
    ray.init(
        namespace=NAMESPACE,
        num_cpus=cores,
        resources={
            "prefill": num_prefill * spec.prefill_tp,
            "decode": num_decode * spec.decode_tp,
            "router": spec.routers,
        },
        include_dashboard=False,
        runtime_env={"env_vars": env},
        log_to_driver=True,
    )
    return secret_file
