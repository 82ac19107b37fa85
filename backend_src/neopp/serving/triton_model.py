"""What every NeoPP generation model's ``model.py`` does, written once.

A model's ``model.py`` only subclasses :class:`NeoPPTritonModel` and sets ``MODEL_DIR``; its
settings (the ``parameters`` of ``config.pbtxt``) are read by :mod:`neopp.serving.model_settings`.

A mode's requests share one step-batching engine, one copy of the weights
(docs/performance.md). The model's first instance (the owner) loads it and opens its socket
(``engine_host``); every instance, the owner included, hands each request to it
(``engine_link``) and waits for its image: ``execute`` blocks for its own requests, so Triton
answers them even if this stub dies, and concurrency comes from the model's instances, which
import no torch (only the owner does). A request is parsed once, by the engine's stub; here the
image is encoded and the answer, the metrics and the log line made.
"""

from __future__ import annotations

import json
import queue
import re
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..contract.inputs import INPUT_SPECS, KV_INPUTS, OUTPUT_SPECS, TensorSpec
from ..contract.statuses import INTERNAL, WORKERS_DOWN
from ..errors import ConfigError
from ..image_io import PIL_FORMATS, encode_image
from ..image_metadata import stored_record
from ..model.checkpoint_config import CheckpointConfig
from .adapter_offer import model_offer
from .c2pa_signing import picture_signer
from .capabilities import PublishedFacts, model_capabilities
from .engine_link import EngineLink, EngineUnavailable
from .metrics import GenerationMetrics
from .model_settings import TritonModelSettings
from .parameters import narrow_kv_dims
from .request_log import summary_line
from .wire import failure_header


def stop_on_sigterm(logger: Any, model_name: str) -> threading.Event:
    """An event SIGTERM sets in this stub, so a generation in flight stops between two steps.

    Triton (2.51) does not cancel running requests when it is stopped: a SIGTERM to the server
    alone waits for them (past --exit-timeout-secs, its unload waits for execute to return).
    A SIGTERM to the server's process group (``TritonServer.stop``, systemd's control group,
    ``kill -TERM -<pgid>``) reaches the stubs too; each in-flight request then ends with a
    CANCELLED error instead of holding the shutdown.
    """
    event = threading.Event()

    def _handler(_signum: int, _frame: Any) -> None:
        event.set()

    try:
        signal.signal(signal.SIGTERM, _handler)
    except ValueError:  # not the stub's main thread: keep the default
        logger.log_warn(f"{model_name}: SIGTERM handler not installed (not in the main thread)")
    return event


ENGINE_LOST_RETRIES = 2  # the first may still reach the dying engine's socket
ENGINE_LOST_PAUSE_S = 0.5


def engine_lost(header: dict[str, Any]) -> bool:
    """The engine's stub died while it held the request (not: no engine answered at all)."""
    return header.get("type") == "error" and header.get("reason") == WORKERS_DOWN.reason \
        and "went away" in str(header.get("message", ""))


def first_instance(args: dict[str, str]) -> bool:
    """The owner of a model's engine: instance 0 of its first instance group (``<model>_0_0``)."""
    numbers = re.findall(r"_(\d+)", args.get("model_instance_name", ""))
    return not numbers or all(n == "0" for n in numbers[-2:])


@dataclass
class Call:
    """One request handed to the engine: what its answer needs, and when it started."""

    sender: Any
    start: float
    options: dict[str, Any] = field(default_factory=dict)  # the engine's "accepted" message


