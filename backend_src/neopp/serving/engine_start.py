"""The start of a mode's engine in its owner stub: the mode, its devices and threads, warm-up.

The first instance of a generation model loads the engine here and hands it to an
``EngineHost``; the model's other instances and its streamed twin only link to that host.
"""

from __future__ import annotations

import os
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError
from ..modes import ModeSpec
from .engine_host import EngineHost
from .model_settings import AUTO_THREADS, TritonModelSettings


def start_host(pb: Any, model_name: str, settings: TritonModelSettings, model_config: dict[str, Any],
               model_dir: Path | None, args: dict[str, str], stopping: threading.Event) -> EngineHost:
    """Load the mode and its engine on this instance's devices, warm it up, open the socket."""
    from ..engines.engine import EngineHooks
    from ..engines.factory import build_engine
    from ..engines.intra_op import on_passing_thread, single_threaded_here_on, timings_text
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
    spec = replace(settings.engine_spec(), mode=mode, devices=devices, threads=engine_threads(settings, mode),
                   measure_threads=settings.num_threads == AUTO_THREADS and mode.world_size == 1
                   and devices[0] == "cpu")
    engine = on_passing_thread(lambda: build_engine(spec, hooks))
    threads = getattr(engine, "threads", torch.get_num_threads())  # a rank pool's ranks set their own
    timings = getattr(engine, "thread_timings", None)
    measured = "" if not timings else f" (a step on {timings_text(timings)})"
    single_threaded_here_on()  # the stub's thread parses requests; the engine's thread steps
    warmed = warm_up(engine, mode) if settings.warmup else None
    counting.set()  # the warm-up leaves the metrics untouched
    pb.Logger.log_info(f"{model_name}: loaded {settings.checkpoint} mode={mode.name} device={engine.device} "
                       f"dtype={engine.dtype} kv_dims={engine.config.kv_dims} threads={threads}{measured} "
                       f"token_budget={spec.token_budget} max_queued={spec.max_queued} offload={mode.offload}"
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
    """`num_threads`, or with 0 or ``auto`` on a CPU: the cores shared out over the engine's ranks
    (the model's other instances only forward requests; ``auto`` then measures up to that)."""
    if settings.num_threads > 0 or torch.cuda.is_available():
        return max(settings.num_threads, 0) or None
    return max(1, (os.cpu_count() or 1) // mode.world_size)
