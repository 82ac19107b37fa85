"""gRPC's standard health service (``grpc.health.v1.Health/Check``) on the public gRPC port.

Why here: Kubernetes' gRPC probes and load balancers speak this protocol, not Triton's
``ServerReady``. The answer is what the launcher knows (the server up, no model being replaced),
the same facts as ``/v2/health/ready`` at the door. The two messages are built from their
definition in a private descriptor pool, so no other library's copy is disturbed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

SERVICE = "grpc.health.v1.Health"
SERVING, NOT_SERVING = 1, 2
SERVER_NAMES = ("", "inference.GRPCInferenceService")  # the whole server, as the protocol names it


def _messages() -> tuple[type, type]:
    proto = descriptor_pb2.FileDescriptorProto(name="neopp/grpc_health_v1.proto", package="grpc.health.v1",
                                               syntax="proto3")
    request = proto.message_type.add(name="HealthCheckRequest")
    request.field.add(name="service", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
                      label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)
    response = proto.message_type.add(name="HealthCheckResponse")
    response.field.add(name="status", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_INT32,
                       label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return tuple(message_factory.GetMessageClass(pool.FindMessageTypeByName(f"grpc.health.v1.{name}"))
                 for name in ("HealthCheckRequest", "HealthCheckResponse"))


HealthCheckRequest, HealthCheckResponse = _messages()


def health_handler(first: Callable[..., Any], not_ready: Callable[[], str | None]) -> grpc.GenericRpcHandler:
    """``Check`` answered from ``not_ready()`` (None: SERVING); ``first(messages, context, cls)``
    reads and parses the call's one request, as the front does for every method."""

    async def check(messages: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        request = await first(messages, context, HealthCheckRequest)
        if request.service not in SERVER_NAMES:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no service {request.service[:64]!r}: this server "
                                "answers for the whole server ('')")
        yield HealthCheckResponse(status=SERVING if not_ready() is None else NOT_SERVING).SerializeToString()

    method = grpc.stream_stream_rpc_method_handler(check, request_deserializer=None, response_serializer=None)
    return grpc.method_handlers_generic_handler(SERVICE, {"Check": method})
