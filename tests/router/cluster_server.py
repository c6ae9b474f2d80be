"""A disaggregated server for tests that drive it from the outside (a browser, HTTP): the
`Cluster` of tests/cluster/test_cluster_engine.py (real prefill and decode workers, gRPC on
loopback, no Ray) and `make_app` (build_app over a front door) over its ClusterEngine, served by uvicorn, all on one event
loop in a background thread."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

import uvicorn

from tests.cluster.test_cluster_engine import Cluster
from tests.router.rest_server import API_KEY, MODEL_NAME, make_app

T = TypeVar("T")


class ClusterServer:
    def __init__(self, model: str, app_args: dict[str, Any] | None = None, **cluster: Any) -> None:
        """`app_args`: more `RouterOptions` fields; `cluster`: `Cluster`'s."""
        self._model = model
        self._app_args = app_args or {}
        self._cluster_args = cluster
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._loop = asyncio.new_event_loop()
        self._ready: Future[None] = Future()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._loop.run_until_complete,
                                        args=(self._main(),), daemon=True)  # fmt: skip
        self.cluster: Cluster | None = None
        self.app: Any = None

    def start(self, timeout_s: float = 60.0) -> ClusterServer:
        self._thread.start()
        self._ready.result(timeout_s)
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout_s)
        self._sock.close()

    def call(self, fn: Callable[[], Coroutine[Any, Any, T]], timeout_s: float = 30.0) -> T:
        """Run a coroutine on the server's loop (where the cluster lives) and return its result."""
        return asyncio.run_coroutine_threadsafe(fn(), self._loop).result(timeout_s)

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        try:
            async with Cluster(self._model, **self._cluster_args) as cluster:
                self.cluster = cluster
                self.app = make_app(cluster.engine, MODEL_NAME, api_keys=[API_KEY],
                                     metrics_prefix="vllm", **self._app_args)  # fmt: skip
                server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
                serving = asyncio.create_task(server.serve(sockets=[self._sock]))
                async with asyncio.timeout(30):
                    while not server.started:
                        await asyncio.sleep(0.02)
                self._ready.set_result(None)
                await self._stop.wait()
                server.should_exit = True
                await asyncio.wait_for(serving, 30)
        except BaseException as e:
            if not self._ready.done():
                self._ready.set_exception(e)
            raise
