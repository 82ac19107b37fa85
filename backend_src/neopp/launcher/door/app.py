"""The door's inference routes: the KServe v2 HTTP protocol our clients call, answered from
checked requests.

Inference (``infer``, ``generate``, ``generate_stream``) is parsed away from the event loop
(``parse_jobs``) and sent to Triton over gRPC; a client that disconnects cancels its call. The
control routes go to Triton's own HTTP port with bodies the door re-serialised. Every refusal is
a JSON ``{"error": ...}`` with a 4xx status; nothing a client sends leads to a traceback.

Whether the server can serve now is the launcher's to say (``Health``, from what it owns), never
read from the text of Triton's errors, which a client can shape: readiness, and a 503 with
Retry-After for a request the server cannot serve while it recovers, instead of a 500.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import grpc
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ..health import recovering
from ..shm_regions import PREFIX_HEAD
from . import auth, generate_json, kserve_infer, parse_jobs, strict_json
from .auth import ClientRegions
from .body import BodyReader, ByteBudget, drainer
from .bounds import DoorLimits
from .client_load import ClientLoad, Turn, client_of
from .door_error import DoorError, invalid
from .door_metrics import DoorMetrics
from .health_poll import HealthCache
from .parse_jobs import Parser
from .responses import error_answer, json_response
from .shm_arena import PREFIX as DOOR_REGION_PREFIX
from .shm_arena import TensorRegion
from .spliced_request import WireRequest
from .status_page import StatusBoard
from .upstream import Upstream, grpc_error

log = logging.getLogger("neopp.launcher.door")
NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
VERSION = re.compile(r"^[0-9]{0,18}$")
SLOT = "neopp.inference_slot"  # in a request's scope: it holds an inference slot
HELD = "neopp.client_held"  # in a request's scope: [client, generations it counts for its client, priority]
READER = "neopp.body_reader"  # in a request's scope: a reader took its body (and drains it if refused)
SERVER_REGIONS = (PREFIX_HEAD, DOOR_REGION_PREFIX)  # shared memory of the server's own: never a client's key
RETRY_AFTER_S = 2  # a stub is reloaded in seconds, a server restarted in tens of them


class Health(Protocol):
    """What the launcher knows: why the server (now, or at some moment after ``since``) or one model
    cannot serve (None: it can)."""

    def not_ready(self, since: float | None = None) -> str | None: ...

    def model_unavailable(self, model: str) -> str | None: ...


def unavailable(why: str) -> DoorError:
    return DoorError(503, recovering(why), reason="recovering",
                     headers={"Retry-After": str(RETRY_AFTER_S)})


def checked(request: Request, key: str, pattern: re.Pattern[str] = NAME) -> str:
    value = request.path_params.get(key, "")
    if not pattern.match(value):
        raise invalid(f"'{value[:64]}' is not a valid {key} name")
    return value


def _compress(request: Request, body: bytes, headers: dict[str, str]) -> bytes:
    """gzip the answer when the client asked for it (tritonclient's response compression)."""
    if "gzip" in request.headers.get("accept-encoding", "").lower() and len(body) > 256:
        headers["Content-Encoding"] = "gzip"
        return gzip.compress(body, compresslevel=1)
    return body


class Door:
    """State shared by the routes: limits, the body budget, the parser, Triton, metrics, keys."""

    def __init__(self, upstream: Upstream, limits: DoorLimits, metrics: DoorMetrics, region: TensorRegion,
                 health: Health | None = None, parser: Parser | None = None,
                 api_key: str | None = None, admin_key: str | None = None,
                 metrics_address: tuple[str, int] | None = None, grpc_port: int | None = None) -> None:
        """``grpc_port``: the public gRPC port clients are told (None: the upstream's own)."""
        self.upstream, self.limits, self.metrics, self.region = upstream, limits, metrics, region
        self.grpc_port = grpc_port or int(upstream.grpc_target.rsplit(":", 1)[1])
        self.budget = ByteBudget(limits.bodies_in_flight, limits.client_bodies)
        self.health = health
        self.parser = parser or Parser(workers=0)
        self.api_key, self.admin_key = api_key, admin_key
        self.client_regions = ClientRegions()
        self.inference_in_flight = 0
        self.clients = ClientLoad(limits.client_inference)
        self.health_cache = HealthCache(upstream)
        self.metrics_address = metrics_address  # Triton's metrics port: /status and the models' facts
        self.status = StatusBoard(upstream, admin_key, metrics_address, health, self.clients)

    def serving(self, model: str | None = None, since: float | None = None) -> None:
        """Refuse (503) what the launcher knows cannot be served now: ``model``, or the server (now
        or at some moment after ``since``)."""
        if self.health is not None:
            why = self.health.not_ready(since) if model is None else self.health.model_unavailable(model)
            if why is not None:
                raise unavailable(why)

    def upstream_error(self, exc: grpc.aio.AioRpcError, since: float | None = None) -> DoorError:
        """Triton's error as the answer; a server-side failure of a request that ran while the
        launcher knew the server was recovering is a 503 with Retry-After, not a 500."""
        error = grpc_error(exc)
        if error.status >= 500:
            self.serving(since=since)
        return error

    def reader(self, request: Request, route: str = "inference") -> BodyReader:
        request.scope[READER] = True
        return BodyReader(self.budget, self.limits, client_of(request), self.limits.cap(route))

    def drain_after(self, request: Request, status: int) -> Callable[[], Awaitable[None]] | None:
        """For a refusal before any reader took the body: read it once the answer is out, so that
        a client still sending reads the answer, not a reset."""
        if request.scope.get(READER) or status in (408, 499):
            return None
        return drainer(request.receive, request.headers, self.limits)

    # ---------------------------------------------------------------- inference

    async def inference(self, request: Request, endpoint: Callable[[Request], Awaitable[Response]]) -> Response:
        """An inference request takes a slot among ``max_inference`` first (health and metrics take
        none, so they answer while these are all taken); ``routes.Slotted`` gives it back once the
        whole answer, a stream included, is sent."""
        if self.inference_in_flight >= self.limits.max_inference:
            raise DoorError(503, f"{self.inference_in_flight} inference requests are in flight, the most this server "
                            "takes at once; retry shortly", reason="inference_slots", headers={"Retry-After": "1"})
        client = client_of(request)
        request.scope[HELD] = [client, 1, self.clients.take(client)]
        self.inference_in_flight += 1
        request.scope[SLOT] = True
        return await endpoint(request)

    def more_generations(self, request: Request, count: int) -> None:
        """``count`` more generations for the request's client (an images request's ``n``), or a 429."""
        held = request.scope[HELD]
        self.clients.take(held[0], count)
        held[1] += count

    def inference_done(self, scope: dict[str, Any]) -> None:
        """The request's slot and its client's count given back, once its whole answer is sent."""
        if scope.pop(SLOT, False):
            self.inference_in_flight -= 1
        held = scope.pop(HELD, None)
        if held is not None:
            self.clients.give(held[0], held[1])

    def turn(self, request: Request) -> Turn:
        """Where the request waits: its client's lane and its priority (``Door.inference`` took it)."""
        client, _, priority = request.scope[HELD]
        return Turn(self.clients.lane(client), priority)

    async def infer(self, request: Request) -> Response:
        model, version = checked(request, "model"), checked(request, "version", VERSION)
        self.serving(model)
        header_length = request.headers.get("inference-header-content-length")
        values = self.json_values(request, "inference request header", kserve_infer.JSON_HINT,
                                  kserve_infer.json_part(request.headers, self.limits.max_json_bytes))
        async with self.reader(request) as reader, self.region.slot(request.headers) as slot:
            if slot is None:
                body = await reader.read(request.receive, request.headers, values=values)
                split = kserve_infer.split_header(header_length, len(body), self.limits.max_json_bytes)
                head, rest, region = bytes(body[:split]), memoryview(body)[split:], None
            else:  # the binary part goes straight into the region Triton reads
                head = bytes(await reader.read(request.receive, request.headers, tail=slot.view, values=values))
                rest, region = slot.view, (self.region.name, slot.offset)
            header = await self.parser.run(len(head), parse_jobs.infer_header, head, model, version, values.limit)
            self._check_regions(request, header.regions)
            wire = await self.parser.thread(kserve_infer.with_binary, header, rest, region)
            response = await self._infer(request, wire)
        data, headers = kserve_infer.infer_response(response, header.plan)
        return Response(_compress(request, data, headers), 200, headers)

    def json_values(self, request: Request, what: str, hint: str = "", prefix: int | None = None,
                    route: str = "inference") -> strict_json.ValueCounter:
        """What counts the JSON values of a body as it arrives (its first ``prefix`` bytes)."""
        return strict_json.ValueCounter(self.limits.cap(route).values, what, hint, prefix)

    def _check_regions(self, request: Request, names: set[str]) -> None:
        if names:
            self.client_regions.check(names, client_of(request), auth.has_admin_key(request.headers, self.admin_key))

    async def _infer(self, request: Request, wire: WireRequest) -> Any:
        """The call; once more when Triton has restarted since the region was registered."""
        try:
            return await self.until_disconnect(request, self.upstream.infer(wire, self.turn(request)))
        except DoorError as exc:
            if not self.region.lost(exc.message) or not await self.region.ensure():
                raise self.region.scrubbed(exc) from None
        try:
            return await self.until_disconnect(request, self.upstream.infer(wire, self.turn(request)))
        except DoorError as exc:
            raise self.region.scrubbed(exc) from None

    async def _generate_request(self, request: Request, reader: BodyReader, stream: bool) -> WireRequest:
        """A generate body read under the bounds and mapped onto the model's declared inputs."""
        model, version = checked(request, "model"), checked(request, "version", VERSION)
        self.serving(model)
        body = await reader.read(request.receive, request.headers,
                                 values=self.json_values(request, "generate request body"))
        metadata = await self.upstream.metadata(model, version)
        return await self.parser.run(len(body), parse_jobs.generate_request, body, model, version,
                                     metadata.SerializeToString(), stream, reader.cap.values)

    async def generate(self, request: Request) -> Response:
        async with self.reader(request) as reader:
            wire = await self._generate_request(request, reader, stream=False)
            response = await self.until_disconnect(request, self.upstream.infer(wire, self.turn(request)))
        headers = {"Content-Type": "application/json"}
        return Response(_compress(request, strict_json.dumps(generate_json.generate_response(response)), headers),
                        200, headers)

    async def generate_stream(self, request: Request) -> Response:
        async with self.reader(request) as reader:
            wire = await self._generate_request(request, reader, stream=True)
        call = self.upstream.stream(wire, self.turn(request))
        try:
            first = await self.next_event(call)
        except BaseException:
            call.cancel()
            raise
        if isinstance(first, DoorError):  # refused before any step: the status says so
            call.cancel()
            return Response(_sse({"error": first.message}), first.status, first.headers,
                            media_type="text/event-stream")
        return StreamingResponse(self._events(call, first), media_type="text/event-stream")

    async def next_event(self, call: Any) -> dict[str, Any] | DoorError | None:
        """The next response as an event; None at the end of the request."""
        while True:
            try:
                message = await call.read()
            except grpc.aio.AioRpcError as exc:
                try:
                    return self.upstream_error(exc)
                except DoorError as refusal:
                    return refusal
            if message is grpc.aio.EOF:
                return None
            if message.error_message:
                return DoorError(400, message.error_message, reason="upstream")
            response = message.infer_response
            if response.outputs:
                return {**generate_json.generate_response(response), "_final": generate_json.is_final(response)}
            if generate_json.is_final(response):
                return None

    async def _events(self, call: Any, first: dict[str, Any]) -> AsyncIterator[bytes]:
        event: dict[str, Any] | DoorError | None = first
        finished = False
        try:
            while isinstance(event, dict):
                final = event.pop("_final")
                yield _sse(event)
                event = None if final else await self.next_event(call)
            if isinstance(event, DoorError):
                yield _sse({"error": event.message})
            finished = True
        finally:
            self.stream_closed(call, finished)

    def stream_closed(self, call: Any, finished: bool) -> None:
        """A streamed answer is over: closed when whole; cancelled, and counted so, when its client
        left before the end (the generation stops with it)."""
        if finished:
            call.close()
            return
        self.metrics.cancel()
        call.cancel()

    async def until_disconnect(self, request: Request, call: Any) -> Any:
        """The call's response, or a cancelled call when the client leaves first."""
        began = time.monotonic()
        watch = asyncio.ensure_future(_disconnected(request.receive))
        result = asyncio.ensure_future(call)
        try:
            await asyncio.wait({watch, result}, return_when=asyncio.FIRST_COMPLETED)
            if not result.done():
                call.cancel()
                self.metrics.cancel()
                raise DoorError(499, "the client closed the connection", reason="client_gone")
            try:
                return result.result()
            except grpc.aio.AioRpcError as exc:
                raise self.upstream_error(exc, began) from None
        finally:
            watch.cancel()
            if not result.done():
                result.cancel()

    async def answer(self, request: Request, endpoint: Callable[[Request], Awaitable[Response]]) -> Response:
        """The endpoint's response; a refusal or an unexpected fault as a JSON error, never a traceback."""
        try:
            response = await endpoint(request)
        except DoorError as exc:
            self.metrics.refusal(exc.reason)
            after = exc.after or self.drain_after(request, exc.status)
            response = error_answer(exc.status, {"error": exc.message}, exc.headers, after)
        except Exception as exc:  # noqa: BLE001 - one line in the log, a 500 to the client
            log.error("neopp front: %s %s failed: %s: %s", request.method, request.url.path[:200],
                      type(exc).__name__, str(exc)[:300])
            self.metrics.refusal("internal")
            response = json_response(500, {"error": f"internal error: {type(exc).__name__}"})
        self.metrics.request(_route_label(request), response.status_code)
        return response

    # ---------------------------------------------------------------- control routes

    async def forward(self, request: Request, path: str, with_body: bool = False) -> Response:
        body, key = None, None
        if with_body:
            async with self.reader(request, "control") as reader:
                raw = await reader.read(request.receive, request.headers,
                                        values=self.json_values(request, "request body", route="control"))
            body, key = await self.parser.run(len(raw), parse_jobs.control_body, bytes(raw), reader.cap.values)
        if isinstance(key, str) and key.lstrip("/").startswith(SERVER_REGIONS):
            raise DoorError(403, f"the key '{key[:64]}' names the server's own shared memory; register a region "
                            "of your own", reason="shm_region")
        cached = self.health_cache.get(path) if body is None else None
        answer = cached if cached is not None and cached.status == 200 else \
            await self.upstream.control(request.method, path, body, auth.admin_key(request.headers))  # a 503 re-asked
        return Response(answer.body, answer.status, media_type=answer.content_type)

    async def region_call(self, request: Request, path: str, kind: str, action: str, name: str | None) -> Response:
        """A shared-memory registration or unregistration, remembered for the client on success."""
        response = await self.forward(request, path, with_body=action == "register")
        if response.status_code == 200 and action == "register" and name is not None:
            self.client_regions.registered(kind, name, client_of(request))
        elif response.status_code == 200 and action == "unregister":
            self.client_regions.unregistered(kind, name)
        return response


async def _disconnected(receive: Callable[[], Awaitable[dict]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _route_label(request: Request) -> str:
    """The route's template (``/v2/models/{model}/infer``): bounded, and no model or region names."""
    return getattr(request.scope.get("route"), "path", "other")


def _sse(doc: dict[str, Any]) -> bytes:
    return b"data: " + strict_json.dumps(doc) + b"\n\n"

