"""The door's streamed /v1 answer of n images (``ImagesRoutes._events``) once it has begun: a later
image's failure is an error event that ends the stream, never a cut connection."""

from __future__ import annotations

import asyncio
import json

from neopp.launcher.door import openai_images as oa
from neopp.launcher.door.door_error import DoorError
from neopp.launcher.door.openai_routes import Drawn, ImagesRoutes

REQUEST = oa.ImagesRequest(prompt="a red square", model="neopp_dense", n=3, size=(64, 64), output_format="png",
                           seed=7, negative_prompt=None, steps=4, guidance_scale=None)


class _Door:
    """The two things ``_events`` uses of the door: its cancel count and ``until_disconnect``."""

    def __init__(self) -> None:
        self.metrics, self.cancels = self, 0

    def cancel(self) -> None:
        self.cancels += 1

    async def until_disconnect(self, request: object, call: asyncio.Future) -> Drawn:
        return await call


def _events(fail_with: DoorError) -> tuple[list[dict], list[asyncio.Future], int]:
    async def run() -> tuple[list[dict], list[asyncio.Future], int]:
        routes = ImagesRoutes.__new__(ImagesRoutes)  # only the event writer: no upstream is reached
        routes.door = _Door()
        loop = asyncio.get_running_loop()
        images = [loop.create_future() for _ in range(REQUEST.n)]
        images[1].set_exception(fail_with)
        events = []
        try:
            async for chunk in routes._events(None, REQUEST, Drawn(b"png", ""), images):
                events.append(json.loads(chunk.decode().split("data: ", 1)[1]))
        except DoorError:
            events.append({"raised": True})
        return events, images, routes.door.cancels

    return asyncio.run(run())


def test_a_later_images_failure_is_an_error_event():
    gone = DoorError(503, "not serving now, try again shortly: neopp_dense: reloading", reason="recovering")
    events, images, cancels = _events(gone)
    assert [event["type"] for event in events] == ["image_generation.completed", "error"]
    assert events[1]["error"]["message"] == gone.message
    assert images[2].cancelled() and cancels == 0  # the image still to come is not drawn; nobody left


def test_a_client_that_left_is_not_written_to():
    events, images, cancels = _events(DoorError(499, "the client closed the connection", reason="client_gone"))
    assert [event.get("type") for event in events] == ["image_generation.completed", None]  # raised, no event
    assert images[2].cancelled() and cancels == 0  # counted where it was seen
