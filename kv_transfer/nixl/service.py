"""The membership service (`duet.v1.KVAgent`, proto/duet/v1/kv_agent.proto): how a sender's and
a receiver's NIXL agents meet, on the internal gRPC plane.

The receiver serves it (`KVAgentServer`: a grpc.aio server on a thread of its own, started as
every worker's internal server is, `cluster_auth.internal_server`: each call signed with the
cluster secret, TLS when configured); a sender calls it (`KVAgentClient`, blocking, every call
bounded). With no secret (in-process use and tests) calls are neither signed nor checked.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import grpc

from duet.cluster_auth import ClusterSecret
from duet.cluster_auth.grpc_auth import CallSigner
from duet.cluster_auth.internal_server import start_internal_server
from duet.cluster_auth.tls import SERVER_NAME, add_internal_port, load_internal_tls
from duet.v1 import kv_agent_pb2, kv_agent_pb2_grpc

SERVICE_NAME = kv_agent_pb2.DESCRIPTOR.services_by_name["KVAgent"].full_name
_METHOD = f"/{SERVICE_NAME}/"


class KVAgentServer:
    """Serves `join(KVJoin) -> KVWelcome`, `leave(agent name)`, `ping(agent name) -> known`
    (blocking callables, run off the server's event loop) on `host:port` (0: a free one)."""

    def __init__(
        self,
        host: str,
        port: int,
        secret: ClusterSecret | None,
        join: Callable[[kv_agent_pb2.KVJoin], kv_agent_pb2.KVWelcome],
        leave: Callable[[str], None],
        ping: Callable[[str], bool],
        timeout_s: float,
    ) -> None:
        self._servicer = _Servicer(join, leave, ping)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kv-nixl-agent-grpc", daemon=True
        )
        self._thread.start()
        started: Future[tuple[grpc.aio.Server, int]] = asyncio.run_coroutine_threadsafe(
            self._start(host, port, secret), self._loop
        )
        try:
            self._server, self.port = started.result(timeout_s)
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            raise

    async def _start(
        self, host: str, port: int, secret: ClusterSecret | None
    ) -> tuple[grpc.aio.Server, int]:
        def add(server: grpc.aio.Server) -> None:
            kv_agent_pb2_grpc.add_KVAgentServicer_to_server(self._servicer, server)

        if secret is not None:
            return await start_internal_server("KV agent", SERVICE_NAME, add, host, port, secret)
        server = grpc.aio.server()
        add(server)
        bound = add_internal_port(server, f"{host}:{port}")
        if bound == 0:
            raise OSError(f"KV agent: cannot bind gRPC on {host}:{port}")
        await server.start()
        return server, bound

    def close(self, timeout_s: float = 5.0) -> None:
        async def stop() -> None:
            await self._server.stop(grace=None)

        try:
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout_s)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout_s)


class _Servicer(kv_agent_pb2_grpc.KVAgentServicer):
    def __init__(
        self,
        join: Callable[[kv_agent_pb2.KVJoin], kv_agent_pb2.KVWelcome],
        leave: Callable[[str], None],
        ping: Callable[[str], bool],
    ) -> None:
        self._join, self._leave, self._ping = join, leave, ping

    async def Join(
        self, request: kv_agent_pb2.KVJoin, context: grpc.aio.ServicerContext
    ) -> kv_agent_pb2.KVWelcome:
        return await asyncio.to_thread(self._join, request)

    async def Leave(
        self, request: kv_agent_pb2.KVLeave, context: grpc.aio.ServicerContext
    ) -> kv_agent_pb2.KVLeft:
        await asyncio.to_thread(self._leave, request.agent_name)
        return kv_agent_pb2.KVLeft()

    async def Ping(
        self, request: kv_agent_pb2.KVPing, context: grpc.aio.ServicerContext
    ) -> kv_agent_pb2.KVPong:
        return kv_agent_pb2.KVPong(known=await asyncio.to_thread(self._ping, request.agent_name))


class KVAgentClient:
    """A sender's calls to one receiver's service; each raises `grpc.RpcError` when the
    receiver cannot be reached or does not answer within `timeout_s`."""

    def __init__(self, address: str, secret: ClusterSecret | None, timeout_s: float) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._signer = CallSigner(secret) if secret is not None else None
        tls = load_internal_tls()
        if tls is None:
            self._channel = grpc.insecure_channel(address)
        else:
            self._channel = grpc.secure_channel(
                address,
                tls.channel_credentials(),
                options=[("grpc.ssl_target_name_override", SERVER_NAME)],
            )
        self._stub = kv_agent_pb2_grpc.KVAgentStub(self._channel)

    def _metadata(self, method: str) -> Any:
        return self._signer.metadata(_METHOD + method) if self._signer is not None else None

    def join(self, request: kv_agent_pb2.KVJoin) -> kv_agent_pb2.KVWelcome:
        welcome: kv_agent_pb2.KVWelcome = self._stub.Join(
            request, timeout=self.timeout_s, metadata=self._metadata("Join")
        )
        return welcome

    def leave(self, agent_name: str, timeout_s: float) -> None:
        self._stub.Leave(
            kv_agent_pb2.KVLeave(agent_name=agent_name),
            timeout=timeout_s,
            metadata=self._metadata("Leave"),
        )

    def ping(self, agent_name: str) -> bool:
        pong: kv_agent_pb2.KVPong = self._stub.Ping(
            kv_agent_pb2.KVPing(agent_name=agent_name),
            timeout=self.timeout_s,
            metadata=self._metadata("Ping"),
        )
        return pong.known

    def close(self) -> None:
        self._channel.close()
