"""What every NeoPP generation model's ``model.py`` does, written once.

A model's ``model.py`` only subclasses :class:`NeoPPTritonModel` and sets ``MODEL_DIR``; its
settings (the ``parameters`` of ``config.pbtxt``) are read by :mod:`neopp.serving.model_settings`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..engines.engine import Engine
from ..engines.factory import build_engine
from ..engines.warmup import warm_up
from ..errors import ConfigError, GenerationCancelled
from ..image_io import encode_image
from ..model.checkpoint_config import CheckpointConfig
from ..parallel.mesh import check_world
from ..procs import restore_malloc_defaults
from ..request import GenerationRequest
from ..sampling.rng import NoiseStream
from .error_status import CANCELLED, INTERNAL, INVALID_INPUT, error_class
from .metrics import GenerationMetrics
from .model_settings import TritonModelSettings, choose_device, load_model_mode
from .parameters import narrow_kv_dims
from .placement import backend_devices, check_layout
from .request_log import request_line
from .request_parsing import (
    INPUT_SPECS,
    KV_INPUTS,
    OUTPUT_SPECS,
    REQUEST_INPUT_NAMES,
    InputSpec,
    ParsedRequest,
    check_noise,
    parse_request,
)


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


class NeoPPTritonModel:
    """Triton Python-backend model for one NeoPP generation mode (contract inputs/outputs)."""

    MODEL_DIR: Path | None = None  # model.py sets it to its model folder
    INPUTS: dict[str, InputSpec] = INPUT_SPECS  # the input and output tables auto-complete declares
    OUTPUTS: dict[str, InputSpec] = OUTPUT_SPECS

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
        """Load the mode and checkpoint once; every request reuses them."""
        import triton_python_backend_utils as pb_utils

        restore_malloc_defaults()  # the server's request-buffer tuning slows the denoising loop

        self.pb = pb_utils
        self.logger = pb_utils.Logger
        model_config = json.loads(args["model_config"])
        model_dir = Path(args["model_repository"]) if args.get("model_repository") else self.MODEL_DIR
        self.settings = TritonModelSettings.from_config(model_config, model_dir)
        self.model_name = args.get("model_name", self.settings.model_name)
        self.mode = load_model_mode(self.settings)
        default_size = self.mode.default_size
        if max(default_size) > self.settings.limits.max_side or \
                default_size[0] * default_size[1] > self.settings.limits.max_pixels:
            raise ConfigError(f"mode {self.mode.name}: default size {default_size} exceeds the model's limits")
        match = re.search(r"_(\d+)$", args.get("model_instance_name", ""))
        instance_index = int(match.group(1)) if match else 0
        if self.settings.worker_processes:
            check_world(self.mode, self.settings.worker_processes)
        device, gpus = self._place(model_config, model_dir, args, instance_index)
        self.engine = self._build_engine(device, gpus, instance_index, self._threads(model_config))
        self.kv_dims = self.engine.config.kv_dims
        self.noise_stream = NoiseStream()  # the instance's own stream for requests with neither SEED nor RNG_STATE
        self.metrics = GenerationMetrics(pb_utils, self.model_name)
        self._stopping = stop_on_sigterm(self.logger, self.model_name)
        warmed = f" warm-up {self._warm_up():.2f}s" if self.settings.warmup else ""
        self.logger.log_info(
            f"{self.model_name}: loaded {self.settings.checkpoint} mode={self.mode.name} "
            f"device={self.engine.device} dtype={self.engine.dtype} kv_dims={self.kv_dims} "
            f"threads={torch.get_num_threads()}{warmed}")

    def _build_engine(self, device: str, gpus: list[int] | None, instance_index: int,
                      threads: int | None) -> Engine:
        """The engine requests run on (the streaming models ask for step batching)."""
        return build_engine(self.settings.checkpoint, self.mode, device, self.settings.dtype, self.settings.limits,
                            threads, instance_index, gpus=gpus, collective_timeout_s=self.settings.collective_timeout_s,
                            speed=self.settings.speed)

    def _warm_up(self) -> float:
        return warm_up(self.engine, self.mode)

    def _place(self, model_config: Mapping[str, Any], model_dir: Path | None, args: Mapping[str, str],
               instance_index: int) -> tuple[str, list[int] | None]:
        """The instance's device and, for a layout naming GPUs, the model's GPU list (the rank pool
        takes this instance's slice of it). Checked against the layout's other models first."""
        kind = args.get("model_instance_kind", "CPU")
        if model_dir is not None:
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            placement = check_layout(model_config, Path(model_dir), self.mode.world_size, count)
            assigned = backend_devices(placement, kind, instance_index)
            if assigned is not None:
                return assigned
        return choose_device(self.settings.device_param, kind, int(args.get("model_instance_device_id", 0) or 0),
                             instance_index, self.mode.world_size), None

    def _threads(self, model_config: Mapping[str, Any]) -> int | None:
        """`num_threads`, or with 0 on a CPU: the cores shared out over every instance's ranks,
        so that raising the instance count does not oversubscribe the machine."""
        if self.settings.num_threads or torch.cuda.is_available():
            return self.settings.num_threads or None
        instances = sum(int(g.get("count", 1)) for g in model_config.get("instance_group", [])) or 1
        return max(1, (os.cpu_count() or 1) // (instances * self.mode.world_size))

    def execute(self, requests: list[Any]) -> list[Any]:
        """One response per request; a failing request never affects the next one."""
        return [self._serve(request) for request in requests]

    def finalize(self) -> None:
        """Unloading stops the rank workers of a multi-process mode; none is left behind."""
        if self.engine is not None:
            self.engine.close()
        self.engine = None

    # ------------------------------------------------------------------ one request

    def _serve(self, request: Any) -> Any:
        pb = self.pb
        start = time.perf_counter()
        try:
            if request.is_cancelled() or self._stopping.is_set():
                raise GenerationCancelled("request cancelled before generation started")
            parsed = parse_request(self._inputs(request), self.settings.limits, self.mode.sampling)
            gen_req, stream = self._ready_request(parsed)
            stop = lambda: request.is_cancelled() or self._stopping.is_set()  # noqa: E731
            pixels = self.engine.generate(gen_req, should_stop=stop,
                                             on_step=lambda _i, secs: self.metrics.step(secs))
            image = encode_image(pixels, gen_req.sampling.output_format, parsed.resize)
        except Exception as exc:  # noqa: BLE001 - every failure is answered; the model stays usable
            return self._refuse(exc, start)
        if parsed.uses_instance_stream:
            self.noise_stream = stream  # the instance stream advances only when an image is delivered
        seconds = time.perf_counter() - start
        self.metrics.success(seconds)
        self.logger.log_info(request_line(self.model_name, self.mode, gen_req,
                                          len(image), seconds))
        state = np.frombuffer(stream.state(), dtype=np.uint8).copy()
        return pb.InferenceResponse(output_tensors=[
            pb.Tensor("IMAGE", np.array([image], dtype=np.object_)),
            pb.Tensor("NEXT_RNG_STATE", state),
        ])

    def _refuse(self, exc: Exception, start: float) -> Any:
        """The error response for ``exc``: status and message prefix from its error class."""
        cls = error_class(exc)
        if cls is INVALID_INPUT:
            text = exc.named(REQUEST_INPUT_NAMES)
        elif cls is CANCELLED:
            text = f"{exc}{' (server shutting down)' if self._stopping.is_set() else ''}"
        elif cls is INTERNAL:
            self.logger.log_error(f"{self.model_name}: internal error\n{traceback.format_exc()}")
            text = f"{type(exc).__name__}: {exc}"
        else:
            text = str(exc)
        return self._fail(cls.reason, cls.message(text), getattr(self.pb.TritonError, cls.status), start)

    def _fail(self, reason: str, message: str, code: int, start: float) -> Any:
        self.metrics.failure(reason)
        self.logger.log_warn(f"{self.model_name}: {reason} after {time.perf_counter() - start:.2f}s: {message}")
        return self.pb.InferenceResponse(error=self.pb.TritonError(message, code))

    def _inputs(self, request: Any) -> dict[str, Any]:
        """Input name -> numpy array; BF16 KV through DLPack (``as_numpy`` cannot hold bf16)."""
        out: dict[str, Any] = {}
        for tensor in request.inputs():
            name = tensor.name()
            if name in KV_INPUTS:
                out[name] = torch.from_dlpack(tensor.to_dlpack())
            else:
                out[name] = tensor.as_numpy()
        return out

    def _ready_request(self, parsed: ParsedRequest) -> tuple[GenerationRequest, NoiseStream]:
        """The validated request with its starting noise: the client's ``NOISE`` (LightX2V's draw,
        no stream used), else a draw from its stream, made only once the request is valid."""
        gen_req, stream = self._generation_request(parsed)
        self.engine.validate(gen_req)
        if parsed.noise is not None:
            check_noise(parsed.noise, (gen_req.height, gen_req.width))
            gen_req.noise, gen_req.noise_scaled = torch.from_numpy(parsed.noise.copy()), True
        else:
            gen_req.noise = stream.draw(gen_req.height, gen_req.width)
        return gen_req, stream

    def _generation_request(self, parsed: ParsedRequest) -> tuple[GenerationRequest, NoiseStream]:
        """Sampling values and the stream of one request (the instance stream on a copy)."""
        sampling = parsed.sampling_values
        if parsed.seed is not None:
            stream = NoiseStream(parsed.seed)
        elif parsed.rng_state is not None:
            stream = NoiseStream.from_state(parsed.rng_state)
        else:
            stream = NoiseStream.from_state(self.noise_stream.state())
        height, width = parsed.size or self.mode.default_size
        return GenerationRequest(
            cond_kv=parsed.cond_kv, index_offset_cond=parsed.index_offset_cond, height=height, width=width,
            sampling=sampling,
            uncond_kv=parsed.uncond_kv, index_offset_uncond=parsed.index_offset_uncond,
            image_kv=parsed.image_kv, index_offset_image=parsed.index_offset_image,
            task=parsed.task or self.settings.default_task,
        ), stream
