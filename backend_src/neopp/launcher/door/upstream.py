"""The door's two ways into Triton.

* gRPC (``grpc.aio``) for inference and model metadata: a cancelled call cancels the request in
  Triton, which is how a client that hangs up over HTTP stops its generation. With an API key,
  inference calls carry it as Triton's restricted-protocol header wants it.
* Triton's own HTTP for the control routes (health, metadata, config, statistics, the
  administrative APIs): under the launcher a Unix socket no other local user can open
  (neopp.launcher.inner_http), else a loopback port that answers only requests carrying a front
  key; the door sends it only bodies it serialised itself. Each exchange runs on the event loop (h11 over an
  asyncio connection), so no pool of threads can be used up and make a health check wait.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import h11
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from ...contract.client_lanes import PARAMETER as LANE_PARAMETER
from ...contract.statuses import RETRY_AFTER, http_status, is_full
from ..admin import FRONT_HEADER, GRPC_HEADER, KEY_HEADER, inference_metadata
from ..inner_http import socket_path
from .client_load import Turn
from .door_error import DoorError
from .spliced_request import WireRequest

MAX_MESSAGE = 1 << 30
CONTROL_TIMEOUT_S = 600.0  # a model load answers when it is done
RETRY_UNAVAILABLE_S = 2  # a stub is reloaded in seconds, a server restarted in tens of them
CLOSE_TIMEOUT_S = 10.0  # a closed stream whose call Triton has not ended by then is cancelled


class UpstreamStream:
    """One request's ``ModelStreamInfer`` call. A whole answer is closed, not cancelled: a
    cancellation that reaches Triton just after the final response can leave that request's
    state behind, and the model it ran on then never unloads (a stop waits out its exit timeout)."""

    closing: set[asyncio.Task] = set()  # the closes under way, kept until done

    def __init__(self, call: grpc.aio.StreamStreamCall, sent: asyncio.Event) -> None:
        self.call, self._sent = call, sent

    async def read(self) -> pb.ModelStreamInferResponse | object:
        return await self.call.read()

    def cancel(self) -> None:
        """The client left, or the answer was refused: Triton stops the request."""
        self.call.cancel()

    def close(self) -> None:
        """The final response came: end the request side and let Triton end the call (bounded)."""
        self._sent.set()
        task = asyncio.ensure_future(self._drained())
        UpstreamStream.closing.add(task)
        task.add_done_callback(UpstreamStream.closing.discard)

    async def _drained(self) -> None:
        try:
            await asyncio.wait_for(self._until_eof(), CLOSE_TIMEOUT_S)
        except (asyncio.TimeoutError, grpc.aio.AioRpcError, asyncio.CancelledError):
            self.call.cancel()

    async def _until_eof(self) -> None:
        while await self.call.read() is not grpc.aio.EOF:
            pass


def grpc_error(exc: grpc.aio.AioRpcError) -> DoorError:
    """A Triton error as the door's answer; a full model queue or session table is 429 with Retry-After."""
    message = exc.details() or exc.code().name
    full = is_full(message) if exc.code() == grpc.StatusCode.UNAVAILABLE else None
    if full is not None:
        wait = RETRY_AFTER.search(message)
        return DoorError(429, message, reason=full, headers={"Retry-After": wait.group(1) if wait else "1"})
    if exc.code() == grpc.StatusCode.UNAVAILABLE:  # gRPC's "try again": the server or its engine is
        # going or coming back (a connection refused before the launcher has seen the exit, too)
        return DoorError(503, message, reason="upstream", headers={"Retry-After": str(RETRY_UNAVAILABLE_S)})
    return DoorError(http_status(exc.code().name), message, reason="upstream")


def in_turn(wire: WireRequest, turn: Turn) -> WireRequest:
    """The request with the lane and priority the door chose for its client (a client's own are replaced)."""
    wire.message.parameters[LANE_PARAMETER].string_param = turn.lane
    wire.message.parameters["priority"].uint64_param = turn.priority
    return wire


@dataclass
class ControlResponse:
    status: int
    body: bytes
    content_type: str


