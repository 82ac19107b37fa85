"""What a streaming (decoupled) NeoPP model's ``model.py`` does: progress, previews, final image.

``execute`` parses and validates each request exactly as the plain models do, draws its noise,
hands it to its step-batching :class:`~neopp.engines.engine.Engine` and returns; the engine's events become
responses on the request's sender, on a delivery thread so that the engine never waits for
them: one per step (``STEP``/``TOTAL_STEPS``, sometimes a JPEG ``PREVIEW``); the last step's
carries ``IMAGE`` and ``NEXT_RNG_STATE`` and the final flag. A refused, failed or cancelled request
gets one error response with the final flag instead.
Requests run on a batching engine (``neopp.engines.batch_engine``): a request joins the running batch
at the next step boundary, within the model's ``token_budget``.
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..engines.engine import Engine, EngineHooks
from ..engines.factory import build_engine
from ..errors import GenerationCancelled
from ..image_io import encode_image
from ..request import GenerationRequest
from ..sampling.sampler import StepEvent
from .metrics import StreamMetrics
from .request_log import request_line
from .request_parsing import KV_INPUTS
from .stream_delivery import Delivery
from .stream_parsing import (
    STREAM_INPUT_SPECS,
    STREAM_OUTPUT_SPECS,
    StreamOptions,
    default_preview_size,
    parse_stream_request,
    refuse_input_like_parameters,
)
from .triton_model import NeoPPTritonModel

PREVIEW_QUALITY = 85


@dataclass
class _Call:
    """One accepted request: where its responses go and how its final image is delivered."""

    sender: Any
    req: GenerationRequest
    options: StreamOptions
    preview_size: tuple[int, int]
    resize: tuple[int, int] | None
    rng_state: np.ndarray
    start: float


class NeoPPStreamModel(NeoPPTritonModel):
    """Decoupled Triton Python-backend model streaming one NeoPP mode."""

    INPUTS = STREAM_INPUT_SPECS
    OUTPUTS = STREAM_OUTPUT_SPECS

    @classmethod
    def auto_complete_config(cls, auto_complete_model_config: Any) -> Any:
        auto_complete_model_config.set_model_transaction_policy({"decoupled": True})
        return super().auto_complete_config(auto_complete_model_config)

    def initialize(self, args: dict[str, str]) -> None:
        self.engine: Engine | None = None
        super().initialize(args)
        self._counting = True
        self.delivery = Delivery(self._emit)

    def _build_engine(self, device: str, gpus: list[int] | None, instance_index: int,
                      threads: int | None) -> Engine:
        """The same engine as the plain model's, step-batching (a rank pool's for a parallel mode):
        requests are checked on the engine that runs them, so the rules and geometry are the same."""
        self.stream_metrics = StreamMetrics(self.pb, self.model_name)
        self._counting = False  # the warm-up leaves the metrics untouched
        hooks = EngineHooks(queue_wait=self._queue_wait, batch_size=self._batch, step_seconds=self._step_time)
        return build_engine(self.settings.checkpoint, self.mode, device, self.settings.dtype, self.settings.limits,
                            threads, instance_index, gpus=gpus, collective_timeout_s=self.settings.collective_timeout_s,
                            step_batching=True, token_budget=self.settings.token_budget, hooks=hooks,
                            speed=self.settings.speed)

    def _queue_wait(self, seconds: float) -> None:
        if self._counting:
            self.stream_metrics.queue_wait(seconds)

    def _batch(self, size: int) -> None:
        if self._counting:
            self.stream_metrics.batch(size)

    def _step_time(self, seconds: float) -> None:
        if self._counting:
            self.metrics.step(seconds)
            self.stream_metrics.step_time(seconds)

    def execute(self, requests: list[Any]) -> None:
        """Accept each request and return at once; its responses follow from the delivery thread."""
        for request in requests:
            self._accept(request)
        return None

    def finalize(self) -> None:
        """Queued and running streams end with CANCELLED before the engine's workers stop."""
        super().finalize()  # closes the engine
        self.delivery.close()  # after the engine: its cancellation events are delivered too

    # ------------------------------------------------------------------ one request

    def _accept(self, request: Any) -> None:
        sender = request.get_response_sender()
        start = time.perf_counter()
        try:
            if self._stopping.is_set() or self.engine is None:
                raise GenerationCancelled("request cancelled before generation started")
            parsed, options = parse_stream_request(self._inputs(request), self.settings.limits, self.kv_dims,
                                                   self.mode.sampling)
            gen_req, stream = self._ready_request(parsed)
        except Exception as exc:  # noqa: BLE001 - every refusal is answered; the model stays usable
            self._send(sender, self._refuse(exc, start), final=True)
            return
        if parsed.uses_instance_stream:
            # Streams run concurrently, so the instance stream moves on when a request is accepted
            # (the plain models move it when the image is delivered); no two requests share a draw.
            self.noise_stream = stream
        call = _Call(sender, gen_req, options, options.preview_size or default_preview_size(gen_req.height,
                                                                                             gen_req.width),
                     parsed.resize, np.frombuffer(stream.state(), dtype=np.uint8).copy(), start)
        cancelled = lambda: sender.is_cancelled() or self._stopping.is_set()  # noqa: E731
        self.engine.submit(gen_req, lambda event: self.delivery.put(call, event), cancelled,
                           preview_every=options.preview_every)

    def _emit(self, call: _Call, event: StepEvent) -> None:
        """One engine event -> one response (the delivery thread)."""
        try:
            if event.error is not None:
                raise event.error
            if event.final is not None:
                response = self._final(call, event)
            else:
                response = self._progress(call, event)
        except Exception as exc:  # noqa: BLE001 - the request ends with its error
            self._send(call.sender, self._refuse(exc, call.start), final=True)
            return
        self._send(call.sender, response, final=event.final is not None)

    def _progress(self, call: _Call, event: StepEvent) -> Any:
        tensors = self._step_tensors(event)
        if event.preview is not None:
            jpeg = encode_image(event.preview, "jpeg", call.preview_size, quality=PREVIEW_QUALITY)
            tensors.append(self.pb.Tensor("PREVIEW", self._bytes(call, jpeg)))
        return self.pb.InferenceResponse(output_tensors=tensors)

    def _final(self, call: _Call, event: StepEvent) -> Any:
        req = call.req
        image = encode_image(event.final, req.sampling.output_format, call.resize)
        seconds = time.perf_counter() - call.start
        self.metrics.success(seconds)
        self.logger.log_info(request_line(self.model_name, self.mode, req,
                                          len(image), seconds))
        return self.pb.InferenceResponse(output_tensors=[
            self.pb.Tensor("IMAGE", self._bytes(call, image)),
            self.pb.Tensor("NEXT_RNG_STATE", call.rng_state),
            *self._step_tensors(event),
        ])

    def _step_tensors(self, event: StepEvent) -> list[Any]:
        return [self.pb.Tensor("STEP", np.array([event.step], dtype=np.int64)),
                self.pb.Tensor("TOTAL_STEPS", np.array([event.total], dtype=np.int64))]

    @staticmethod
    def _bytes(call: _Call, data: bytes) -> np.ndarray:
        """A BYTES [1] tensor: the encoded bytes, or their base64 text when the request asked."""
        return np.array([base64.b64encode(data) if call.options.base64_output else data], dtype=np.object_)

    def _send(self, sender: Any, response: Any, final: bool) -> None:
        flags = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        try:
            sender.send(response, flags=flags)
        except Exception as exc:  # noqa: BLE001 - a stream the client closed; nothing left to tell it
            self.logger.log_warn(f"{self.model_name}: response not delivered: {exc}")

    def _inputs(self, request: Any) -> dict[str, Any]:
        """As the plain models, with the KV copied: the request's buffers may be released once
        ``execute`` returns, while the request still waits in the engine's queue. A JSON field of
        ``generate_stream`` that names no input arrives as a parameter and is refused here."""
        refuse_input_like_parameters(request.parameters())
        out = super()._inputs(request)
        for name in KV_INPUTS:
            if name in out:
                out[name] = out[name].clone()
        return out