class NeoPPTritonModel:
    """Triton Python-backend model for one NeoPP generation mode (contract inputs/outputs)."""

    MODEL_DIR: Path | None = None  # model.py sets it to its model folder
    INPUTS: dict[str, TensorSpec] = INPUT_SPECS  # the input and output tables auto-complete declares
    OUTPUTS: dict[str, TensorSpec] = OUTPUT_SPECS
    KIND = "plain"  # what the engine answers: once ("plain") or every step ("stream")

    @classmethod
    def auto_complete_config(cls, auto_complete_model_config: Any) -> Any:
        """Narrow COND_KV/UNCOND_KV/IMAGE_KV to ``[layers, 2, -1, kv_heads, head_dim]`` of the checkpoint.

        Metadata then reports the exact geometry and Triton itself rejects a wrong layout.
        Inputs/outputs missing from config.pbtxt are added from the contract table.
        """
        config = auto_complete_model_config.as_dict()
        settings = TritonModelSettings.from_config(config, cls.MODEL_DIR)
        try:
            layers, kv_heads, head_dim = CheckpointConfig.from_checkpoint(settings.checkpoint).kv_dims
        except ConfigError as exc:  # the repository index shows this line: say which model and folder
            raise ConfigError(f"model {settings.model_name}: checkpoint {settings.checkpoint}: {exc}") from exc
        kv_dims = [layers, 2, -1, kv_heads, head_dim]
        existing = {entry["name"]: entry for entry in config.get("input", [])}
        for name, spec in cls.INPUTS.items():
            entry = existing.get(name)
            if entry is None:
                auto_complete_model_config.add_input({"name": name, "data_type": spec.data_type,
                                                      "dims": kv_dims if name in KV_INPUTS else list(spec.dims),
                                                      "optional": spec.optional})
            elif name in KV_INPUTS:
                narrow_kv_dims(entry, kv_dims)
        present = {entry["name"] for entry in config.get("output", [])}
        for name, spec in cls.OUTPUTS.items():
            if name not in present:
                auto_complete_model_config.add_output({"name": name, "data_type": spec.data_type,
                                                       "dims": list(spec.dims)})
        return auto_complete_model_config

    def initialize(self, args: dict[str, str]) -> None:
        """The owner loads the engine; every instance links to it."""
        import triton_python_backend_utils as pb_utils

        self.pb, self.logger = pb_utils, pb_utils.Logger
        model_config = json.loads(args["model_config"])
        model_dir = Path(args["model_repository"]) if args.get("model_repository") else self.MODEL_DIR
        self.settings = TritonModelSettings.from_config(model_config, model_dir)
        self.model_name = args.get("model_name", self.settings.model_name)
        self._stopping = stop_on_sigterm(self.logger, self.model_name)
        self.signer = picture_signer(self.settings.c2pa_certificate, self.settings.c2pa_key)
        self.metrics = GenerationMetrics(pb_utils, self.model_name, signing=self.signer is not None)
        self.host = None
        owner = self.settings.engine_model or self.model_name
        engine_stub = owner == self.model_name and first_instance(args)
        # what the model draws, on the metrics port for the door (read from headers: no weights
        # needed); the engine's stub also judges the adapters (torch), which a twin forwards to it
        self.advertised = PublishedFacts(pb_utils, self.model_name, model_capabilities(self.settings),
                                         model_offer(self.settings, args) if engine_stub else None) \
            if first_instance(args) else None
        if engine_stub:
            from .engine_start import start_host

            self.host = start_host(pb_utils, self.model_name, self.settings, model_config, model_dir, args,
                                   self._stopping)
        self.link = EngineLink(owner, self.model_name, self.KIND)
        if owner != self.model_name or self.host is None:
            self.logger.log_info(f"{self.model_name} ({args.get('model_instance_name', '')}): hands its requests to "
                                 f"the engine of {owner}")

    def finalize(self) -> None:
        """Queued and running requests end with CANCELLED, then the engine (and its ranks) stops."""
        if self.advertised is not None:
            self.advertised.close()
        if self.host is not None:
            self.host.close()
            self.host.engine.close()
            self.host = None
        self.link.close()

    # ------------------------------------------------------------------ requests

    def execute(self, requests: list[Any]) -> list[Any]:
        """All of them go to the engine at once (they share its steps); one answer each, in order."""
        answers: list[queue.Queue] = []
        for request in requests:
            answers.append(queue.Queue())
            self._submit(request, Call(None, time.perf_counter()), answers[-1].put, final_only=True)
        return [self._answer(request, q) for request, q in zip(requests, answers)]

    def _submit(self, request: Any, call: Call, deliver: Any, final_only: bool) -> None:
        """Hand ``request`` to the engine; every message about it goes to ``deliver((header, blobs, call))``."""
        probe = call.sender if call.sender is not None else request  # a decoupled request asks its sender

        def cancelled() -> bool:
            return probe.is_cancelled() or self._stopping.is_set()

        try:
            self.link.submit(request.inputs(), request.parameters(), lambda h, b: deliver((h, b, call)), cancelled,
                             final_only)
        except EngineUnavailable as exc:
            deliver((failure_header(WORKERS_DOWN, str(exc)), [], call))

    def _answer(self, request: Any, answers: queue.Queue) -> Any:
        """The request's one response. A request whose engine went away (its stub died) is sent again
        (twice at most): the link waits for the engine the watchdog's reload brings back, and a plain answer
        has sent nothing yet, so the client sees only the image."""
        retries = ENGINE_LOST_RETRIES
        while True:
            header, blobs, call = answers.get()
            if retries and engine_lost(header) and not self._stopping.is_set() and not request.is_cancelled():
                retries -= 1
                self.logger.log_warn(f"{self.model_name}: {header.get('message')}; sending the request again")
                time.sleep(ENGINE_LOST_PAUSE_S)
                self._submit(request, call, answers.put, final_only=True)
                continue
            response, header = self._answer_of(header, blobs, call)
            if header.get("type") in ("final", "error"):
                return response

    def _answer_of(self, header: dict[str, Any], blobs: list[bytes], call: Call) -> tuple[Any, dict[str, Any]]:
        """(response, header) of one message; one that cannot be answered (an image that fails to
        encode) ends its request with an internal error instead, never left without its answer."""
        try:
            return self._message(header, blobs, call), header
        except Exception as exc:  # noqa: BLE001 - the request ends with its error, the model goes on
            failed = failure_header(INTERNAL, INTERNAL.message(f"{type(exc).__name__}: {exc}"))
            return self._error(failed, call), failed

    def _message(self, header: dict[str, Any], blobs: list[bytes], call: Call) -> Any:
        """A message from the engine -> this model's response to it (None: nothing to send)."""
        kind = header.get("type")
        if kind == "accepted":
            call.options = header
        elif kind == "step":
            self.metrics.step(float(header.get("seconds") or 0.0))
            return self._progress(header, blobs, call)
        elif kind == "final":
            self.metrics.step(float(header.get("seconds") or 0.0))
            return self._final(header, blobs, call)
        elif kind == "error":
            return self._error(header, call)
        return None

    def _progress(self, header: dict[str, Any], blobs: list[bytes], call: Call) -> Any:
        """A plain model answers once: no progress responses."""
        return None

    def _final(self, header: dict[str, Any], blobs: list[bytes], call: Call) -> Any:
        pixels = np.frombuffer(blobs[0], dtype=np.uint8).reshape(header["shape"])
        resize = call.options.get("resize")
        fmt, record = call.options.get("format", "png"), call.options.get("record")
        image = encode_image(pixels, fmt, tuple(resize) if resize else None, record=record)
        if self.signer is not None:  # the manifest holds the record as the file does
            image = self.signer.sign(image, fmt, None if record is None else stored_record(PIL_FORMATS[fmt], record))
        seconds = time.perf_counter() - call.start
        self.metrics.success(seconds)
        self.logger.log_info(summary_line(self.model_name, header["summary"], len(image), seconds))
        rng_state = np.frombuffer(blobs[1], dtype=np.uint8).copy()
        return self.pb.InferenceResponse(output_tensors=self._final_tensors(header, call, image, rng_state))

    def _final_tensors(self, header: dict[str, Any], call: Call, image: bytes, rng_state: np.ndarray) -> list[Any]:
        return [self.pb.Tensor("IMAGE", np.array([image], dtype=np.object_)),
                self.pb.Tensor("NEXT_RNG_STATE", rng_state)]

    def _error(self, header: dict[str, Any], call: Call) -> Any:
        reason, message = str(header.get("reason", "internal")), str(header.get("message", ""))
        status = str(header.get("status", "INTERNAL"))
        self.metrics.failure(reason)
        self.logger.log_warn(f"{self.model_name}: {reason} after {time.perf_counter() - call.start:.2f}s: {message}")
        code = getattr(self.pb.TritonError, status, self.pb.TritonError.INTERNAL)
        return self.pb.InferenceResponse(error=self.pb.TritonError(message, code))
