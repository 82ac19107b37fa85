"""The streaming models' delivery thread: events keep their order, a failing one does not stop
the rest, and close() delivers everything queued before it."""

from __future__ import annotations

import threading

from neopp.sampling.sampler import StepEvent
from neopp.serving.stream_delivery import Delivery


def test_order_failures_and_close():
    seen: list[tuple[str, int]] = []
    gate = threading.Event()

    def handle(call: str, event: StepEvent) -> None:
        gate.wait(10)  # events pile up behind the first one
        if event.step == 2:
            raise ConnectionError("client gone")
        seen.append((call, event.step))

    delivery = Delivery(handle)
    for step in range(1, 6):
        delivery.put("a" if step % 2 else "b", StepEvent(step, 5))
    gate.set()
    delivery.close()
    assert seen == [("a", 1), ("a", 3), ("b", 4), ("a", 5)]