class Upstream:
    """One gRPC channel (made on the door's event loop) and Triton's own HTTP: ``(host, port)`` or
    ``unix:<path>``."""

    def __init__(self, grpc_target: str, http_address: tuple[str, int] | str, front_key: str | None,
                 api_key: str | None = None) -> None:
        self.grpc_target, self.http_address, self.front_key = grpc_target, http_address, front_key
        self.inference_metadata = inference_metadata(api_key)
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.GRPCInferenceServiceStub | None = None
        self._infer_wire: grpc.aio.UnaryUnaryMultiCallable | None = None
        self._stream_wire: grpc.aio.StreamStreamMultiCallable | None = None

    def _connect(self) -> None:
        if self._channel is not None:
            return
        options = [("grpc.max_send_message_length", MAX_MESSAGE), ("grpc.max_receive_message_length", MAX_MESSAGE)]
        self._channel = grpc.aio.insecure_channel(self.grpc_target, options=options)
        self._stub = pb_grpc.GRPCInferenceServiceStub(self._channel)
        self._infer_wire = self._channel.unary_unary(  # takes the bytes the door serialised itself
            "/inference.GRPCInferenceService/ModelInfer", request_serializer=None,
            response_deserializer=pb.ModelInferResponse.FromString)
        self._stream_wire = self._channel.stream_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer", request_serializer=None,
            response_deserializer=pb.ModelStreamInferResponse.FromString)

    @property
    def stub(self) -> pb_grpc.GRPCInferenceServiceStub:
        self._connect()
        return self._stub

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel, self._stub, self._infer_wire, self._stream_wire = None, None, None, None

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
        return sorted(name for name, state in (await self.model_states(admin_key)).items() if state == "READY")

    async def model_states(self, admin_key: str | None) -> dict[str, str]:
        """Every model of the repository and its state (READY, UNAVAILABLE, LOADING, or "")."""
        metadata = [(GRPC_HEADER, admin_key)] if admin_key else None
        try:
            index = await self.stub.RepositoryIndex(pb.RepositoryIndexRequest(ready=False), metadata=metadata,
                                                    timeout=30)
        except grpc.aio.AioRpcError as exc:
            raise grpc_error(exc) from None
        return {model.name: model.state for model in index.models}

    def infer(self, request: WireRequest, turn: Turn) -> grpc.aio.UnaryUnaryCall:
        """The call itself, so that the caller can cancel it; it waits where ``turn`` says."""
        self._connect()
        return self._infer_wire(in_turn(request, turn).serialize(), metadata=self.inference_metadata)

    def stream(self, wire: WireRequest, turn: Turn) -> UpstreamStream:
        """A stream carrying this one request (waiting where ``turn`` says); its responses end with the final flag."""
        request, sent = in_turn(wire, turn).serialize(), asyncio.Event()

        async def one() -> AsyncIterator[bytes]:
            yield request
            await sent.wait()  # open until the answer is whole (then closed) or the caller cancels

        self._connect()
        return UpstreamStream(self._stream_wire(one(), metadata=self.inference_metadata), sent)

    async def control(self, method: str, path: str, body: bytes | None, admin_key: str | None) -> ControlResponse:
        """One request to Triton's own HTTP, with the front key if any (and the caller's admin key)."""
        host = "localhost" if isinstance(self.http_address, str) else f"{self.http_address[0]}:{self.http_address[1]}"
        headers = [("Host", host), ("Content-Length", str(len(body or b""))), ("Connection", "close")]
        if self.front_key is not None:
            headers.append((FRONT_HEADER, self.front_key))
        if admin_key is not None:
            headers.append((KEY_HEADER, admin_key))
        if body is not None:
            headers.append(("Content-Type", "application/json"))
        try:
            return await asyncio.wait_for(self._exchange(h11.Request(method=method, target=path, headers=headers),
                                                         body or b""), CONTROL_TIMEOUT_S)
        except (OSError, h11.ProtocolError, asyncio.TimeoutError) as exc:
            raise DoorError(503, f"the server is not reachable: {exc or type(exc).__name__}",
                            reason="upstream_down") from None

    async def _exchange(self, request: h11.Request, body: bytes) -> ControlResponse:
        if isinstance(self.http_address, str):
            reader, writer = await asyncio.open_unix_connection(socket_path(self.http_address))
        else:
            reader, writer = await asyncio.open_connection(*self.http_address)
        conn, status, content_type, parts = h11.Connection(h11.CLIENT), 0, "application/json", []
        try:
            writer.write(conn.send(request) + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
            await writer.drain()
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await reader.read(1 << 16))
                elif isinstance(event, h11.Response):
                    status = event.status_code
                    content_type = dict(event.headers).get(b"content-type", b"application/json").decode("latin-1")
                elif isinstance(event, h11.Data):
                    parts.append(event.data)
                elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                    return ControlResponse(status, b"".join(parts), content_type)
        finally:
            writer.close()
