"""The door's ``/v1`` routes: OpenAI's Images API over the prompt model, optionally behind an API key.

Requests are read under the same bounds as every other body and parsed as strictly; each image
is one ``neopp_t2i`` call over gRPC (a client that hangs up cancels it). With ``stream: true``
each finished image is one ``image_generation.completed`` server-sent event; with
``partial_images`` the door runs what ``neopp_t2i`` runs, the prompt encoder and then the
model's streamed twin, and sends its previews as ``image_generation.partial_image`` events
before the same final bytes.
"""

from __future__ import annotations

import base64
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from . import openai_images as oa
from . import strict_json
from .body import BodyReader, ByteBudget, DoorLimits
from .door_metrics import DoorMetrics
from .errors import DoorError
from .upstream import Upstream


class Door(Protocol):
    """What these routes use of the door that holds them (the door imports them, not the reverse)."""

    budget: ByteBudget
    limits: DoorLimits
    metrics: DoorMetrics
    upstream: Upstream

    async def body(self, request: Request, reader: BodyReader) -> bytes: ...

    async def next_event(self, call: Any) -> dict[str, Any] | DoorError | None: ...

    async def until_disconnect(self, request: Request, call: Any) -> Any: ...


class ImagesRoutes:
    """``POST /v1/images/generations`` and ``GET /v1/models`` for one door."""

    def __init__(self, door: Door, api_key: str | None, admin_key: str | None) -> None:
        self.door, self.api_key, self.admin_key = door, api_key, admin_key

    async def answer(self, request: Request, handler) -> Response:
        try:
            self._authorize(request)
            try:
                return await handler(request)
            except DoorError as exc:
                raise oa.refusal(exc.status, exc.message, exc.headers) from None
        except oa.OpenAIError as exc:
            self.door.metrics.refusal("openai_" + exc.kind)
            return Response(strict_json.dumps(exc.body()), exc.status, exc.headers, media_type="application/json")

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        token = given[7:].strip() if given[:7].lower() == "bearer " else ""
        if not secrets.compare_digest(token.encode(), self.api_key.encode()):
            raise oa.OpenAIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'")

    async def generations(self, request: Request) -> Response:
        async with BodyReader(self.door.budget, self.door.limits) as reader:
            body = await self.door.body(request, reader)
        req, stream = oa.parse_images_request(strict_json.loads(body, "request body"))
        if req.partial_images:
            return await self._streamed(request, req)
        if stream:
            first = await self._image(request, req, 0)  # a refusal is an error answer, not an event
            return StreamingResponse(self._events(request, req, first), media_type="text/event-stream")
        images = [await self._image(request, req, i) for i in range(req.n)]
        doc = {"created": int(time.time()), "data": [{"b64_json": _b64(image)} for image in images],
               "output_format": req.output_format, "size": req.size_text, "seed": req.seed}
        return Response(strict_json.dumps(doc), media_type="application/json")

    async def _image(self, request: Request, req: oa.ImagesRequest, index: int) -> bytes:
        call = self.door.upstream.infer(oa.prompt_model_request(req, index))
        return oa.image_bytes(await self.door.until_disconnect(request, call))

    async def _events(self, request: Request, req: oa.ImagesRequest, first: bytes) -> AsyncIterator[bytes]:
        for index in range(req.n):
            image = first if index == 0 else await self._image(request, req, index)
            event = {"b64_json": _b64(image), "created_at": int(time.time()),
                     "size": req.size_text, "output_format": req.output_format, "quality": "auto",
                     "background": "auto", "seed": req.seed + index}
            yield _sse("image_generation.completed", event)

    async def _streamed(self, request: Request, req: oa.ImagesRequest) -> Response:
        """Partial images: the prompt encoder, then the model's streamed twin with previews."""
        if req.n > 1:
            raise oa.OpenAIError(400, "'n' must be 1 with 'partial_images'", "n")
        twin = req.model + oa.STREAM_SUFFIX
        if twin not in await self.door.upstream.ready_models(self.admin_key):
            raise oa.OpenAIError(400, f"'partial_images' needs {twin}, the streamed twin of {req.model}, which this "
                                 "server does not serve", "partial_images")
        size = req.size or await self._default_size()
        encoded = await self.door.until_disconnect(request, self.door.upstream.infer(oa.encoder_request(req)))
        wire = oa.streamed_request(req, encoded, size, oa.preview_plan(req.partial_images, req.steps))
        call = self.door.upstream.stream(wire)
        first = await self.door.next_event(call)
        if not isinstance(first, dict):
            call.cancel()
            raise first or oa.OpenAIError(500, f"{twin} answered nothing", kind="server_error")
        size_text = req.size_text if size is None else f"{size[1]}x{size[0]}"
        return StreamingResponse(self._preview_events(call, req, size_text, first), media_type="text/event-stream")

    async def _preview_events(self, call, req: oa.ImagesRequest, size: str, first: dict) -> AsyncIterator[bytes]:
        event, sent = first, 0
        common = {"size": size, "output_format": req.output_format, "quality": "auto", "background": "auto"}
        try:
            while isinstance(event, dict):
                final = event.pop("_final")
                now = {"created_at": int(time.time()), **common}
                if req.progress:
                    yield _sse("neopp.progress", {"step": event["STEP"], "total_steps": event["TOTAL_STEPS"]})
                if "IMAGE" in event:
                    yield _sse("image_generation.completed", {"b64_json": event["IMAGE"], **now, "seed": req.seed})
                elif "PREVIEW" in event and oa.wanted_preview(event["STEP"], event["TOTAL_STEPS"], sent,
                                                              req.partial_images):
                    yield _sse("image_generation.partial_image",
                               {"b64_json": event["PREVIEW"], "partial_image_index": sent, **now})
                    sent += 1
                event = None if final else await self.door.next_event(call)
            if isinstance(event, DoorError):
                yield _sse("error", {"error": {"message": event.message, "type": "server_error", "param": None,
                                               "code": None}})
        finally:
            call.cancel()

    async def _default_size(self) -> tuple[int, int] | None:
        """``neopp_t2i``'s own default size, so that "auto" draws what the non-streamed call draws
        (None: it sets none, and the model draws its checkpoint's default either way)."""
        answer = await self.door.upstream.control("GET", f"/v2/models/{oa.PROMPT_MODEL}/config", None, self.admin_key)
        try:
            text = strict_json.loads(answer.body)["parameters"].get("default_size", {}).get("string_value", "")
            return oa.size_of(text) if text.strip() else None
        except (DoorError, AttributeError, KeyError, TypeError, ValueError):
            raise oa.OpenAIError(500, f"{oa.PROMPT_MODEL}'s default size is not readable ({answer.status})",
                                 kind="server_error") from None

    async def models(self, request: Request) -> Response:
        names = await self.door.upstream.ready_models(self.admin_key)
        offered = []
        for name in names:
            if oa.is_generation_model(name, await self.door.upstream.metadata(name, "")):
                offered.append({"id": name, "object": "model", "created": 0, "owned_by": "neopp"})
        return Response(strict_json.dumps({"object": "list", "data": offered}), media_type="application/json")


def _b64(image: bytes) -> str:
    return base64.b64encode(image).decode()


def _sse(kind: str, doc: dict) -> bytes:
    """One server-sent event as OpenAI streams them: the type named twice, as event and field."""
    return f"event: {kind}\ndata: ".encode() + strict_json.dumps({"type": kind, **doc}) + b"\n\n"
