"""The public gRPC port: Triton's inference service, relayed to Triton's own gRPC socket.

Why a relay rather than Triton's gRPC port itself:

* An instance whose stub died is answered by Triton 2.51 with INTERNAL "Stub process ... is not
  healthy" until the launcher has reloaded it, and a client cannot tell that from a bug. The
  front answers UNAVAILABLE (retry) for every model the launcher knows is being replaced, before
  Triton sees the request, and for Triton's own words of a gone instance.
* Triton's gRPC on TCP is open to every local user; under the launcher it listens on a Unix
  socket in the launcher's private directory, like its HTTP (neopp.launcher.inner_http), so the
  launcher's two fronts are the only ways in.
* Triton takes gRPC messages up to 2 GiB with no option to lower it; the front takes at most the
  door's body bound.

Each request is parsed once (protobuf, unknown fields dropped) and Triton gets the message the
front serialised from it, never the client's bytes; Triton's answers, which the server produced,
pass as they are. Every header a client sent that is not gRPC's own goes on, so Triton's
restricted protocols (the operator and API keys) judge it as before. A client that hangs up
cancels the relayed call, so Triton cancels the request.
"""

from __future__ import annotations

import asyncio
import hmac
import threading
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from tritonclient.grpc import service_pb2 as pb

from ...contract.statuses import status_of_message
from ..admin import GRPC_API_KEY_HEADER
from ..health import loop_answers, recovering
from .client_load import ClientLoad
from .door_error import DoorError

SERVICE = "inference.GRPCInferenceService"
MAX_ANSWER = 1 << 30  # what Triton may send back (images; a model's config)
_DROPPED_HEADERS = ("content-type", "te", "user-agent", "host")
_END = object()
_UNPARSED = object()  # a stream's message that did not parse
INFERENCE = ("ModelInfer", "ModelStreamInfer")
# Triton's own answer to a restricted protocol without its header, word for word and with its status
UNKEYED = f"This protocol is restricted, expecting header '{GRPC_API_KEY_HEADER}'"


def _message_class(name: str) -> type:
    return getattr(pb, name)


def _forwarded(context: grpc.aio.ServicerContext) -> list[tuple[str, str | bytes]]:
    """The client's headers without gRPC's and HTTP/2's own (the channel writes those)."""
    return [(key, value) for key, value in context.invocation_metadata() or ()
            if not key.startswith((":", "grpc-")) and key not in _DROPPED_HEADERS]


