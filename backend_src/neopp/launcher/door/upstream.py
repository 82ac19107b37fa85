"""The door's two ways into Triton, both on loopback.

* gRPC (``grpc.aio``) for inference and model metadata: a cancelled call cancels the request in
  Triton, which is how a client that hangs up over HTTP stops its generation.
* Triton's own HTTP port for the control routes (health, metadata, config, statistics, the
  administrative APIs): it answers only requests carrying this run's front key, and the door
  sends it only bodies it serialised itself.
"""

from __future__ import annotations

import asyncio
import http.client
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from ..admin import FRONT_HEADER, GRPC_HEADER, KEY_HEADER
from .errors import DoorError
from .wire import WireRequest

MAX_MESSAGE = 1 << 30
# gRPC status -> HTTP status, as Triton's HTTP endpoint answers for the same error.
HTTP_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.NOT_FOUND: 404,
               grpc.StatusCode.ALREADY_EXISTS: 409, grpc.StatusCode.UNAVAILABLE: 503,
               grpc.StatusCode.UNIMPLEMENTED: 501, grpc.StatusCode.UNAUTHENTICATED: 401,
               grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
               grpc.StatusCode.CANCELLED: 499, grpc.StatusCode.RESOURCE_EXHAUSTED: 429}
QUEUE_FULL = "Exceeds maximum queue size"
SESSIONS_FULL = "session limit reached"  # neopp_session's refusal of a new session (it says when to retry)
RETRY_AFTER = re.compile(r"retry after (\d{1,6}) s")


def grpc_error(exc: grpc.aio.AioRpcError) -> DoorError:
    """A Triton error as the door's answer; a full model queue or session table is 429 with Retry-After."""
    message = exc.details() or exc.code().name
    if exc.code() == grpc.StatusCode.UNAVAILABLE and (QUEUE_FULL in message or SESSIONS_FULL in message):
        wait = RETRY_AFTER.search(message)
        return DoorError(429, message, reason="queue_full" if QUEUE_FULL in message else "sessions_full",
                         headers={"Retry-After": wait.group(1) if wait else "1"})
    status = HTTP_STATUS.get(exc.code(), 400 if exc.code() == grpc.StatusCode.UNKNOWN else 500)
    return DoorError(status, message, reason="upstream")


@dataclass
class ControlResponse:
    status: int
    body: bytes
    content_type: str


class Upstream:
    """One gRPC channel (made on the door's event loop) and the loopback HTTP address."""

    def __init__(self, grpc_target: str, http_address: tuple[str, int], front_key: str) -> None:
        self.grpc_target, self.http_address, self.front_key = grpc_target, http_address, front_key
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.GRPCInferenceServiceStub | None = None
        self._infer_wire: grpc.aio.UnaryUnaryMultiCallable | None = None

    def _connect(self) -> None:
        if self._channel is not None:
            return
        options = [("grpc.max_send_message_length", MAX_MESSAGE), ("grpc.max_receive_message_length", MAX_MESSAGE)]
        self._channel = grpc.aio.insecure_channel(self.grpc_target, options=options)
        self._stub = pb_grpc.GRPCInferenceServiceStub(self._channel)
        self._infer_wire = self._channel.unary_unary(  # takes the bytes the door serialised itself
            "/inference.GRPCInferenceService/ModelInfer", request_serializer=None,
            response_deserializer=pb.ModelInferResponse.FromString)

    @property
    def stub(self) -> pb_grpc.GRPCInferenceServiceStub:
        self._connect()
        return self._stub

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel, self._stub, self._infer_wire = None, None, None

    async def metadata(self, model: str, version: str) -> pb.ModelMetadataResponse:
        try:
            return await self.stub.ModelMetadata(pb.ModelMetadataRequest(name=model, version=version), timeout=30)
        except grpc.aio.AioRpcError as exc:
            raise grpc_error(exc) from None

    async def register_region(self, name: str, key: str, size: int, admin_key: str | None) -> None:
        """Register a system shared-memory region with Triton (the operator key where restricted)."""
        metadata = [(GRPC_HEADER, admin_key)] if admin_key else None
        request = pb.SystemSharedMemoryRegisterRequest(name=name, key=key, offset=0, byte_size=size)
        await self.stub.SystemSharedMemoryRegister(request, metadata=metadata, timeout=30)

    async def ready_models(self, admin_key: str | None) -> list[str]:
        """Names of the models the server has READY (the repository index; the key where restricted)."""
        metadata = [(GRPC_HEADER, admin_key)] if admin_key else None
        try:
            index = await self.stub.RepositoryIndex(pb.RepositoryIndexRequest(ready=True), metadata=metadata,
                                                    timeout=30)
        except grpc.aio.AioRpcError as exc:
            raise grpc_error(exc) from None
        return sorted(model.name for model in index.models)

    def infer(self, request: WireRequest) -> grpc.aio.UnaryUnaryCall:
        """The call itself, so that the caller can cancel it."""
        self._connect()
        return self._infer_wire(request.serialize())

    def stream(self, wire: WireRequest) -> grpc.aio.StreamStreamCall:
        """A stream carrying this one request; its responses end with the final flag."""
        request = wire.to_message()

        async def one() -> AsyncIterator[pb.ModelInferRequest]:
            yield request
            await asyncio.Event().wait()  # keep the stream open until the caller cancels or finishes

        return self.stub.ModelStreamInfer(one())

    async def control(self, method: str, path: str, body: bytes | None, admin_key: str | None) -> ControlResponse:
        """One request to Triton's own HTTP port, with the front key (and the caller's admin key)."""
        return await asyncio.to_thread(self._control, method, path, body, admin_key)

    def _control(self, method: str, path: str, body: bytes | None, admin_key: str | None) -> ControlResponse:
        headers = {FRONT_HEADER: self.front_key}
        if admin_key is not None:
            headers[KEY_HEADER] = admin_key
        if body is not None:
            headers["Content-Type"] = "application/json"
        conn = http.client.HTTPConnection(*self.http_address, timeout=600)
        try:
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            return ControlResponse(resp.status, resp.read(), resp.getheader("Content-Type") or "application/json")
        except (OSError, http.client.HTTPException) as exc:
            raise DoorError(503, f"the server is not reachable: {exc}", reason="upstream_down") from None
        finally:
            conn.close()
