"""The Ray actors that host duet's processes: a prefill worker rank, a decode worker rank, a
router.

Each actor runs its gRPC (and, for the router, REST) server on an event loop of its own in a
background thread, so Ray method calls (`info`, `start`, `set_workers`) stay answerable while
requests are served. Actors are created with `max_restarts=-1` by the controller
(`deploy.ray_cluster`): Ray restarts a dead one, and a restarted actor reports a new
`incarnation` so the controller knows to re-form its group and re-publish its address.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import uuid
from collections.abc import Coroutine
from typing import Any, TypeVar

from duet.engine.heap import freeze_startup_heap

T = TypeVar("T")

_START_TIMEOUT_S = 600.0


class _LoopThread:
    """An asyncio loop on a daemon thread."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name=name, daemon=True).start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = _START_TIMEOUT_S) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)


def advertise_host() -> str:
    """The address other processes reach this one at: DUET_ADVERTISE_HOST, else Ray's."""
    host = os.environ.get("DUET_ADVERTISE_HOST")
    if host:
        return host
    import ray

    return str(ray.util.get_node_ip_address())


def bind_host() -> str:
    """Where worker listeners (gRPC, KV) bind: DUET_BIND_HOST, else the advertised address
    (loopback on a local cluster, the pod IP on Kubernetes), never every interface unless
    DUET_BIND_HOST=0.0.0.0 asks for it."""
    return os.environ.get("DUET_BIND_HOST") or advertise_host()


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class _RankActor:
    """One rank of a worker group (a prefill group, or a tensor-parallel decode worker), or
    one worker of a data-parallel group (`data_parallel_size` in its config). `start` joins the
    group (every rank must be started, with the same init method) and, on rank 0 (on every
    data-parallel worker), serves the worker's gRPC service."""

    role = ""

    def __init__(self, config: dict[str, Any], rank: int, name: str) -> None:
        self.config = config
        self.rank = rank
        self.name = name
        self.incarnation = uuid.uuid4().hex
        self.host = advertise_host()
        self.worker: Any = None
        self.address: str | None = None

    def rendezvous(self) -> str:
        """An init method for the group, on this (rank 0's) node."""
        return f"tcp://{self.host}:{_free_port(self.host)}"

    @property
    def worker_name(self) -> str:
        """A data-parallel group's workers are workers of their own: `{group}-dp{rank}`."""
        peered = self.config.get("data_parallel_size", 1) > 1
        return f"{self.name}-dp{self.rank}" if peered else self.name

    def start(self, init_method: str | None) -> str | None:
        self.worker = self._start_rank(init_method)
        if self.rank == 0 or self.config.get("data_parallel_size", 1) > 1:
            # NOTE: keep the server referenced: a collected grpc.aio server stops serving.
            self._loop = _LoopThread(f"{self.name}-grpc")
            self._server, port = self._loop.run(self._serve(bind_host()))
            self.address = f"{self.host}:{port}"
        freeze_startup_heap()
        return self.address

    def _start_rank(self, init_method: str | None) -> Any:
        raise NotImplementedError

    async def _serve(self, host: str) -> tuple[Any, int]:
        raise NotImplementedError

    def info(self) -> dict[str, Any]:
        return {
            "incarnation": self.incarnation,
            "started": self.worker is not None,
            "alive": self.worker is not None and self.worker.is_running,
            "address": self.address,
        }


class PrefillRankActor(_RankActor):
    """One rank of a prefill group; rank 0 serves `duet.v1.PrefillWorker`."""

    role = "prefill"

    def _start_rank(self, init_method: str | None) -> Any:
        from duet.prefill_worker.config import PrefillWorkerConfig
        from duet.prefill_worker.launch import start_prefill_rank

        config = PrefillWorkerConfig.from_kwargs(**self.config)
        return start_prefill_rank(config, self.rank, init_method, self.worker_name)

    async def _serve(self, host: str) -> tuple[Any, int]:
        from duet.prefill_worker.server import start_prefill_server

        return await start_prefill_server(self.worker, host, 0)


class DecodeRankActor(_RankActor):
    """One rank of a decode worker (one rank unless `tensor_parallel_size` says more); rank 0
    serves `duet.v1.DecodeWorker`. Every rank's KV receiver listens on `bind_host()` and
    advertises this node's address."""

    role = "decode"

    def _start_rank(self, init_method: str | None) -> Any:
        from duet.decode_worker.config import DecodeWorkerConfig
        from duet.decode_worker.launch import start_decode_rank

        config = {**self.config, "kv_host": bind_host(), "kv_advertise_host": self.host}
        return start_decode_rank(
            DecodeWorkerConfig.from_kwargs(**config), self.rank, init_method, self.worker_name
        )

    async def _serve(self, host: str) -> tuple[Any, int]:
        from duet.decode_worker.server import start_decode_server

        return await start_decode_server(self.worker, host, 0)


class RouterActor:
    """The REST and gRPC front ends over a `ClusterEngine`. Several routers may share one
    host's ports (SO_REUSEPORT): the kernel spreads connections over them."""

    def __init__(
        self,
        model: str | None,
        router_config: Any,  # router.server.RouterConfig
        cluster_config: Any,  # duet.cluster.config.ClusterConfig
        served_model_name: str | list[str] | None,
        tokenizer: str | None,
        max_model_len: int | None,
    ) -> None:
        from duet.cluster.engine import ClusterEngine
        from duet.router.server import RouterServer, bind_rest_socket

        self.incarnation = uuid.uuid4().hex
        self.engine = ClusterEngine(model, cluster_config, tokenizer, max_model_len)
        rest_socket = bind_rest_socket(router_config.host, router_config.port, reuse_port=True)
        self.rest_port = rest_socket.getsockname()[1]
        names = served_model_name or self.engine.model_name
        self.server = RouterServer(self.engine, names, router_config, rest_socket)
        freeze_startup_heap()
        self._thread = threading.Thread(target=self.server.run, name="duet-router", daemon=True)
        self._thread.start()

    def set_workers(self, prefill: dict[str, str], decode: dict[str, str]) -> None:
        self.engine.pool.set_workers(prefill, decode)

    def info(self) -> dict[str, Any]:
        return {
            "incarnation": self.incarnation,
            "started": bool(self.server.started),
            "alive": self._thread.is_alive(),
            "rest_port": self.rest_port,
            "grpc_port": self.server.grpc_port,
            "ready": self.engine.is_ready,
        }

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)