class Relay:
    """The service's handlers on one event loop: a channel to ``target`` made on first use."""

    def __init__(self, target: str, health: Any | None, api_key: str | None = None,
                 clients: ClientLoad | None = None) -> None:
        """``health``: what the launcher knows (``not_ready``, ``model_unavailable``), or None;
        ``api_key``: what inference needs, checked here as Triton checks it (None: nothing);
        ``clients``: each client's inferences in flight, counted with the HTTP door's (None: not
        bounded)."""
        self.target, self.health, self.clients = target, health, clients
        self._keyed = None if api_key is None else f"Bearer {api_key}".encode()
        self._channel: grpc.aio.Channel | None = None
        self._calls: dict[str, Any] = {}

    def _call(self, method: Any) -> Any:
        if self._channel is None:
            options = [("grpc.max_send_message_length", MAX_ANSWER), ("grpc.max_receive_message_length", MAX_ANSWER)]
            self._channel = grpc.aio.insecure_channel(self.target, options=options)
        if method.name not in self._calls:
            path = f"/{SERVICE}/{method.name}"
            serialize = _message_class(method.input_type.name).SerializeToString
            kind = self._channel.stream_stream if method.client_streaming else self._channel.unary_unary
            self._calls[method.name] = kind(path, request_serializer=serialize, response_deserializer=None)
        return self._calls[method.name]

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel, self._calls = None, {}

    def unkeyed(self, method: Any, context: grpc.aio.ServicerContext) -> bool:
        """An inference without the API key. Triton refuses it too, but a stream it refuses at its
        opening is at times answered INTERNAL "Internal error from Core" to a relay (a race in 2.51),
        so the front answers first, as Triton does."""
        if self._keyed is None or method.name not in INFERENCE:
            return False
        sent = [value for key, value in context.invocation_metadata() or () if key == GRPC_API_KEY_HEADER]
        given = sent[0].encode() if len(sent) == 1 and isinstance(sent[0], str) else b""
        return not hmac.compare_digest(given, self._keyed)

    def refusal(self, model: str) -> str | None:
        """Why ``model`` (or the server) cannot serve now, as the launcher knows it; None: send it."""
        if self.health is None:
            return None
        why = self.health.model_unavailable(model) if model else self.health.not_ready()
        return None if why is None else recovering(why)

    def _status(self, exc: grpc.aio.AioRpcError, model: str, since: float) -> grpc.StatusCode:
        """Triton's status, but UNAVAILABLE for a server-side failure of an instance that was going
        or being replaced while the request ran (the client's retry is served)."""
        code = exc.code()
        if code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
            return code
        if status_of_message(exc.details() or "") == "UNAVAILABLE":
            return grpc.StatusCode.UNAVAILABLE
        health = self.health
        if health is not None and (health.not_ready(since) or (model and health.model_unavailable(model))):
            return grpc.StatusCode.UNAVAILABLE
        return code

    def unary(self, method: Any) -> Callable[..., Any]:
        async def handle(request: Any, context: grpc.aio.ServicerContext) -> bytes:
            if self.unkeyed(method, context):
                await context.abort(grpc.StatusCode.UNAVAILABLE, UNKEYED)
            request.DiscardUnknownFields()
            model = getattr(request, "model_name", "") if method.name == "ModelInfer" else None
            if model is not None and (why := self.refusal(model)) is not None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, why)
            client = peer_host(context.peer()) if model is not None else None
            if client is not None and (over := self.take(client)) is not None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, over)
            since = time.monotonic()
            try:
                return await self._call(method)(request, metadata=_forwarded(context),
                                                timeout=context.time_remaining())
            except grpc.aio.AioRpcError as exc:
                await context.abort(self._status(exc, model or "", since), exc.details() or exc.code().name)
            finally:
                if client is not None:
                    self.give(client)
        return handle

    def take(self, client: str) -> str | None:
        """Count one more inference of ``client``; why not, past its share (None: counted)."""
        if self.clients is None:
            return None
        try:
            self.clients.take(client)
        except DoorError as refused:
            return refused.message
        return None

    def give(self, client: str, count: int = 1) -> None:
        if self.clients is not None and count:
            self.clients.give(client, count)

    def stream(self, method: Any) -> Callable[..., Any]:
        async def handle(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            if self.unkeyed(method, context):
                await context.abort(grpc.StatusCode.UNAVAILABLE, UNKEYED)
            out: asyncio.Queue = asyncio.Queue()  # Triton's answers and the front's refusals, in order
            admitted: asyncio.Queue = asyncio.Queue()  # the client's requests Triton is to get
            client, running = peer_host(context.peer()), [0]  # the client's requests not yet answered in full

            async def read() -> None:
                try:
                    await admit()
                except Exception:  # noqa: BLE001 - bytes that do not parse: the stream ends, named
                    await out.put(_UNPARSED)
                await admitted.put(_END)

            async def admit() -> None:  # a refused request is answered in the stream
                async for request in requests:
                    request.DiscardUnknownFields()
                    if (why := self.refusal(request.model_name) or self.take(client)) is not None:
                        await out.put(_Refused(_stream_error(request, why)))  # counted nowhere
                        continue
                    running[0] += 1
                    await admitted.put(request)

            async def sent() -> AsyncIterator[Any]:
                while (request := await admitted.get()) is not _END:
                    yield request

            call = self._call(method)(sent(), metadata=_forwarded(context), timeout=context.time_remaining())

            async def pump() -> None:  # the call ends after the client's last request: refusals come first
                try:
                    async for answer in call:
                        await out.put(answer)
                except grpc.aio.AioRpcError as exc:
                    await out.put(exc)
                await out.put(_END)

            tasks = [asyncio.ensure_future(read()), asyncio.ensure_future(pump())]
            failed, unparsed, since = None, False, time.monotonic()
            try:
                while (answer := await out.get()) is not _END:
                    if isinstance(answer, grpc.aio.AioRpcError):
                        failed = answer
                        break
                    if answer is _UNPARSED:
                        unparsed = True
                        break
                    if isinstance(answer, _Refused):
                        yield answer.answer
                        continue
                    if running[0] and _ends_a_request(answer):
                        running[0] -= 1
                        self.give(client)
                    yield answer
            finally:
                for task in tasks:
                    task.cancel()
                call.cancel()
                self.give(client, running[0])
            if unparsed:
                context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
                context.set_details("a request of this stream is not a ModelInferRequest")
            if failed is not None:  # after the client's requests are no longer read
                context.set_code(self._status(failed, "", since))
                context.set_details(failed.details() or failed.code().name)
        return handle

    def handler(self) -> grpc.GenericRpcHandler:
        """Every method of the service, relayed."""
        handlers = {}
        for method in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
            parse = _message_class(method.input_type.name).FromString
            if method.client_streaming:
                handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                    self.stream(method), request_deserializer=parse, response_serializer=None)
            else:
                handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                    self.unary(method), request_deserializer=parse, response_serializer=None)
        return grpc.method_handlers_generic_handler(SERVICE, handlers)


