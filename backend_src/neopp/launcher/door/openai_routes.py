"""The door's ``/v1`` routes: OpenAI's Images API over the prompt model, optionally behind an API key.

Requests are read under the same bounds as every other body and parsed as strictly; each image
is one ``neopp_t2i`` call over gRPC (a client that hangs up cancels it). With ``stream: true``
each finished image is one ``image_generation.completed`` server-sent event; with
``partial_images`` the door runs what ``neopp_t2i`` runs, the prompt encoder and then the
model's streamed twin, and sends its previews as ``image_generation.partial_image`` events
before the same final bytes (previews are JPEG, and their events say so).

An edit (``/v1/images/edits``, a form with pictures) runs the prompt encoder once on the prompt
and the pictures, then draws each image with the generation model itself from the encoder's
answer, the image-only branch included (``neopp_t2i`` would encode the pictures again for each
image); with ``partial_images`` its streamed twin draws it, as for a generation.

Before anything is drawn the request is held to what its model advertises (``model_facts``): a
model that is not in the repository is a 404, one that is not loaded a 503 naming it with
Retry-After, one that does not draw a 400; more steps than its ``steps.max`` a 400; and "auto" is
resolved to the size the model draws, which the answer then names.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ...contract.sizes import height_width
from . import auth, model_facts, parse_jobs, strict_json
from . import openai_edits as oe
from . import openai_images as oa
from .body import BodyReader
from .bounds import DoorLimits
from .client_load import CallGate, Turn, client_of
from .door_error import DoorError
from .door_metrics import DoorMetrics
from .model_facts import ModelFacts
from .parse_jobs import Parser
from .responses import error_answer
from .upstream import Upstream


class ImagesDoor(Protocol):
    """What these routes use of the door that holds them (the door imports them, not the reverse)."""

    metrics: DoorMetrics
    limits: DoorLimits
    upstream: Upstream
    parser: Parser
    api_key: str | None
    admin_key: str | None
    metrics_address: tuple[str, int] | None

    def reader(self, request: Request, route: str = "inference") -> BodyReader: ...

    def drain_after(self, request: Request, status: int) -> Callable[[], Awaitable[None]] | None: ...

    def json_values(self, request: Request, what: str, hint: str = "", prefix: int | None = None,
                    route: str = "inference") -> strict_json.ValueCounter: ...

    async def next_event(self, call: Any) -> dict[str, Any] | DoorError | None: ...

    async def until_disconnect(self, request: Request, call: Any) -> Any: ...

    def stream_closed(self, call: Any, finished: bool) -> None: ...

    def more_generations(self, request: Request, count: int) -> None: ...

    def turn(self, request: Request) -> Turn: ...


class ImagesRoutes:
    """``POST /v1/images/generations``, ``POST /v1/images/edits`` and ``GET /v1/models`` for one door."""

    def __init__(self, door: ImagesDoor, prompt_calls_per_client: int = 2) -> None:
        self.door = door
        self.gate = CallGate(prompt_calls_per_client)
        self.facts = ModelFacts(door.upstream, door.admin_key, door.metrics_address)

    async def answer(self, request: Request, handler) -> Response:
        after = None
        try:
            if not auth.has_api_key(request.headers, self.door.api_key):
                raise oa.OpenAIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                                     headers={"WWW-Authenticate": "Bearer"})
            try:
                return await handler(request)
            except DoorError as exc:
                after = exc.after  # a refused body is drained once the answer is out
                raise oa.refusal(exc.status, exc.message, exc.headers) from None
        except oa.OpenAIError as exc:
            self.door.metrics.refusal("openai_" + exc.kind)
            after = after or self.door.drain_after(request, exc.status)
            return error_answer(exc.status, exc.body(), exc.headers, after)

    async def generations(self, request: Request) -> Response:
        async with self.door.reader(request, "openai") as reader:
            body = await reader.read(request.receive, request.headers,
                                     values=self.door.json_values(request, "request body", route="openai"))
        req, stream = await self.door.parser.run(len(body), parse_jobs.images_request, bytes(body), reader.cap.values)
        req = await self._admitted(request, req)
        if req.partial_images:
            return await self._streamed(request, req)
        return await self._answer(request, req, stream,
                                  lambda: self._images(request, req, lambda i: oa.prompt_model_request(req, i)))

    async def edits(self, request: Request) -> Response:
        """An edit: the form read once under its cap, the pictures and prompt encoded once, then
        the images drawn from the encoder's answer."""
        content_type = request.headers.get("content-type", "")
        oe.boundary(content_type)  # a JSON body is refused before it is read
        async with self.door.reader(request, "edits") as reader:
            body = await reader.read(request.receive, request.headers)
        req, stream = await self.door.parser.thread(oe.parse_edit_form, content_type, body,
                                                    self.door.limits.openai_body)
        del body  # the pictures are the request's own bytes now
        req = await self._admitted(request, req)
        if req.partial_images:
            return await self._streamed(request, req)
        encoded = await self.door.until_disconnect(
            request, self.door.upstream.infer(oa.encoder_request(req), self.door.turn(request)))
        return await self._answer(request, req, stream, lambda: self._images(
            request, req, lambda i: oa.generation_request(req, encoded, i), oa.think_text(encoded)))

    async def _admitted(self, request: Request, req: oa.ImagesRequest) -> oa.ImagesRequest:
        """The request held to its model's facts; each image past the first counts against the
        client's share."""
        req = await self._resolved(req)
        if req.n > 1:
            self.door.more_generations(request, req.n - 1)
        return req

    async def _answer(self, request: Request, req: oa.ImagesRequest, stream: bool,
                      start: Callable[[], list[asyncio.Task]]) -> Response:
        """The images ``start`` sets drawing, as server-sent events or one JSON answer."""
        if stream:
            return await self._completed_events(request, req, start)
        images = await self.door.until_disconnect(request, asyncio.ensure_future(self._all(start)))
        doc = {"created": int(time.time()), "data": [_datum(req, image) for image in images],
               "output_format": req.output_format, "size": req.size_text, "seed": req.seed}
        return Response(strict_json.dumps(doc), media_type="application/json")

    def _images(self, request: Request, req: oa.ImagesRequest, wire_of: Callable[[int], Any],
                reasoning: str | None = None) -> list[asyncio.Task]:
        """The ``n`` images, each one call (``wire_of(index)``: of the prompt model, or for an edit
        of the generation model on the encoder's answer, whose ``reasoning`` it then carries), a
        row of the model's running batch; at most the gate's share of the client's calls run at once."""
        turn, client = self.door.turn(request), client_of(request)
        return [asyncio.ensure_future(self._image(wire_of(index), turn.nth(index), client, reasoning))
                for index in range(req.n)]

    async def _image(self, wire: Any, turn: Turn, client: str, reasoning: str | None) -> Drawn:
        async with self.gate.slot(client):
            call = self.door.upstream.infer(wire, turn)
            try:
                answer = await call
                return Drawn(oa.image_bytes(answer), oa.think_text(answer) if reasoning is None else reasoning)
            finally:
                call.cancel()  # a no-op once answered; stops the drawing when this image is given up

    @staticmethod
    async def _all(start: Callable[[], list[asyncio.Task]]) -> list[Drawn]:
        images = start()
        try:
            return list(await asyncio.gather(*images))
        finally:
            for image in images:  # after one failed (or the client left), the others are not drawn
                image.cancel()

    async def _completed_events(self, request: Request, req: oa.ImagesRequest,
                                start: Callable[[], list[asyncio.Task]]) -> Response:
        images = start()
        try:
            first = await self.door.until_disconnect(request, images[0])  # a refusal is an error answer
        except BaseException:
            for image in images:
                image.cancel()
            raise
        return StreamingResponse(self._events(request, req, first, images), media_type="text/event-stream")

    async def _events(self, request: Request, req: oa.ImagesRequest, first: Drawn,
                      images: list[asyncio.Future]) -> AsyncIterator[bytes]:
        finished = False
        try:
            for index in range(req.n):
                image = first if index == 0 else await self.door.until_disconnect(request, images[index])
                event = {**_datum(req, image), "created_at": int(time.time()),
                         "size": req.size_text, "output_format": req.output_format, "quality": "auto",
                         "background": "auto", "seed": req.seed + index}
                yield _sse("image_generation.completed", event)
            finished = True
        except DoorError as exc:
            finished = True
            if exc.reason == "client_gone":  # counted where it was seen
                raise
            # the answer has begun: a later image's failure (its engine replaced, say) is an event
            yield _sse("error", _error_event(exc))
        finally:
            if not finished:  # the client left: counted here
                self.door.metrics.cancel()
            for image in images:  # the images still to come are not drawn
                image.cancel()

    async def _streamed(self, request: Request, req: oa.ImagesRequest) -> Response:
        """Partial images: the prompt encoder, then the model's streamed twin with previews."""
        if req.n > 1:
            raise oa.OpenAIError(400, "'n' must be 1 with 'partial_images'", "n")
        twin = req.model + oa.STREAM_SUFFIX
        if twin not in await self.door.upstream.ready_models(self.door.admin_key):
            raise oa.OpenAIError(400, f"'partial_images' needs {twin}, the streamed twin of {req.model}, which this "
                                 "server does not serve", "partial_images")
        turn = self.door.turn(request)
        encoded = await self.door.until_disconnect(request, self.door.upstream.infer(oa.encoder_request(req), turn))
        wire = oa.streamed_request(req, encoded, oa.preview_plan(req.partial_images, req.steps))
        call = self.door.upstream.stream(wire, turn)
        first = await self.door.next_event(call)
        if not isinstance(first, dict):
            call.cancel()
            raise first or oa.OpenAIError(500, f"{twin} answered nothing", kind="server_error")
        reasoning = oa.think_text(encoded) if req.think else None
        return StreamingResponse(self._preview_events(call, req, req.size_text, first, reasoning),
                                 media_type="text/event-stream")

    async def _preview_events(self, call, req: oa.ImagesRequest, size: str, first: dict,
                              reasoning: str | None) -> AsyncIterator[bytes]:
        event, sent, finished = first, 0, False
        common = {"size": size, "output_format": req.output_format, "quality": "auto", "background": "auto"}
        try:
            while isinstance(event, dict):
                final = event.pop("_final")
                now = {"created_at": int(time.time()), **common}
                if req.progress:
                    yield _sse("neopp.progress", {"step": event["STEP"], "total_steps": event["TOTAL_STEPS"]})
                if "IMAGE" in event:
                    thought = {} if reasoning is None else {"think": reasoning}
                    yield _sse("image_generation.completed",
                               {"b64_json": event["IMAGE"], **thought, **now, "seed": req.seed})
                elif "PREVIEW" in event and oa.wanted_preview(event["STEP"], event["TOTAL_STEPS"], sent,
                                                              req.partial_images):
                    yield _sse("image_generation.partial_image",  # previews are JPEG whatever the image's format
                               {"b64_json": event["PREVIEW"], "partial_image_index": sent, **now,
                                "output_format": "jpeg"})
                    sent += 1
                event = None if final else await self.door.next_event(call)
            if isinstance(event, DoorError):
                yield _sse("error", _error_event(event))
            finished = True
        finally:
            self.door.stream_closed(call, finished)

    async def _default_size(self) -> tuple[int, int] | None:
        """``neopp_t2i``'s own default size, so that "auto" draws what the non-streamed call draws
        (None: it sets none, and the model draws its checkpoint's default either way)."""
        answer = await self.door.upstream.control("GET", f"/v2/models/{oa.PROMPT_MODEL}/config", None,
                                                  self.door.admin_key)
        try:
            text = strict_json.loads(answer.body)["parameters"].get("default_size", {}).get("string_value", "")
            return height_width(text) if text.strip() else None
        except (DoorError, AttributeError, KeyError, TypeError, ValueError):
            raise oa.OpenAIError(500, f"{oa.PROMPT_MODEL}'s default size is not readable ({answer.status})",
                                 kind="server_error") from None

    async def _resolved(self, req: oa.ImagesRequest) -> oa.ImagesRequest:
        """The request held to its model's advertised facts, "auto" resolved to the size drawn."""
        facts = await self._facts_of(req.model)
        most = model_facts.max_steps(facts)
        if req.steps is not None and most is not None and req.steps > most:
            raise oa.OpenAIError(400, f"'num_inference_steps' must be an integer from 1 to {most} ({req.model}'s "
                                 "steps.max)", "num_inference_steps")
        size = req.size or await self._default_size() or model_facts.default_size(facts)
        return dataclasses.replace(req, size=size)

    async def _facts_of(self, model: str) -> dict:
        """The facts of a model that draws, or the OpenAI answer that says why it cannot."""
        states = await self.door.upstream.model_states(self.door.admin_key)
        if model not in states:
            raise oa.OpenAIError(404, f"The model '{model[:128]}' does not exist on this server; GET /v1/models "
                                 "lists the ones that draw", "model", code="model_not_found")
        if states[model] != "READY":
            raise oa.OpenAIError(503, f"The model '{model}' is not loaded now ({states[model] or 'unloaded'}); "
                                 "try again shortly", "model", "server_error", {"Retry-After": "2"},
                                 code="model_not_loaded")
        facts = await self.facts.of(model)
        if facts is None:
            raise oa.OpenAIError(400, f"The model '{model}' does not draw images here; GET /v1/models lists the "
                                 "ones that do", "model", code="model_not_found")
        return facts

    async def models(self, request: Request) -> Response:
        """The models that draw, each with what it advertises under ``neopp`` (the adapters it
        offers included: the model judges its own folder)."""
        drawing = sorted((await self.facts.drawing()).items())
        offered = [{"id": name, "object": "model", "created": 0, "owned_by": "neopp",
                    **({"neopp": dict(facts)} if facts else {})} for name, facts in drawing]
        return Response(strict_json.dumps({"object": "list", "data": offered}), media_type="application/json")

    async def variations(self, request: Request) -> Response:
        raise oa.OpenAIError(400, oa.VARIATIONS, code="unsupported_endpoint")

    async def no_route(self, request: Request) -> Response:
        raise oa.OpenAIError(404, f"Invalid URL ({request.method} {request.url.path[:200]}): this server answers "
                             "POST /v1/images/generations, POST /v1/images/edits and GET /v1/models",
                             code="unknown_url")


@dataclass(frozen=True)
class Drawn:
    """One image of a request and the reasoning it was drawn after ("" without think mode)."""

    image: bytes
    reasoning: str


def _datum(req: oa.ImagesRequest, drawn: Drawn) -> dict[str, str]:
    """An image as OpenAI's ``data`` item; with ``think``, the reasoning beside it."""
    return {"b64_json": _b64(drawn.image), **({"think": drawn.reasoning} if req.think else {})}


def _b64(image: bytes) -> str:
    return base64.b64encode(image).decode()


def _error_event(exc: DoorError) -> dict[str, Any]:
    """A failure after a stream's answer began, in OpenAI's error shape."""
    return {"error": {"message": exc.message, "type": "server_error", "param": None, "code": None}}


def _sse(kind: str, doc: dict) -> bytes:
    """One server-sent event as OpenAI streams them: the type named twice, as event and field."""
    return f"event: {kind}\ndata: ".encode() + strict_json.dumps({"type": kind, **doc}) + b"\n\n"
