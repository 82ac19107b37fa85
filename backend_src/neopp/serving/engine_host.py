"""The stub that runs a mode's engine, and the socket every stub of the mode sends requests to.

The first instance of a generation model (the **owner**) loads the mode's step-batching engine
and listens on a Unix socket (``engine_link.socket_path``); every instance of the model (the
owner's own included) and the model's streamed twin connect to it (``engine_link``). A request
arrives as the client's tensors; here it is parsed and validated once (``parse_request``, or
``parse_stream_request`` for a streamed twin), its noise is drawn from the mode's one instance
stream, and it joins the running batch at the next step. Each event goes back on the request's
connection (``engine_connection``) from a writer thread, so the engine never waits for a socket.
A connection that closes cancels its requests. The host writes the engine's heartbeat
(``neopp.engine_beat``); once its engine cannot serve, every request is refused at once with
UNAVAILABLE while the launcher replaces the model.
"""

from __future__ import annotations

import os
import socket
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..contract.statuses import CANCELLED, INTERNAL, INVALID_INPUT
from ..engine_beat import BEAT_S, beat_path, write_beat
from ..engines.engine import Engine
from ..errors import ConfigError, EngineDown, GenerationCancelled
from ..model.adapter_store import AdapterDirectory, adapter_sampling
from ..modes import ModeSpec
from ..request import GenerationRequest
from ..sampling.rng import NoiseStream
from ..sampling.sampler import StepEvent
from .capabilities import Capabilities
from .engine_connection import Connection, same_user
from .engine_link import socket_path
from .error_status import error_class
from .lanes import request_lane, request_parameters
from .model_settings import TritonModelSettings
from .request_log import request_summary
from .request_parsing import REQUEST_INPUT_NAMES, ParsedRequest, check_noise, check_request_bytes, parse_request
from .stream_parsing import StreamOptions, default_preview_size, parse_stream_request, refuse_input_like_parameters
from .wire import WireError, declared_sizes, error_header, unpack_tensors


@dataclass
class Accepted:
    """What the events of one accepted request need."""

    req: GenerationRequest
    rng_state: bytes