@dataclass(frozen=True)
class _Refused:
    """The front's own answer to a request of a stream it did not send on."""

    answer: bytes


def peer_host(peer: str) -> str:
    """The client's address from gRPC's peer (``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``), as
    the HTTP door names it."""
    peer = urllib.parse.unquote(peer)  # grpcio writes ipv6:%5B::1%5D:5000
    address = peer.split(":", 1)[1] if peer.startswith(("ipv4:", "ipv6:")) else peer
    host = address.rsplit(":", 1)[0] if address.count(":") == 1 or address.startswith("[") else address
    return host.strip("[]")


def _ends_a_request(answer: bytes) -> bool:
    """A stream answer that is its request's last: Triton's final flag, or an error."""
    parsed = pb.ModelStreamInferResponse.FromString(answer)
    if parsed.error_message:
        return True
    final = parsed.infer_response.parameters.get("triton_final_response")
    return final is None or final.bool_param


def _stream_error(request: Any, why: str) -> bytes:
    """A stream's in-band error, as Triton answers a request of a stream it cannot serve."""
    answer = pb.ModelStreamInferResponse(error_message=why)
    answer.infer_response.id = request.id
    answer.infer_response.model_name = request.model_name
    return answer.SerializeToString()


class GrpcFront:
    """The relay's server on its own thread and event loop, so that gRPC traffic never delays the
    HTTP door's loop (nor its liveness)."""

    def __init__(self, address: str, target: str, max_message: int, health: Any | None = None,
                 api_key: str | None = None, clients: ClientLoad | None = None) -> None:
        """Listen on ``address`` (``host:port``); relay to ``target`` (``unix:<path>`` or ``host:port``)."""
        self.address, self.max_message = address, max_message
        self.relay = Relay(target, health, api_key, clients)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self.port: int | None = None

    def start(self) -> GrpcFront:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), name="neopp-grpc-front",
                                        daemon=True)
        self._thread.start()
        if not self._started.wait(30) or self._error is not None:
            raise RuntimeError(f"the gRPC front did not start on {self.address}: {self._error}")
        return self

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        options = [("grpc.max_receive_message_length", self.max_message),
                   ("grpc.max_send_message_length", MAX_ANSWER), ("grpc.so_reuseport", 0)]
        server = grpc.aio.server(options=options)
        server.add_generic_rpc_handlers((self.relay.handler(),))
        try:
            self.port = server.add_insecure_port(self.address)
            if not self.port:
                raise OSError(f"cannot bind {self.address}")
            await server.start()
        except Exception as exc:  # noqa: BLE001 - reported by start()
            self._error = exc
            self._started.set()
            return
        self._started.set()
        try:
            await self._stopped.wait()
        finally:
            await server.stop(grace=2)
            await self.relay.close()

    def answers(self, timeout_s: float) -> bool:
        """True when the front's event loop runs a no-op within ``timeout_s`` (it is not stuck)."""
        return loop_answers(self._loop, self._thread, timeout_s)

    def stop(self) -> None:
        loop, stopped = self._loop, self._stopped
        if loop is not None and stopped is not None and self._thread is not None and self._thread.is_alive():
            loop.call_soon_threadsafe(stopped.set)
            self._thread.join(timeout=15)
