"""Admission: a linked stub's tensors become one validated request with its starting noise.

The engine's host hands every request it receives here, once: the bytes are checked against the
model's limits, the tensors parsed (``parse_request``, or ``parse_stream_request`` for a streamed
twin), an adapter's recommendations filled in, the request validated by the engine and its size
by the model's capabilities, and only then its noise drawn, from the client's seed or state, or
from the mode's one instance stream (never shared by two requests).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from ..engines.engine import Engine
from ..model.adapter_store import AdapterDirectory, adapter_sampling
from ..modes import ModeSpec
from ..request import GenerationRequest
from ..sampling.rng import NoiseStream
from .capabilities import Capabilities
from .lanes import request_lane, request_parameters
from .model_settings import TritonModelSettings
from .picture_records import RecordSource, request_record
from .request_parsing import ParsedRequest, check_noise, check_request_bytes, parse_request
from .stream_parsing import StreamOptions, parse_stream_request, refuse_input_like_parameters
from .wire import declared_sizes, unpack_tensors

# What admission decides itself; every other field of the request is the parsed field of its name,
# so a new input reaches the engine through its row, its parse and the request's field alone.
DECIDED_HERE = frozenset({"height", "width", "task", "noise", "noise_scaled", "adapter"})


def carried_fields(parsed: ParsedRequest) -> dict[str, Any]:
    """The request's fields taken as parsed, by name."""
    return {f.name: getattr(parsed, f.name) for f in fields(GenerationRequest)
            if f.name not in DECIDED_HERE and hasattr(parsed, f.name)}


@dataclass
class Admitted:
    """An accepted request, and what its answer needs beyond the engine's events."""

    req: GenerationRequest
    rng_state: bytes  # the noise stream's state after this request's draw (NEXT_RNG_STATE)
    resize: tuple[int, int] | None
    options: StreamOptions
    record: str  # the picture's record (neopp.picture_record), as its file holds it


def seed_of(parsed: ParsedRequest) -> int | str:
    """The seed that redraws a request's noise, or why none does (a continued stream, a client's noise)."""
    if parsed.seed is not None:
        return int(parsed.seed)
    return "noise" if parsed.noise is not None else "stream"


def record_source(settings: TritonModelSettings, mode: ModeSpec) -> RecordSource:
    """What every record of the model says of where its pictures come from (hashing the
    checkpoint's files, once per file and machine)."""
    from ..model.checkpoint_digest import checkpoint_digest

    return RecordSource(settings.model_name, mode.name, settings.checkpoint.name,
                        checkpoint_digest(settings.checkpoint), settings.record_prompt)


class Admission:
    """The rules a request of one mode must pass before it reaches the engine."""

    def __init__(self, engine: Engine, settings: TritonModelSettings, mode: ModeSpec, owner: str) -> None:
        self.engine, self.settings, self.mode = engine, settings, mode
        self.kv_dims = engine.config.kv_dims
        self.capabilities = Capabilities.of(engine.config, mode, settings.limits, settings.untrained_sizes, owner)
        self.adapters = AdapterDirectory(settings.lora_dir)
        self.record_source = record_source(settings, mode)
        self.noise_stream = NoiseStream()  # the mode's own stream, for requests with neither SEED nor RNG_STATE
        self._stream_lock = threading.Lock()

    def admit(self, kind: str, header: dict[str, Any], blobs: list[bytes], fds: list[int]) -> Admitted:
        """The request of one message, or the error that refuses it (input errors name the input)."""
        limits = self.settings.limits
        check_request_bytes(declared_sizes(header.get("tensors"), blobs), limits)  # named, as a refusal
        inputs = unpack_tensors(header.get("tensors"), blobs, fds, limits.max_request_bytes)
        parsed, options = self._parse(kind, inputs, header.get("parameters"))
        req, stream = self._ready_request(parsed)
        if parsed.uses_instance_stream:
            with self._stream_lock:  # concurrent requests never share a draw
                self.noise_stream = stream
        record = request_record(self.record_source, req, seed_of(parsed), parsed.resize, parsed.recorded)
        return Admitted(req, stream.state(), parsed.resize, options, record)

    def _parse(self, kind: str, inputs: dict[str, Any], parameters: Any) -> tuple[ParsedRequest, StreamOptions]:
        limits, defaults = self.settings.limits, self.mode.sampling_params
        params = request_parameters(parameters)
        if kind == "stream":
            refuse_input_like_parameters(params)
            parsed, options = parse_stream_request(inputs, limits, self.kv_dims, defaults)
        else:
            parsed, options = parse_request(inputs, limits, defaults), StreamOptions()
        parsed.lane = request_lane(params)
        if parsed.lora is not None:  # what the adapter recommends, for what the request left unset
            parsed.sampling_params = adapter_sampling(self.adapters, parsed.lora, defaults, parsed.sampling_overrides)
        return parsed, options

    def _ready_request(self, parsed: ParsedRequest) -> tuple[GenerationRequest, NoiseStream]:
        """The validated request with its starting noise: the client's ``NOISE`` (LightX2V's draw,
        no stream used), else a draw from its stream, made only once the request is valid."""
        if parsed.seed is not None:
            stream = NoiseStream(parsed.seed)
        elif parsed.rng_state is not None:
            stream = NoiseStream.from_state(parsed.rng_state)
        else:
            with self._stream_lock:
                stream = NoiseStream.from_state(self.noise_stream.state())
        height, width = parsed.size or self.mode.default_size
        req = GenerationRequest(**carried_fields(parsed), height=height, width=width,
                                task=parsed.task or self.settings.default_task)
        self.engine.validate(req)
        self.capabilities.check_size(height, width)  # after the limits and the token multiple: a size it can run
        if parsed.noise is not None:
            check_noise(parsed.noise, (height, width))
            req.noise, req.noise_scaled = torch.from_numpy(np.array(parsed.noise)), True
        else:
            req.noise = stream.draw(height, width)
        return req, stream