class EngineHost:
    """The owner's engine behind its socket; ``close`` stops listening, then the engine."""

    def __init__(self, owner: str, engine: Engine, settings: TritonModelSettings, mode: ModeSpec,
                 stopping: threading.Event, error_log: Any, on_held: Callable[[int], None] | None = None) -> None:
        self.owner, self.engine, self.settings, self.mode = owner, engine, settings, mode
        self.stopping, self.error_log = stopping, error_log
        self._on_held, self._held, self._held_lock = on_held, 0, threading.Lock()
        self.kv_dims = engine.config.kv_dims
        self.capabilities = Capabilities.of(engine.config, mode, settings.limits, settings.untrained_sizes, owner)
        self.adapters = AdapterDirectory(settings.lora_dir)
        self.noise_stream = NoiseStream()  # the mode's own stream, for requests with neither SEED nor RNG_STATE
        self._stream_lock = threading.Lock()
        self._connections: set[Connection] = set()
        self._closed = threading.Event()
        self.path = socket_path(owner)
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.path.parent, 0o700)
        if self.path.exists() or self.path.is_symlink():
            self.path.unlink()  # left by a stub of this model that died: its server (the folder) is ours
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(self.path))
        os.chmod(self.path, 0o600)
        self._inode = self.path.stat().st_ino  # a reload's new owner binds the same path before this one closes
        self._listener.listen(64)
        self.beat_path, self._told_failure = beat_path(owner, os.getppid()), False
        self._beat()
        threading.Thread(target=self._accept_loop, name="neopp-engine-accept", daemon=True).start()
        threading.Thread(target=self._beat_loop, name="neopp-engine-beat", daemon=True).start()

    def failure(self) -> str | None:
        """Why the engine can serve no more, or None (an engine without a loop of its own cannot fail so)."""
        return getattr(self.engine, "failure", None)

    def _beat_loop(self) -> None:
        while not self._closed.wait(BEAT_S):
            self._beat()

    def _beat(self) -> None:
        """Publish whether the engine can serve, while the socket is still this host's (a reload's
        new owner beats at the same path)."""
        failure = self.failure()
        if failure is not None and not self._told_failure:
            self._told_failure = True
            self.error_log(f"{self.owner}: engine out of service: {failure}; refusing requests until replaced")
        try:
            if self.path.stat().st_ino == self._inode:
                write_beat(self.beat_path, failure)
        except OSError:
            pass

    def close(self) -> None:
        """Stop listening. With its engine down, drop every connection too (it holds no request):
        a linked stub then connects to the engine that replaces this one (a reload binds the same
        path first) instead of being refused by this one until it exits."""
        self._closed.set()
        if self.failure() is not None:
            for conn in list(self._connections):
                conn.close()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        try:
            if self.path.stat().st_ino == self._inode:  # still ours, not the socket of a reload's new owner
                self.path.unlink()
                self.beat_path.unlink(missing_ok=True)
        except OSError:
            pass

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            if not same_user(sock):
                sock.close()
                continue
            conn = Connection(self, sock)
            self._connections.add(conn)
            conn.start()

    def forget(self, conn: Connection) -> None:
        self._connections.discard(conn)

    # ---- one request ---------------------------------------------------------------------------
    def accept(self, conn: Connection, job: int, header: dict[str, Any], blobs: list[bytes], fds: list[int]) -> None:
        """Parse, validate, draw the noise, submit; a refusal is the request's error event."""
        final_only = header.get("final_only") is True
        try:
            if self.stopping.is_set():
                raise GenerationCancelled("request cancelled before generation started")
            if (failure := self.failure()) is not None:
                raise EngineDown(failure)
            limits = self.settings.limits
            check_request_bytes(declared_sizes(header.get("tensors"), blobs), limits)  # named, as a refusal
            inputs = unpack_tensors(header.get("tensors"), blobs, fds, limits.max_request_bytes)
            parsed, options = self._parse(conn.kind, inputs, header.get("parameters"))
            gen_req, stream = self._ready_request(parsed)
        except WireError as exc:
            conn.refuse(job, INTERNAL.status, INTERNAL.reason, INTERNAL.message(f"malformed request: {exc}"))
            return
        except Exception as exc:  # noqa: BLE001 - every refusal is answered; the engine stays usable
            conn.refuse(job, *self.answer(exc))
            return
        if parsed.uses_instance_stream:
            with self._stream_lock:  # concurrent requests never share a draw
                self.noise_stream = stream
        preview = options.preview_size or default_preview_size(gen_req.height, gen_req.width)
        conn.send({"type": "accepted", "job": job, "format": gen_req.sampling.output_format,
                   "resize": list(parsed.resize) if parsed.resize else None, "preview_size": list(preview),
                   "base64_output": options.base64_output})
        accepted = Accepted(gen_req, stream.state())

        def deliver(event: StepEvent) -> None:
            if event.final is not None or event.error is not None:  # every request's one last event
                self._count_held(-1)
            conn.event(job, event, accepted)

        self._count_held(1)
        self.engine.submit(gen_req, deliver, lambda: conn.cancelled(job),
                           preview_every=0 if final_only else options.preview_every)

    def _count_held(self, change: int) -> None:
        """Requests the engine holds (running or waiting for their first step), for the metrics."""
        with self._held_lock:
            self._held += change
            if self._on_held is not None:
                self._on_held(self._held)

    def _parse(self, kind: str, inputs: dict[str, Any], parameters: Any) -> tuple[ParsedRequest, StreamOptions]:
        limits, defaults = self.settings.limits, self.mode.sampling
        params = request_parameters(parameters)
        if kind == "stream":
            refuse_input_like_parameters(params)
            parsed, options = parse_stream_request(inputs, limits, self.kv_dims, defaults)
        else:
            parsed, options = parse_request(inputs, limits, defaults), StreamOptions()
        parsed.lane = request_lane(params)
        if parsed.lora is not None:  # what the adapter recommends, for what the request left unset
            parsed.sampling_values = adapter_sampling(self.adapters, parsed.lora, defaults, parsed.sampling)
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
        req = GenerationRequest(
            cond_kv=parsed.cond_kv, index_offset_cond=parsed.index_offset_cond, height=height, width=width,
            sampling=parsed.sampling_values, uncond_kv=parsed.uncond_kv, index_offset_uncond=parsed.index_offset_uncond,
            image_kv=parsed.image_kv, index_offset_image=parsed.index_offset_image,
            task=parsed.task or self.settings.default_task, lora=parsed.lora, lora_scale=parsed.lora_scale,
            lane=parsed.lane)
        self.engine.validate(req)
        self.capabilities.check_size(height, width)  # after the limits and the token multiple: a size it can run
        if parsed.noise is not None:
            check_noise(parsed.noise, (height, width))
            req.noise, req.noise_scaled = torch.from_numpy(np.array(parsed.noise)), True
        else:
            req.noise = stream.draw(height, width)
        return req, stream

    def answer(self, exc: BaseException) -> tuple[str, str, str]:
        """(Triton status, metric reason, message) of a request's error, inputs named as clients know them."""
        cls = error_class(exc)
        if cls is INVALID_INPUT:
            text = exc.named(REQUEST_INPUT_NAMES)
        elif cls is CANCELLED:
            text = f"{exc}{' (server shutting down)' if self.stopping.is_set() else ''}"
        elif cls is INTERNAL:
            self.error_log(f"{self.owner}: internal error\n"
                           f"{''.join(traceback.format_exception(type(exc), exc, exc.__traceback__))}")
            text = f"{type(exc).__name__}: {exc}"
        else:
            text = str(exc)
        return cls.status, cls.reason, cls.message(text)

    def event_message(self, job: int, event: StepEvent, accepted: Accepted) -> tuple[dict[str, Any], list[bytes]]:
        """One engine event as the message its front gets (on the connection's writer thread)."""
        if event.error is not None:
            return error_header(job, *self.answer(event.error)), []
        head = {"job": job, "step": event.step, "total": event.total, "seconds": event.seconds}
        if event.final is not None:
            pixels = np.ascontiguousarray(event.final)
            return ({**head, "type": "final", "shape": list(pixels.shape),
                     "summary": request_summary(self.mode, accepted.req)}, [pixels.tobytes(), accepted.rng_state])
        if event.preview is not None:
            preview = np.ascontiguousarray(event.preview)
            return {**head, "type": "step", "preview": list(preview.shape)}, [preview.tobytes()]
        return {**head, "type": "step", "preview": None}, []


# ---------------------------------------------------------------- the owner's start

def start_host(pb: Any, model_name: str, settings: TritonModelSettings, model_config: dict[str, Any],
               model_dir: Path | None, args: dict[str, str], stopping: threading.Event) -> EngineHost:
    """Load the mode and its engine on this instance's devices, warm it up, open the socket."""
    from ..engines.engine import EngineHooks
    from ..engines.factory import build_engine
    from ..engines.warmup import warm_up
    from ..parallel.mesh import check_world
    from ..procs import restore_malloc_defaults
    from .metrics import EngineMetrics
    from .model_settings import load_model_mode

    restore_malloc_defaults()  # the server's request-buffer tuning slows the denoising loop
    mode = load_model_mode(settings)
    default_size = mode.default_size
    if max(default_size) > settings.limits.max_side or default_size[0] * default_size[1] > settings.limits.max_pixels:
        raise ConfigError(f"mode {mode.name}: default size {default_size} exceeds the model's limits")
    if settings.worker_processes:
        check_world(mode, settings.worker_processes)
    metrics, counting = EngineMetrics(pb, model_name), threading.Event()

    def observe(name: str) -> Any:
        return lambda value: getattr(metrics, name)(value) if counting.is_set() else None

    hooks = EngineHooks(queue_wait=observe("queue_wait"), batch_size=observe("batch"),
                        step_seconds=observe("step_time"))
    devices = engine_devices(settings, mode, model_config, model_dir, args)
    spec = replace(settings.engine_spec(), mode=mode, devices=devices, threads=engine_threads(settings, mode))
    engine = build_engine(spec, hooks)
    warmed = warm_up(engine, mode) if settings.warmup else None
    counting.set()  # the warm-up leaves the metrics untouched
    pb.Logger.log_info(f"{model_name}: loaded {settings.checkpoint} mode={mode.name} device={engine.device} "
                       f"dtype={engine.dtype} kv_dims={engine.config.kv_dims} threads={torch.get_num_threads()} "
                       f"token_budget={spec.token_budget} max_queued={spec.max_queued}"
                       f"{'' if warmed is None else f' warm-up {warmed:.2f}s'}")
    return EngineHost(model_name, engine, settings, mode, stopping, pb.Logger.log_error, metrics.held)


def engine_devices(settings: TritonModelSettings, mode: ModeSpec, model_config: dict[str, Any],
                   model_dir: Path | None, args: dict[str, str]) -> tuple[str, ...]:
    """The device of every rank of the engine. A layout naming GPUs is checked against the layout's
    other models first; the ranks take the first slice of the model's GPUs."""
    from ..engines.spec import instance_devices
    from .model_settings import choose_device
    from .placement import backend_devices, check_layout

    kind, world = args.get("model_instance_kind", "CPU"), mode.world_size
    if model_dir is not None:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        assigned = backend_devices(check_layout(model_config, Path(model_dir), world, count), kind, 0)
        if assigned is not None:
            first, gpus = assigned
            return (first,) if world == 1 else instance_devices(world, 0, gpus)
    device = choose_device(settings.device_param, kind, int(args.get("model_instance_device_id", 0) or 0), 0, world)
    return (device,) if world == 1 else instance_devices(world, 0, None)


def engine_threads(settings: TritonModelSettings, mode: ModeSpec) -> int | None:
    """`num_threads`, or with 0 on a CPU: the cores shared out over the engine's ranks (the model's
    other instances only forward requests)."""
    if settings.num_threads or torch.cuda.is_available():
        return settings.num_threads or None
    return max(1, (os.cpu_count() or 1) // mode.world_size)
