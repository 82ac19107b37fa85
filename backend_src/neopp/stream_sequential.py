"""A :class:`~neopp.streaming.StreamEngine` that runs one request at a time, in one worker thread.

It serves the streaming models until a batching engine replaces it: requests wait in a FIFO
queue and each runs through the existing engine (`engines.build_engine`), so its final pixels are
exactly the plain model's. Previews are the clean-image prediction of a step,
``x_pred = z + max(1 - t, 0.02) * v``, taken through the pipeline's ``on_prediction`` hook; a
multi-process engine (CFG-parallel ranks) reports steps but no prediction, so its events carry
no preview.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from .engines import GenerationEngine
from .errors import GenerationCancelled
from .image_io import to_pixels
from .pipeline import GenerationRequest, NeoPPPipeline
from .streaming import CancelledFn, EmitFn, StepEvent

SecondsFn = Callable[[float], None]
SizeFn = Callable[[int], None]


@dataclass
class _Job:
    req: GenerationRequest
    emit: EmitFn
    cancelled: CancelledFn
    preview_every: int
    queued_at: float = field(default_factory=time.perf_counter)


class SequentialStreamEngine:
    """FIFO, batch size 1. Callbacks feed metrics: ``on_queue_wait(seconds)`` when a request
    starts, ``on_batch(size)`` per run (always 1 here), ``on_step_time(seconds)`` per step."""

    def __init__(self, engine: GenerationEngine, on_queue_wait: SecondsFn | None = None,
                 on_batch: SizeFn | None = None, on_step_time: SecondsFn | None = None) -> None:
        self.engine = engine
        self._on_queue_wait, self._on_batch, self._on_step_time = on_queue_wait, on_batch, on_step_time
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="neopp-stream-engine", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- StreamEngine
    def submit(self, req: GenerationRequest, emit: EmitFn, cancelled: CancelledFn, preview_every: int = 0) -> None:
        job = _Job(req, emit, cancelled, max(0, int(preview_every)))
        if self._closed.is_set():
            _deliver(job, StepEvent(0, req.sampling.infer_steps,
                                    error=GenerationCancelled("the model is unloading; request not started")))
            return
        self._jobs.put(job)

    def close(self) -> None:
        """Stop between two steps; every queued request gets its cancellation event."""
        self._closed.set()
        self._jobs.put(None)
        self._thread.join(timeout=60)
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                _deliver(job, StepEvent(0, job.req.sampling.infer_steps,
                                        error=GenerationCancelled("the model is unloading; request not started")))

    # ---------------------------------------------------------------- the worker
    def _loop(self) -> None:
        while not self._closed.is_set():
            job = self._jobs.get()
            if job is None:
                return
            self._run(job)

    def _run(self, job: _Job) -> None:
        total = job.req.sampling.infer_steps
        if self._on_queue_wait is not None:
            self._on_queue_wait(time.perf_counter() - job.queued_at)
        if self._on_batch is not None:
            self._on_batch(1)
        stop = lambda: self._closed.is_set() or job.cancelled()  # noqa: E731
        previews: dict[int, np.ndarray] = {}

        def on_prediction(k: int, predict: Callable[[], torch.Tensor]) -> None:
            if job.preview_every and (k + 1) % job.preview_every == 0:
                previews[k] = to_pixels(predict())

        def on_step(k: int, seconds: float) -> None:
            if self._on_step_time is not None:
                self._on_step_time(seconds)
            _deliver(job, StepEvent(k + 1, total, preview=previews.pop(k, None)))

        try:
            if stop():
                raise GenerationCancelled("cancelled before generation started")
            pixels = self._generate(job.req, stop, on_step, on_prediction)
        except Exception as exc:  # noqa: BLE001 - the request ends with its error; the engine goes on
            _deliver(job, StepEvent(0, total, error=exc))
            return
        _deliver(job, StepEvent(total, total, final=pixels))

    def _generate(self, req: GenerationRequest, stop: CancelledFn, on_step: Callable[[int, float], None],
                  on_prediction: Callable[[int, Callable[[], torch.Tensor]], None]) -> np.ndarray:
        """The plain engine's own path (same pixels); the pipeline also lends its predictions."""
        if isinstance(self.engine, NeoPPPipeline):
            return to_pixels(self.engine.sample(req, should_stop=stop, on_step=on_step, on_prediction=on_prediction))
        return self.engine.generate(req, should_stop=stop, on_step=on_step)


def _deliver(job: _Job, event: StepEvent) -> None:
    """A failing ``emit`` (a client gone mid-send) must not stop the engine for the others."""
    try:
        job.emit(event)
    except Exception:  # noqa: BLE001
        pass


def build_sequential_stream_engine(engine: GenerationEngine,
                                   **callbacks: Callable[..., None]) -> SequentialStreamEngine:
    """The factory the streaming models call (``on_queue_wait``, ``on_batch``, ``on_step_time``)."""
    return SequentialStreamEngine(engine, **callbacks)
