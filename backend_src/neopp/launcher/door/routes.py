"""The door's routes: which path is which handler, and what each requires.

Inference routes want the API key when one is set and take a slot among the inference requests
in flight; the routes Triton restricts to the operator key are refused here without it; health,
metadata, statistics, the playground and ``/metrics`` take nothing and stay open. Any other path
is a 404 with a JSON error (under ``/v1`` in OpenAI's shape, as every ``/v1`` answer is).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import resources
from urllib.parse import quote

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, request_response
from starlette.types import Receive, Scope, Send

from . import auth, openapi, strict_json
from .app import VERSION, Door, checked
from .openai_routes import ImagesRoutes
from .responses import json_response
from .status_page import render_html

PLAYGROUND = (resources.files(__package__) / "playground.html").read_bytes()  # the page at /, no build step
FAVICON = (b'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 16 16"><rect width="16" height="16" rx="3" '
           b'fill="#1d3557"/><circle cx="6" cy="8" r="3.5" fill="#e63946"/></svg>')  # the demo's red circle on blue
MODEL = "/v2/models/{model}"
VERSIONED = "/v2/models/{model}/versions/{version}"
Endpoint = Callable[[Request], Awaitable[Response]]


class Slotted:
    """An inference route as an ASGI app: the slot its request took (``Door.inference``) is given
    back once the whole answer is sent, so a stream holds it while it streams."""

    def __init__(self, door: Door, endpoint: Endpoint) -> None:
        self.door, self.app = door, request_response(endpoint)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            self.door.inference_done(scope)


def _model_path(request: Request, suffix: str = "") -> str:
    path = f"/v2/models/{quote(checked(request, 'model'))}"
    if "version" in request.path_params:
        path += f"/versions/{quote(checked(request, 'version', VERSION))}"
    return path + suffix


def build_app(door: Door) -> Starlette:
    """The routes of ``door`` (its API key guards inference, its operator key the administration)."""
    images = ImagesRoutes(door, door.limits.client_prompt_calls)

    def guarded(endpoint: Endpoint) -> Endpoint:
        async def run(request: Request) -> Response:
            return await door.answer(request, endpoint)
        return run

    def control(path_of: Callable[[Request], str], with_body: bool = False, restricted: bool = False) -> Endpoint:
        async def endpoint(request: Request) -> Response:
            if restricted:
                auth.require_admin_key(request.headers, door.admin_key)
            return await door.forward(request, path_of(request), with_body)
        return guarded(endpoint)

    def inference(name: str, handler: Endpoint) -> list[Route]:
        async def endpoint(request: Request) -> Response:
            auth.require_api_key(request.headers, door.api_key)
            return await door.inference(request, handler)
        return [Route(f"{MODEL}/{name}", Slotted(door, guarded(endpoint)), methods=["POST"]),
                Route(f"{VERSIONED}/{name}", Slotted(door, guarded(endpoint)), methods=["POST"])]

    def model_route(suffix: str, methods: list[str], with_body: bool = False, restricted: bool = False) -> list[Route]:
        endpoint = control(lambda r: _model_path(r, suffix), with_body, restricted)
        return [Route(MODEL + suffix, endpoint, methods=methods), Route(VERSIONED + suffix, endpoint, methods=methods)]

    def region(kind: str, action: str) -> list[Route]:
        base = f"/v2/{kind}"
        methods = ["GET"] if action == "status" else ["POST"]

        def endpoint_of(one: bool) -> Endpoint:
            async def endpoint(request: Request) -> Response:
                auth.require_admin_key(request.headers, door.admin_key)
                name = checked(request, "region") if one else None
                path = f"{base}/region/{quote(name)}/{action}" if name else f"{base}/{action}"
                return await door.region_call(request, path, kind, action, name)
            return guarded(endpoint)

        routes = [Route(f"{base}/region/{{region}}/{action}", endpoint_of(True), methods=methods)]
        if action != "register":
            routes.append(Route(f"{base}/{action}", endpoint_of(False), methods=methods))
        return routes

    async def playground(request: Request) -> Response:
        return Response(PLAYGROUND, media_type="text/html; charset=utf-8")

    async def favicon(request: Request) -> Response:
        """The icon every browser asks for beside the playground: the page's own, not a 404."""
        return Response(FAVICON, media_type="image/svg+xml", headers={"Cache-Control": "max-age=86400"})

    async def addresses(request: Request) -> Response:
        """The server's addresses as this client reaches it, so one URL (``NEOPP_URL``) is enough:
        a gRPC client asks here for the gRPC port (the Host header's name, the public gRPC port)."""
        host = request.url.hostname or "127.0.0.1"
        grpc_port = door.grpc_port
        return json_response(200, {"http": f"{request.url.scheme}://{request.url.netloc}",
                                   "grpc": f"{f'[{host}]' if ':' in host else host}:{grpc_port}"})

    async def status(request: Request) -> Response:
        doc = await door.status.look(door.metrics.restart_count())
        wants_json = "application/json" in request.headers.get("accept", "") or \
            request.query_params.get("format") == "json"
        if wants_json:
            return json_response(200, doc)
        return Response(render_html(doc), media_type="text/html; charset=utf-8")

    async def api_document(request: Request) -> Response:
        return Response(strict_json.dumps(openapi.document(routes)), media_type="application/json")

    async def metrics(request: Request) -> Response:
        return Response(door.metrics.render(door.budget.used), media_type="text/plain; version=0.0.4")

    def repository(action: str) -> Route:
        return Route(f"/v2/repository/models/{{model}}/{action}",
                     control(lambda r: f"/v2/repository/models/{quote(checked(r, 'model'))}/{action}", True, True),
                     methods=["POST"])

    async def ready(request: Request) -> Response:
        """Ready when the launcher knows of nothing broken and Triton says so too."""
        door.serving()
        return await door.forward(request, "/v2/health/ready")

    async def model_ready(request: Request) -> Response:
        door.serving(checked(request, "model"))
        return await door.forward(request, _model_path(request, "/ready"))

    async def generations(request: Request) -> Response:
        return await images.answer(request, lambda r: door.inference(r, images.generations))

    async def edits(request: Request) -> Response:
        return await images.answer(request, lambda r: door.inference(r, images.edits))

    routes = [
        Route("/v2/health/live", control(lambda r: "/v2/health/live"), methods=["GET"]),
        Route("/v2/health/ready", guarded(ready), methods=["GET"]),
        Route("/v2", control(lambda r: "/v2"), methods=["GET"]),
        Route("/v2/models/stats", control(lambda r: "/v2/models/stats"), methods=["GET"]),
        Route("/v2/repository/index", control(lambda r: "/v2/repository/index", True, True), methods=["POST"]),
        repository("load"), repository("unload"),
        Route("/v2/trace/setting", control(lambda r: "/v2/trace/setting", True, True), methods=["POST"]),
        Route("/v2/trace/setting", control(lambda r: "/v2/trace/setting", False, True), methods=["GET"]),
        Route("/v2/logging", control(lambda r: "/v2/logging", True, True), methods=["POST"]),
        Route("/v2/logging", control(lambda r: "/v2/logging", False, True), methods=["GET"]),
        Route("/", playground, methods=["GET"]), Route("/favicon.ico", favicon, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]), Route("/neopp/addresses", addresses, methods=["GET"]),
        Route("/status", guarded(status), methods=["GET"]), Route("/openapi.json", api_document, methods=["GET"]),
        Route("/v1/images/generations", Slotted(door, guarded(generations)), methods=["POST"]),
        Route("/v1/images/edits", Slotted(door, guarded(edits)), methods=["POST"]),
        Route("/v1/models", guarded(lambda r: images.answer(r, images.models)), methods=["GET"]),
        *inference("infer", door.infer), *inference("generate", door.generate),
        *inference("generate_stream", door.generate_stream),
        *model_route("", ["GET"]), Route(MODEL + "/ready", guarded(model_ready), methods=["GET"]),
        Route(VERSIONED + "/ready", guarded(model_ready), methods=["GET"]),
        *model_route("/config", ["GET"], restricted=True),
        *model_route("/stats", ["GET"]), *model_route("/trace/setting", ["GET"], restricted=True),
        *model_route("/trace/setting", ["POST"], True, restricted=True),
    ]
    for kind in ("systemsharedmemory", "cudasharedmemory"):
        routes += [*region(kind, "status"), *region(kind, "register"), *region(kind, "unregister")]
    routes.append(Route("/v1/images/variations", guarded(lambda r: images.answer(r, images.variations)),
                        methods=["POST"]))
    routes.append(Route("/v1/{rest:path}", guarded(lambda r: images.answer(r, images.no_route)),
                        methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]))  # in OpenAI's shape
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
