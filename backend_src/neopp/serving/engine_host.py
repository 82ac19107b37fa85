"""The stub that runs a mode's engine, and the socket every stub of the mode sends requests to.

The first instance of a generation model (the **owner**) loads the mode's step-batching engine
and listens on a Unix socket (``engine_link.socket_path``); every instance of the model (the
owner's own included) and the model's streamed twin connect to it (``engine_link``). A request
arrives as the client's tensors; ``admission`` parses and validates it once and draws its noise,
and it joins the running batch at the next step. Each event goes back on the request's
connection (``engine_connection``) from a writer thread, so the engine never waits for a socket.
A connection that closes cancels its requests. The host writes the engine's heartbeat
(``neopp.engine_beat``); once its engine cannot serve, every request is refused at once with
UNAVAILABLE while the launcher replaces the model.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ..engines.engine import Engine
from ..modes import ModeSpec
from ..sampling.sampler import StepEvent
from .admission import Admission, Admitted
from .engine_connection import Connection
from .error_status import refusal
from .model_settings import TritonModelSettings
from .request_log import request_summary
from .request_parsing import REQUEST_INPUT_NAMES
from .socket_host import SocketHost
from .stream_parsing import default_preview_size
from .wire import error_header


class EngineHost(SocketHost):
    """The owner's engine behind its socket; ``close`` stops listening, then the engine."""

    def __init__(self, owner: str, engine: Engine, settings: TritonModelSettings, mode: ModeSpec,
                 stopping: threading.Event, error_log: Any, on_held: Callable[[int], None] | None = None) -> None:
        super().__init__(owner, stopping, error_log)
        self.engine, self.settings, self.mode = engine, settings, mode
        self._on_held, self._held, self._held_lock = on_held, 0, threading.Lock()
        self.admission = Admission(engine, settings, mode, owner)
        self.start()

    def failure(self) -> str | None:
        """Why the engine can serve no more, or None (an engine without a loop of its own cannot fail so)."""
        return getattr(self.engine, "failure", None)

    # ---- one request ---------------------------------------------------------------------------
    def accept(self, conn: Connection, job: int, header: dict[str, Any], blobs: list[bytes], fds: list[int]) -> None:
        """Admit and submit; a refusal is the request's error event."""
        final_only = header.get("final_only") is True
        admitted = self.admit(conn, job, lambda: self.admission.admit(conn.kind, header, blobs, fds),
                              "generation started")
        if admitted is None:
            return
        req, options = admitted.req, admitted.options
        preview = options.preview_size or default_preview_size(req.height, req.width)
        conn.send({"type": "accepted", "job": job, "format": req.sampling_params.output_format,
                   "resize": list(admitted.resize) if admitted.resize else None, "preview_size": list(preview),
                   "base64_output": options.base64_output, "record": admitted.record})

        def deliver(event: StepEvent) -> None:
            if event.final is not None or event.error is not None:  # every request's one last event
                self._count_held(-1)
            conn.event(job, event, admitted)

        self._count_held(1)
        self.engine.submit(req, deliver, lambda: conn.cancelled(job),
                           preview_every=0 if final_only else options.preview_every)

    def _count_held(self, change: int) -> None:
        """Requests the engine holds (running or waiting for their first step), for the metrics."""
        with self._held_lock:
            self._held += change
            if self._on_held is not None:
                self._on_held(self._held)

    def answer(self, exc: BaseException) -> tuple[str, str, str]:
        """(Triton status, metric reason, message) of a request's error, inputs named as clients know them."""
        return refusal(exc, self.error_log, self.owner, REQUEST_INPUT_NAMES, self.stopping.is_set())

    def event_message(self, job: int, event: StepEvent, admitted: Admitted) -> tuple[dict[str, Any], list[bytes]]:
        """One engine event as the message its front gets (on the connection's writer thread)."""
        if event.error is not None:
            return error_header(job, *self.answer(event.error)), []
        head = {"job": job, "step": event.step, "total": event.total, "seconds": event.seconds}
        if event.final is not None:
            pixels = np.ascontiguousarray(event.final)
            return ({**head, "type": "final", "shape": list(pixels.shape),
                     "summary": request_summary(self.mode, admitted.req)}, [pixels.tobytes(), admitted.rng_state])
        if event.preview is not None:
            preview = np.ascontiguousarray(event.preview)
            return {**head, "type": "step", "preview": list(preview.shape)}, [preview.tobytes()]
        return {**head, "type": "step", "preview": None}, []
