"""gRPC server reflection under both of its names: `grpc.reflection.v1alpha.ServerReflection`
(what grpcio-reflection registers) and `grpc.reflection.v1.ServerReflection` (what newer
clients, grpcurl and Postman among them, ask for first).

NOTE: grpcio-reflection ships only v1alpha. The v1 service is the same protocol under a new
package name (its messages have the same fields and numbers), so v1 calls are served by the
same servicer with v1alpha's message classes doing the (identical) wire encoding."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2
from grpc_reflection.v1alpha import reflection_pb2_grpc as v1alpha_grpc

V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"
V1ALPHA_SERVICE_NAME = reflection.SERVICE_NAME


def enable_reflection(server: grpc.aio.Server, service_names: Sequence[str]) -> None:
    """Serve reflection (v1 and v1alpha) on `server`, listing `service_names` and both
    reflection services."""
    names = (*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
    servicer = reflection.aio.ReflectionServicer(names)
    v1alpha_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    handlers = {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
        )
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(V1_SERVICE_NAME, handlers),)
    )
