"""The door's routes: the KServe v2 HTTP protocol our clients call, answered from checked requests.

Inference (``infer``, ``generate``, ``generate_stream``) is parsed here and sent to Triton over
gRPC; a client that disconnects cancels its call. The control routes go to Triton's own HTTP port
with bodies the door re-serialised. Every refusal is a JSON ``{"error": ...}`` with a 4xx status;
nothing a client sends leads to a traceback.

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
from importlib import resources
from typing import Any, Protocol
from urllib.parse import quote

import grpc
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from ..admin import KEY_HEADER
from . import generate, kserve_infer, strict_json
from .body import BodyReader, ByteBudget, DoorLimits
from .door_metrics import DoorMetrics
from .errors import DoorError, invalid
from .openai_routes import ImagesRoutes
from .shm_arena import TensorRegion
from .upstream import Upstream, grpc_error
from .wire import WireRequest

log = logging.getLogger("neopp.launcher.door")
PLAYGROUND = (resources.files(__package__) / "playground.html").read_bytes()  # the page at /, no build step
NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
VERSION = re.compile(r"^[0-9]{0,18}$")
KEY_FORMAT = re.compile(r"^[A-Za-z0-9_-]{16,256}$")
MODEL = "/v2/models/{model}"
VERSIONED = "/v2/models/{model}/versions/{version}"
RETRY_AFTER_S = 2  # a stub is reloaded in seconds, a server restarted in tens of them


class Health(Protocol):
    """What the launcher knows: why the server (now, or at some moment after ``since``) or one model
    cannot serve (None: it can)."""

    def not_ready(self, since: float | None = None) -> str | None: ...

    def model_unavailable(self, model: str) -> str | None: ...


def unavailable(why: str) -> DoorError:
    return DoorError(503, f"not serving now, try again shortly: {why}", reason="recovering",
                     headers={"Retry-After": str(RETRY_AFTER_S)})


def json_response(status: int, doc: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(strict_json.dumps(doc), status, headers, media_type="application/json")


class AnswerFirst(Response):
    """A whole answer sent before ``after`` runs, the exchange closed only then: a refused body is
    drained while its client already holds the answer."""

    def __init__(self, answer: Response, after: Callable[[], Awaitable[None]]) -> None:
        super().__init__(answer.body, answer.status_code, media_type=answer.media_type)
        self.raw_headers, self.after = answer.raw_headers, after

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self.body, "more_body": True})
        await self.after()
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _checked(request: Request, key: str, pattern: re.Pattern[str] = NAME) -> str:
    value = request.path_params.get(key, "")
    if not pattern.match(value):
        raise invalid(f"'{value[:64]}' is not a valid {key} name")
    return value


def _admin_key(request: Request) -> str | None:
    key = request.headers.get(KEY_HEADER)
    return key if key is not None and KEY_FORMAT.match(key) else None


def _compress(request: Request, body: bytes, headers: dict[str, str]) -> bytes:
    """gzip the answer when the client asked for it (tritonclient's response compression)."""
    if "gzip" in request.headers.get("accept-encoding", "").lower() and len(body) > 256:
        headers["Content-Encoding"] = "gzip"
        return gzip.compress(body, compresslevel=1)
    return body


class Door:
    """State shared by the routes: limits, the body budget, Triton, metrics."""

    def __init__(self, upstream: Upstream, limits: DoorLimits, metrics: DoorMetrics, region: TensorRegion,
                 health: Health | None = None) -> None:
        self.upstream, self.limits, self.metrics, self.region = upstream, limits, metrics, region
        self.budget = ByteBudget(limits.bodies_in_flight)
        self.health = health

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

    async def body(self, request: Request, reader: BodyReader) -> bytes:
        data = await reader.read(request.receive, request.headers)
        if request.headers.get("inference-header-content-length") is None \
                and data.count(b",") + data.count(b":") > self.limits.max_json_values:  # a JSON body only
            raise DoorError(413, f"the JSON body holds over {self.limits.max_json_values} values; "
                            f"{kserve_infer.JSON_HINT}", reason="json_too_large")
        return data

    # ---------------------------------------------------------------- inference

    async def infer(self, request: Request) -> Response:
        model, version = _checked(request, "model"), _checked(request, "version", VERSION)
        self.serving(model)
        header_length = request.headers.get("inference-header-content-length")
        async with BodyReader(self.budget, self.limits) as reader, self.region.slot(request.headers) as slot:
            if slot is None:
                body = await self.body(request, reader)
                wire, plan = await asyncio.to_thread(
                    kserve_infer.parse_infer, body, header_length, model, version, self.limits.max_json_bytes)
                del body
            else:  # the binary part goes straight into the region Triton reads
                head = await reader.read(request.receive, request.headers, tail=slot.view)
                wire, plan = kserve_infer.parse_infer_parts(bytes(head), slot.view, model, version,
                                                            (self.region.name, slot.offset))
            response = await self._infer(request, wire)
        data, headers = kserve_infer.infer_response(response, plan)
        return Response(_compress(request, data, headers), 200, headers)

    async def _infer(self, request: Request, wire: WireRequest) -> Any:
        """The call; once more when Triton has restarted since the region was registered."""
        try:
            return await self.until_disconnect(request, self.upstream.infer(wire))
        except DoorError as exc:
            if not self.region.lost(exc.message) or not await self.region.ensure():
                raise
        return await self.until_disconnect(request, self.upstream.infer(wire))

    async def _generate_request(self, request: Request, reader: BodyReader, stream: bool) -> WireRequest:
        """A generate body read under the bounds and mapped onto the model's declared inputs."""
        model, version = _checked(request, "model"), _checked(request, "version", VERSION)
        self.serving(model)
        body = await self.body(request, reader)
        metadata = await self.upstream.metadata(model, version)
        return generate.parse_generate(body, model, version, metadata, stream=stream)

    async def generate(self, request: Request) -> Response:
        async with BodyReader(self.budget, self.limits) as reader:
            wire = await self._generate_request(request, reader, stream=False)
            response = await self.until_disconnect(request, self.upstream.infer(wire))
        headers = {"Content-Type": "application/json"}
        return Response(_compress(request, strict_json.dumps(generate.generate_response(response)), headers),
                        200, headers)

    async def generate_stream(self, request: Request) -> Response:
        async with BodyReader(self.budget, self.limits) as reader:
            wire = await self._generate_request(request, reader, stream=True)
        call = self.upstream.stream(wire)
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
                return {**generate.generate_response(response), "_final": generate.is_final(response)}
            if generate.is_final(response):
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
            if not finished:  # the client left mid-stream: the generation stops with it
                self.metrics.cancelled += 1
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
                self.metrics.cancelled += 1
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
            response = json_response(exc.status, {"error": exc.message}, exc.headers)
            if exc.after is not None:
                response = AnswerFirst(response, exc.after)
        except Exception as exc:  # noqa: BLE001 - one line in the log, a 500 to the client
            log.error("neopp front: %s %s failed: %s: %s", request.method, request.url.path[:200],
                      type(exc).__name__, str(exc)[:300])
            self.metrics.refusal("internal")
            response = json_response(500, {"error": f"internal error: {type(exc).__name__}"})
        self.metrics.request(_route_label(request), response.status_code)
        return response

    # ---------------------------------------------------------------- control routes

    async def ready(self, request: Request) -> Response:
        """Ready when the launcher knows of nothing broken and Triton says so too."""
        self.serving()
        return await self.forward(request, "/v2/health/ready")

    async def model_ready(self, request: Request) -> Response:
        self.serving(_checked(request, "model"))
        return await self.forward(request, _model_path(request, "/ready"))

    async def forward(self, request: Request, path: str, with_body: bool = False) -> Response:
        body = None
        if with_body:
            async with BodyReader(self.budget, self.limits) as reader:
                raw = await self.body(request, reader)
            body = strict_json.dumps(strict_json.loads(raw, "request body")) if raw.strip() else b""
        answer = await self.upstream.control(request.method, path, body, _admin_key(request))
        return Response(answer.body, answer.status, media_type=answer.content_type)


async def _disconnected(receive: Callable[[], Awaitable[dict]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _route_label(request: Request) -> str:
    """The route's template (``/v2/models/{model}/infer``): bounded, and no model or region names."""
    return getattr(request.scope.get("route"), "path", "other")


def _sse(doc: dict[str, Any]) -> bytes:
    return b"data: " + strict_json.dumps(doc) + b"\n\n"


def _model_path(request: Request, suffix: str = "") -> str:
    path = f"/v2/models/{quote(_checked(request, 'model'))}"
    if "version" in request.path_params:
        path += f"/versions/{quote(_checked(request, 'version', VERSION))}"
    return path + suffix


def build_app(door: Door, api_key: str | None = None, admin_key: str | None = None) -> Starlette:
    """The routes; any other path is a 404 with a JSON error. ``api_key``: what ``/v1`` requires as
    ``Authorization: Bearer``; ``admin_key``: lets ``/v1/models`` read the repository index."""
    images = ImagesRoutes(door, api_key, admin_key)

    def control(path_of: Callable[[Request], str], with_body: bool = False):
        async def endpoint(request: Request) -> Response:
            return await door.forward(request, path_of(request), with_body)
        return guarded(endpoint)

    def guarded(endpoint):
        async def run(request: Request) -> Response:
            return await door.answer(request, endpoint)
        return run

    def model_route(suffix: str, methods: list[str], with_body: bool = False) -> list[Route]:
        endpoint = control(lambda r: _model_path(r, suffix), with_body)
        return [Route(MODEL + suffix, endpoint, methods=methods), Route(VERSIONED + suffix, endpoint, methods=methods)]

    def inference(name: str, handler) -> list[Route]:
        return [Route(f"{MODEL}/{name}", guarded(handler), methods=["POST"]),
                Route(f"{VERSIONED}/{name}", guarded(handler), methods=["POST"])]

    def region(kind: str, action: str, with_body: bool = False) -> list[Route]:
        base = f"/v2/{kind}"
        methods = ["POST"] if with_body or action == "unregister" else ["GET"]
        endpoint_all = control(lambda r: f"{base}/{action}", with_body)
        endpoint_one = control(lambda r: f"{base}/region/{quote(_checked(r, 'region'))}/{action}", with_body)
        routes = [Route(f"{base}/region/{{region}}/{action}", endpoint_one, methods=methods)]
        if action != "register":
            routes.append(Route(f"{base}/{action}", endpoint_all, methods=methods))
        return routes

    async def playground(request: Request) -> Response:
        return Response(PLAYGROUND, media_type="text/html; charset=utf-8")

    async def metrics(request: Request) -> Response:
        return Response(door.metrics.render(door.budget.used), media_type="text/plain; version=0.0.4")

    routes = [
        Route("/v2/health/live", control(lambda r: "/v2/health/live"), methods=["GET"]),
        Route("/v2/health/ready", guarded(door.ready), methods=["GET"]),
        Route("/v2", control(lambda r: "/v2"), methods=["GET"]),
        Route("/v2/models/stats", control(lambda r: "/v2/models/stats"), methods=["GET"]),
        Route("/v2/repository/index", control(lambda r: "/v2/repository/index", True), methods=["POST"]),
        Route("/v2/repository/models/{model}/load",
              control(lambda r: f"/v2/repository/models/{quote(_checked(r, 'model'))}/load", True), methods=["POST"]),
        Route("/v2/repository/models/{model}/unload",
              control(lambda r: f"/v2/repository/models/{quote(_checked(r, 'model'))}/unload", True),
              methods=["POST"]),
        Route("/v2/trace/setting", control(lambda r: "/v2/trace/setting", True), methods=["POST"]),
        Route("/v2/trace/setting", control(lambda r: "/v2/trace/setting"), methods=["GET"]),
        Route("/v2/logging", control(lambda r: "/v2/logging", True), methods=["POST"]),
        Route("/v2/logging", control(lambda r: "/v2/logging"), methods=["GET"]),
        Route("/", playground, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/images/generations", guarded(lambda r: images.answer(r, images.generations)), methods=["POST"]),
        Route("/v1/models", guarded(lambda r: images.answer(r, images.models)), methods=["GET"]),
        *inference("infer", door.infer), *inference("generate", door.generate),
        *inference("generate_stream", door.generate_stream),
        *model_route("", ["GET"]), Route(MODEL + "/ready", guarded(door.model_ready), methods=["GET"]),
        Route(VERSIONED + "/ready", guarded(door.model_ready), methods=["GET"]), *model_route("/config", ["GET"]),
        *model_route("/stats", ["GET"]), *model_route("/trace/setting", ["GET"]),
        *model_route("/trace/setting", ["POST"], True),
    ]
    for kind in ("systemsharedmemory", "cudasharedmemory"):
        routes += [*region(kind, "status"), *region(kind, "register", True), *region(kind, "unregister")]
    app = Starlette(routes=routes)
    app.add_exception_handler(404, _not_found(door))
    app.add_exception_handler(405, _not_allowed(door))
    return app


def _not_found(door: Door):
    async def handler(request: Request, exc: Exception) -> Response:
        door.metrics.refusal("no_route")
        return json_response(404, {"error": f"no route {request.method} {request.url.path[:200]}"})
    return handler


def _not_allowed(door: Door):
    async def handler(request: Request, exc: Exception) -> Response:
        door.metrics.refusal("method")
        return json_response(405, {"error": f"{request.method} is not allowed on {request.url.path[:200]}"})
    return handler
