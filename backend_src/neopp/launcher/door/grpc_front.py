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

Each request is parsed once, here, after its fields are counted (neopp.launcher.door.message_fields;
protobuf, unknown fields dropped), and Triton gets the message the front serialised from it,
never the client's bytes; Triton's answers, which the server produced,
pass as they are. Every header a client sent that is not gRPC's own goes on, so Triton's
restricted protocols (the operator and API keys) judge it as before. A client that hangs up
cancels the relayed call, so Triton cancels the request. What a client holds here is bounded: its
inferences and their bytes (shared with the HTTP door's counts), a stream's queues both ways, and
the calls open at once.
"""

from __future__ import annotations

import asyncio
import hmac
import threading
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from tritonclient.grpc import service_pb2 as pb

from ...contract.client_lanes import PARAMETER as LANE_PARAMETER
from ...contract.statuses import status_of_message
from ..admin import GRPC_API_KEY_HEADER
from ..health import loop_answers, recovering
from .body import ByteBudget
from .client_load import ClientLoad
from .door_error import DoorError
from .grpc_calls import OpenCall, OpenCalls
from .grpc_health import health_handler
from .grpc_stream import RelayedStream
from .message_fields import BadMessage, inference_problem, parse_request

SERVICE = "inference.GRPCInferenceService"
HEALTH_CALLS = 64  # room for health checks beside a full table of calls (grpcio's own cap)
# Messages are taken uncompressed only: grpcio inflates a compressed one to the size bound before
# refusing it, so a 1 MB gzip bomb cost 128 MiB a call (clients compress nothing by default).
IDENTITY_ONLY = 1
MAX_ANSWER = 1 << 30  # what Triton may send back (images; a model's config)
_DROPPED_HEADERS = ("content-type", "te", "user-agent", "host")
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
    """The service's handlers on one event loop: a channel to ``target`` made on first use.

    Every method is received as a stream of bytes and parsed here, so that a call that sends no
    message, two, or bytes that do not parse is answered (grpcio leaves a unary call with no
    message unanswered) and a message's fields are counted before it is parsed."""

    def __init__(self, target: str, health: Any | None, api_key: str | None = None,
                 clients: ClientLoad | None = None, budget: ByteBudget | None = None,
                 calls: OpenCalls | None = None) -> None:
        """``health``: what the launcher knows (``not_ready``, ``model_unavailable``), or None;
        ``api_key``: what inference needs, checked here as Triton checks it (None: nothing);
        ``clients``: each client's inferences in flight, counted with the HTTP door's (None: not
        bounded); ``budget``: the request bytes held, shared with the HTTP door's bodies (None: not
        bounded); ``calls``: the calls open at once (None: not bounded)."""
        self.target, self.health, self.clients, self.budget = target, health, clients, budget
        self.calls = calls
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

    def status_of(self, exc: grpc.aio.AioRpcError, model: str, since: float) -> grpc.StatusCode:
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

    async def first(self, messages: AsyncIterator[bytes], context: grpc.aio.ServicerContext, message: type,
                    call: OpenCall | None = None) -> Any:
        """The call's request, parsed; a call that sent none, or bytes that do not parse, is ended
        with INVALID_ARGUMENT. A unary call's messages after its first are not read."""
        async for data in messages:
            if call is not None:
                call.busy()
            try:
                return parse_request(data, message)
            except BadMessage as bad:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(bad))
        if call is not None and call.given_up is not None:  # its wait for a message was cut short
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, call.given_up)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the call sent no {message.DESCRIPTOR.name}")

    def unary(self, method: Any) -> Callable[..., Any]:
        message = _message_class(method.input_type.name)

        async def handle(messages: AsyncIterator[bytes], context: grpc.aio.ServicerContext,
                         call: OpenCall | None) -> AsyncIterator[bytes]:
            if self.unkeyed(method, context):
                await context.abort(grpc.StatusCode.UNAVAILABLE, UNKEYED)
            request = await self.first(messages, context, message, call)
            model = request.model_name if method.name == "ModelInfer" else None
            if model is not None and (fault := inference_problem(request)) is not None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, fault)
            if model is not None and (why := self.refusal(model)) is not None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, why)
            client = peer_host(context.peer()) if model is not None else None
            size = request.ByteSize() if client is not None else 0
            if client is not None and (over := self.admit(request, client, size)) is not None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, over)
            try:
                answer, failure = await self._relayed(method, request, context, model or "")
            finally:
                if client is not None:
                    self.done(client, 1, size)
            del request  # not held by an aborted call's traceback
            if failure is not None:
                await context.abort(*failure)
            yield answer
        return handle

    async def _relayed(self, method: Any, request: Any, context: grpc.aio.ServicerContext,
                       model: str) -> tuple[bytes | None, tuple[grpc.StatusCode, str] | None]:
        """Triton's answer to ``request``, or the status and words to end the client's call with."""
        since = time.monotonic()
        try:
            return await self._call(method)(request, metadata=_forwarded(context),
                                            timeout=context.time_remaining()), None
        except grpc.aio.AioRpcError as exc:
            return None, (self.status_of(exc, model, since), exc.details() or exc.code().name)

    def admit(self, request: Any, client: str, size: int) -> str | None:
        """Count one more inference of ``client`` holding ``size`` bytes, and give it its client's
        turn in Triton's queue (lane and priority, as the HTTP door does); why not, past its share
        or the bytes the server holds (None: admitted)."""
        try:
            if self.budget is not None:
                self.budget.reserve(size, client)
        except DoorError as refused:
            return refused.message
        if self.clients is None:
            return None
        try:
            priority = self.clients.take(client)
        except DoorError as refused:
            if self.budget is not None:
                self.budget.release(size, client)
            return refused.message
        request.parameters[LANE_PARAMETER].string_param = self.clients.lane(client)
        request.parameters["priority"].uint64_param = priority
        return None

    def done(self, client: str, count: int = 0, size: int = 0) -> None:
        """``count`` of ``client``'s inferences answered in full, giving back ``size`` of its bytes."""
        if self.clients is not None and count:
            self.clients.give(client, count)
        if self.budget is not None and size:
            self.budget.release(size, client)

    def stream(self, method: Any) -> Callable[..., Any]:
        async def handle(messages: AsyncIterator[bytes], context: grpc.aio.ServicerContext,
                         call: OpenCall | None) -> AsyncIterator[bytes]:
            if self.unkeyed(method, context):
                await context.abort(grpc.StatusCode.UNAVAILABLE, UNKEYED)
            relayed = RelayedStream(self, peer_host(context.peer()), call)
            upstream = self._call(method)(relayed.sent(), metadata=_forwarded(context),
                                          timeout=context.time_remaining())
            try:
                async for answer in relayed.answers(messages, upstream):
                    yield answer
            finally:
                relayed.close()
            if relayed.failed is not None:  # after the client's requests are no longer read
                code, details = relayed.failed
                context.set_code(code)
                context.set_details(details)
        return handle

    def counted(self, handle: Callable[..., Any]) -> Callable[..., Any]:
        """``handle`` holding one of the open calls while it runs (neopp.launcher.door.grpc_calls)."""
        async def in_its_slot(messages: AsyncIterator[bytes], context: grpc.aio.ServicerContext,
                              ) -> AsyncIterator[bytes]:
            if self.calls is None:
                async for answer in handle(messages, context, None):
                    yield answer
                return
            entered = self.calls.enter(peer_host(context.peer()))
            if isinstance(entered, str):
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, entered)
            key, call = entered
            try:
                async for answer in handle(messages, context, call):
                    yield answer
            except asyncio.CancelledError:
                if call.given_up is None:  # the client went away
                    raise
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, call.given_up)
            finally:
                self.calls.leave(key)
        return in_its_slot

    def handler(self) -> grpc.GenericRpcHandler:
        """Every method of the service, relayed; each received as bytes (see the class)."""
        handlers = {}
        for method in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
            handle = self.stream(method) if method.client_streaming else self.unary(method)
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                self.counted(handle), request_deserializer=None, response_serializer=None)
        return grpc.method_handlers_generic_handler(SERVICE, handlers)


