"""Starting a worker's internal gRPC server: the cluster-secret interceptor on every call
(health checks stay open), the health service, TLS when configured (`tls.py`)."""

from __future__ import annotations

from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from duet.cluster_auth.grpc_auth import AuthInterceptor
from duet.cluster_auth.secret import ClusterSecret, load_cluster_secret
from duet.cluster_auth.tls import add_internal_port


async def start_internal_server(
    what: str,
    service_name: str,
    add_servicer: Callable[[grpc.aio.Server], None],
    host: str,
    port: int,
    secret: ClusterSecret | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Serve what `add_servicer` registers on `host:port` (0: a free port), refusing calls
    without credentials of `secret` (default: this process's cluster secret), and report
    `service_name` (and the server as a whole) SERVING. `what` names the server in errors
    ("decode worker"). Returns the started server and its port."""
    auth = AuthInterceptor(secret or load_cluster_secret(), f"{what} gRPC")
    server = grpc.aio.server(interceptors=[auth])
    add_servicer(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = add_internal_port(server, f"{host}:{port}")
    if bound == 0:
        raise OSError(f"{what}: cannot bind gRPC on {host}:{port}")
    await server.start()
    for name in ("", service_name):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound
