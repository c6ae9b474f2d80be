"""The local Ray deployment the Ray tests drive: a `ClusterSpec` for a tiny model with free
ports and a SQLite session store, started with its supervisor thread and torn down after."""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import ray

from tests.deploy.ray_start import one_ray_start_at_a_time
from tests.net import free_port
from tests.waiting import wait_for


def cluster_spec(
    model: str,
    store_dir: Path,
    engine: dict[str, Any],
    *,
    prefill_workers: int,
    decode_workers: int,
    **spec: Any,
) -> Any:
    """A `ClusterSpec` serving `model` as "tiny" (local prefill up to 8 tokens, 16 sequences
    per decode worker); `spec` adds or overrides ClusterSpec fields (prefill_tp, kv_backend,
    gpus_per_worker)."""
    from duet.cluster.config import ClusterConfig
    from duet.deploy.cluster_spec import ClusterSpec
    from duet.router.server import RouterConfig

    return ClusterSpec(
        model=model,
        served_model_name="tiny",
        engine=engine,
        prefill_workers=prefill_workers,
        decode_workers=decode_workers,
        router=RouterConfig(port=free_port(), grpc_port=free_port(),
                            session_store_url=f"sqlite:///{store_dir / 's.db'}"),
        cluster=ClusterConfig(local_prefill_threshold=8, poll_interval_s=0.2,
                              num_decode_workers=decode_workers,
                              max_num_seqs_per_decode_worker=16),
        **spec,
    )  # fmt: skip


@contextlib.contextmanager
def running_cluster(spec: Any) -> Iterator[tuple[Any, str]]:
    """Start Ray and the cluster (600 s at most), yield (DuetCluster, router URL); shut both
    down and remove the cluster secret afterwards (checked gone)."""
    from duet.cluster_auth.secret import remove_secret_file
    from duet.deploy.local_ray import start_local_ray
    from duet.deploy.ray_cluster import DuetCluster

    with one_ray_start_at_a_time():
        secret_file = start_local_ray(spec)
    duet = DuetCluster(spec)
    stop = threading.Event()
    try:
        duet.start(timeout_s=600)
        threading.Thread(target=duet.run, args=(stop, 0.5), daemon=True).start()
        url = f"http://127.0.0.1:{spec.router.port}"
        # NOTE: start returns once every actor serves; the routers learn the workers (registry,
        # health checks) after. A request sent before then is a 503 "no decode worker" (seen
        # under a loaded make test), as on any cluster taking traffic before /ready says so.
        wait_for(
            lambda: _knows_every_worker(url, spec), 120, "the routers to know the workers", 0.2
        )
        yield duet, url
    finally:
        stop.set()
        duet.shutdown()
        ray.shutdown()
        remove_secret_file(secret_file)
        assert not secret_file.exists()


def _knows_every_worker(url: str, spec: Any) -> bool:
    """The router at `url` is ready (/ready) and counts the spec's prefill groups and decode
    workers healthy (its /metrics; a data-parallel group's workers each count)."""
    if httpx.get(f"{url}/ready", timeout=10).status_code != 200:
        return False
    text = httpx.get(f"{url}/metrics", timeout=10).text
    want = {"duet:num_prefill_workers": spec.prefill_workers * spec.prefill_dp,
            "duet:num_decode_workers": spec.decode_workers * spec.decode_dp}  # fmt: skip
    for name, count in want.items():
        match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
        if match is None or float(match.group(1)) != count:
            return False
    return True