def peer_host(peer: str) -> str:
    """The client's address from gRPC's peer (``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``), as
    the HTTP door names it."""
    peer = urllib.parse.unquote(peer)  # grpcio writes ipv6:%5B::1%5D:5000
    address = peer.split(":", 1)[1] if peer.startswith(("ipv4:", "ipv6:")) else peer
    host = address.rsplit(":", 1)[0] if address.count(":") == 1 or address.startswith("[") else address
    return host.strip("[]")


class GrpcFront:
    """The relay's server on its own thread and event loop, so that gRPC traffic never delays the
    HTTP door's loop (nor its liveness)."""

    def __init__(self, address: str, target: str, max_message: int, health: Any | None = None,
                 api_key: str | None = None, clients: ClientLoad | None = None, budget: ByteBudget | None = None,
                 max_calls: int | None = None, max_client_calls: int | None = None) -> None:
        """Listen on ``address`` (``host:port``); relay to ``target`` (``unix:<path>`` or ``host:port``);
        at most ``max_calls`` calls open at once, all clients, and ``max_client_calls`` of one
        address (see neopp.launcher.door.grpc_calls; None: not bounded)."""
        self.address, self.max_message, self.max_calls = address, max_message, max_calls
        calls = None if max_calls is None else OpenCalls(max_calls, max_client_calls or max_calls)
        self.relay = Relay(target, health, api_key, clients, budget, calls)
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
                   ("grpc.max_send_message_length", MAX_ANSWER), ("grpc.so_reuseport", 0),
                   ("grpc.compression_enabled_algorithms_bitset", IDENTITY_ONLY)]
        backstop = None if self.max_calls is None else self.max_calls + HEALTH_CALLS  # health is never counted
        server = grpc.aio.server(options=options, maximum_concurrent_rpcs=backstop)
        server.add_generic_rpc_handlers((self.relay.handler(),
                                         health_handler(self.relay.first, lambda: self.relay.refusal(""))))
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
