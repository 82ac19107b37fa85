"""What every NeoPP generation model's ``model.py`` does, written once.

A model's ``model.py`` only subclasses :class:`NeoPPTritonModel` and sets ``MODEL_DIR``.
Settings come from ``parameters`` in ``config.pbtxt`` (see :data:`PARAMETER_DEFAULTS`):

* ``checkpoint``: checkpoint folder; env ``NEOPP_CHECKPOINT_<MODEL NAME UPPER>`` or
  ``NEOPP_CHECKPOINT`` overrides it (env paths resolve against the working directory);
* ``mode_file``: e.g. ``configs/neopp/neopp_dense.json``;
* ``lora_dir``: the folder a relative LoRA path of the mode file (its ``lora_configs``, shipped
  as a file name only) resolves against; env ``NEOPP_LORA_DIR_<MODEL NAME UPPER>`` or
  ``NEOPP_LORA_DIR`` overrides it, as for ``checkpoint``. A LoRA that does not fit the
  checkpoint is refused at load, naming the model, the LoRA file and the first key that misfits;
* ``device``: ``auto`` (default) | ``cpu`` | ``cuda`` | ``cuda:N``. ``auto`` picks the
  instance's GPU for a KIND_GPU instance; otherwise, with CUDA present, GPU
  ``(instance index * world size) mod device count`` (so the KIND_CPU instances of a group
  land on disjoint GPUs), and the CPU when there is no CUDA;
* ``dtype``: ``auto`` (the pipeline's choice: bf16 on GPU, fp32 on CPU) | ``float32`` |
  ``bfloat16`` | ``float16``; ``num_threads``: torch CPU threads per process, 0 shares the cores out over the
  model's instances and ranks (on CPUs);
* ``gpus``, ``share_gpus``, ``layout``: a multi-GPU layout (``configs/<layout>.pbtxt``, see
  :mod:`neopp.serving.placement`): instance ``i`` of a KIND_MODEL group takes the ``i``-th slice of
  ``gpus``, and models of one layout on the same GPU are refused unless both share;
* limits: ``max_side``, ``max_pixels``, ``max_prefix_tokens``, ``max_steps``,
  ``max_index_offset``, ``max_request_bytes`` (docs/security.md); ``default_task``;
* ``warmup``: ``true`` (default) runs one step at the default size at load (:mod:`neopp.warmup`),
  so the first request is as fast as the next ones; ``false`` skips it.

Relative ``checkpoint``/``mode_file``/``lora_dir`` parameters resolve against ``NEOPP_BASE_DIR`` when set,
else the folder that holds the model repository (the project root), so the same repository
works from a checkout, from a wheel install and when mounted in NVIDIA's tritonserver container.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..checkpoint import generation_shapes
from ..checkpoint_config import CheckpointConfig
from ..engines import build_engine
from ..errors import ConfigError, GenerationCancelled
from ..image_io import encode_image
from ..limits import Limits
from ..lora import check_loras
from ..modes import TASKS, ModeSpec, load_mode
from ..parallel.mesh import check_world
from ..pipeline import GenerationRequest
from ..request_log import parallelism_note
from ..rng import NoiseStream
from ..warmup import warm_up
from .error_status import CANCELLED, INTERNAL, INVALID_INPUT, error_class
from .metrics import GenerationMetrics
from .parameters import read_parameters
from .placement import backend_devices, check_layout
from .procs import restore_malloc_defaults
from .request_parsing import INPUT_SPECS, KV_INPUTS, OUTPUT_SPECS, REQUEST_INPUT_NAMES, ParsedRequest, parse_request

PARAMETER_DEFAULTS: dict[str, str] = {
    "checkpoint": "checkpoints/neopp",
    "mode_file": "configs/neopp/neopp_dense.json",
    "lora_dir": "checkpoints/lora",
    "device": "auto",
    "dtype": "auto",
    "num_threads": "0",
    "worker_processes": "0",
    "collective_timeout_s": "120",
    "default_task": "t2i",
    "warmup": "true",
    **{k: str(v) for k, v in Limits().__dict__.items()},
}
_DTYPES = {"auto": None, "": None, "float32": torch.float32, "fp32": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def project_root(model_dir: Path | str | None, env: Mapping[str, str] | None = None) -> Path:
    """Where relative parameters resolve: env ``NEOPP_BASE_DIR``, else the folder that holds the
    model repository (Triton hands each model its own folder), never the installed package."""
    env = os.environ if env is None else env
    if env.get("NEOPP_BASE_DIR"):
        return Path(env["NEOPP_BASE_DIR"]).expanduser().resolve()
    if model_dir is None:
        raise ConfigError("the model's folder is unknown: set NEOPP_BASE_DIR or MODEL_DIR in model.py")
    return Path(model_dir).resolve().parent.parent


def model_env_var(prefix: str, model_name: str) -> str:
    """The per-model override of a setting: ``<prefix>_<MODEL NAME UPPER>``."""
    return prefix + "_" + re.sub(r"[^A-Za-z0-9]", "_", model_name).upper()


def resolve_deployment_path(params: Mapping[str, str], key: str, env_var: str, model_name: str, root: Path,
                            env: Mapping[str, str] | None = None) -> Path:
    """``<env_var>_<MODEL>``, then ``<env_var>``, then parameter ``key``: the weights a model
    serves are a deployment's choice, so the same repository serves tiny and real ones."""
    env = os.environ if env is None else env
    for var in (model_env_var(env_var, model_name), env_var):
        if env.get(var):
            return Path(env[var]).expanduser().resolve()
    path = Path(params[key]).expanduser()
    return path if path.is_absolute() else root / path


def resolve_checkpoint(params: Mapping[str, str], model_name: str, root: Path,
                       env: Mapping[str, str] | None = None) -> Path:
    """Per-model env override, then NEOPP_CHECKPOINT, then the ``checkpoint`` parameter."""
    return resolve_deployment_path(params, "checkpoint", "NEOPP_CHECKPOINT", model_name, root, env)


def resolve_lora_dir(params: Mapping[str, str], model_name: str, root: Path,
                     env: Mapping[str, str] | None = None) -> Path:
    """Per-model env override, then NEOPP_LORA_DIR, then the ``lora_dir`` parameter."""
    return resolve_deployment_path(params, "lora_dir", "NEOPP_LORA_DIR", model_name, root, env)


def choose_device(param: str, instance_kind: str, device_id: int, instance_index: int,
                  world_size: int = 1) -> str:
    """Map the ``device`` parameter and the instance to a torch device (see module doc)."""
    param = (param or "auto").strip().lower()
    if param == "cpu" or param.startswith("cuda:"):
        return param
    if param not in ("auto", "cuda"):
        raise ConfigError(f"parameter device: {param!r} is not auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        if param == "cuda":
            raise ConfigError("parameter device: 'cuda' requested but CUDA is not available")
        return "cpu"
    if instance_kind.upper().endswith("GPU"):
        return f"cuda:{device_id}"
    return f"cuda:{(instance_index * world_size) % torch.cuda.device_count()}"


def _int_param(params: Mapping[str, str], key: str) -> int:
    try:
        return int(params[key])
    except ValueError as exc:
        raise ConfigError(f"parameter {key}: {params[key]!r} is not an integer") from exc


@dataclass(frozen=True)
class TritonModelSettings:
    """Everything a model instance reads from its config, resolved and checked."""

    model_name: str
    checkpoint: Path
    mode_file: Path
    lora_dir: Path
    device_param: str
    dtype: torch.dtype | None
    num_threads: int
    worker_processes: int
    collective_timeout_s: float
    default_task: str
    limits: Limits
    warmup: bool = True

    @staticmethod
    def from_config(model_config: Mapping[str, Any], model_dir: Path | None) -> TritonModelSettings:
        params = read_parameters(model_config, PARAMETER_DEFAULTS)
        name = str(model_config.get("name", "neopp"))
        root = project_root(model_dir)
        mode_file = Path(params["mode_file"]).expanduser()
        dtype_key = params["dtype"].strip().lower()
        if dtype_key not in _DTYPES:
            raise ConfigError(f"parameter dtype: {params['dtype']!r} is not one of {sorted(k for k in _DTYPES if k)}")
        task = params["default_task"].strip().lower()
        if task not in TASKS:
            raise ConfigError(f"parameter default_task: {task!r} is not one of {list(TASKS)}")
        for key in Limits().__dict__:
            _int_param(params, key)
        limits = Limits.from_params(params)
        return TritonModelSettings(
            model_name=name,
            checkpoint=resolve_checkpoint(params, name, root),
            mode_file=mode_file if mode_file.is_absolute() else root / mode_file,
            lora_dir=resolve_lora_dir(params, name, root),
            device_param=params["device"], dtype=_DTYPES[dtype_key],
            num_threads=_int_param(params, "num_threads"), default_task=task, limits=limits,
            worker_processes=_int_param(params, "worker_processes"),
            collective_timeout_s=float(_int_param(params, "collective_timeout_s")),
            warmup=_bool_param(params, "warmup"),
        )


def _bool_param(params: Mapping[str, str], key: str) -> bool:
    value = params[key].strip().lower()
    if value not in ("true", "false", "1", "0"):
        raise ConfigError(f"parameter {key}: must be true or false, got {value!r}")
    return value in ("true", "1")


def load_model_mode(settings: TritonModelSettings) -> ModeSpec:
    """The model's mode with its LoRAs found in ``lora_dir`` and checked against the checkpoint's
    shapes, before any weight is read; a misfit names the model, the LoRA file and the key."""
    try:
        mode = load_mode(settings.mode_file, lora_dir=settings.lora_dir)
        if mode.lora_configs:
            missing = [e["path"] for e in mode.lora_configs if not Path(e["path"]).is_file()]
            if missing:
                override = model_env_var("NEOPP_LORA_DIR", settings.model_name)
                raise ConfigError(f"LoRA file {missing[0]} does not exist (lora_dir {settings.lora_dir}; "
                                  f"set parameter lora_dir or env {override} / NEOPP_LORA_DIR)")
            check_loras(generation_shapes(settings.checkpoint), mode.lora_configs)
    except ConfigError as exc:
        raise ConfigError(f"model {settings.model_name}: {exc}") from exc
    return mode


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

    @classmethod
    def auto_complete_config(cls, auto_complete_model_config: Any) -> Any:
        """Narrow COND_KV/UNCOND_KV to ``[layers, 2, -1, kv_heads, head_dim]`` of the checkpoint.

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
        for name, spec in INPUT_SPECS.items():
            entry = existing.get(name)
            if entry is None:
                auto_complete_model_config.add_input({"name": name, "data_type": spec.data_type,
                                                      "dims": kv_dims if name in KV_INPUTS else list(spec.dims),
                                                      "optional": spec.optional})
            elif name in KV_INPUTS:
                dims = [int(d) for d in entry.get("dims", [])]
                if len(dims) not in (0, 5) or any(d not in (-1, k) for d, k in zip(dims, kv_dims)):
                    raise ValueError(f"{name}: config.pbtxt dims {dims} contradict the checkpoint's {kv_dims}")
                entry["dims"] = kv_dims  # in place: add_input refuses to change declared dims
        present = {entry["name"] for entry in config.get("output", [])}
        for name, spec in OUTPUT_SPECS.items():
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
        self.engine = build_engine(self.settings.checkpoint, self.mode, device, self.settings.dtype,
                                         self.settings.limits, self._threads(model_config), instance_index,
                                         gpus=gpus, collective_timeout_s=self.settings.collective_timeout_s)
        self.kv_dims = self.engine.config.kv_dims
        self.stream = NoiseStream()  # the instance's own stream for requests with neither SEED nor RNG_STATE
        self.metrics = GenerationMetrics(pb_utils, self.model_name)
        self._stopping = stop_on_sigterm(self.logger, self.model_name)
        warmed = f" warm-up {warm_up(self.engine, self.mode):.2f}s" if self.settings.warmup else ""
        self.logger.log_info(
            f"{self.model_name}: loaded {self.settings.checkpoint} mode={self.mode.name} "
            f"device={self.engine.device} dtype={self.engine.dtype} kv_dims={self.kv_dims} "
            f"threads={torch.get_num_threads()}{warmed}")

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
            parsed = parse_request(self._inputs(request), self.settings.limits)
            gen_req, stream = self._generation_request(parsed)
            self.engine.validate(gen_req)
            gen_req.noise = stream.draw(gen_req.height, gen_req.width)  # only once the request is valid
            stop = lambda: request.is_cancelled() or self._stopping.is_set()  # noqa: E731
            pixels = self.engine.generate(gen_req, should_stop=stop,
                                             on_step=lambda _i, secs: self.metrics.step(secs))
            image = encode_image(pixels, gen_req.sampling.output_format, parsed.resize)
        except Exception as exc:  # noqa: BLE001 - every failure is answered; the model stays usable
            return self._refuse(exc, start)
        if parsed.seed is None and parsed.rng_state is None:
            self.stream = stream  # the instance stream advances only when an image is delivered
        seconds = time.perf_counter() - start
        self.metrics.success(seconds)
        self.logger.log_info(
            f"{self.model_name}: {gen_req.height}x{gen_req.width} task={gen_req.task} "
            f"prefix={parsed.prefix_tokens}+{0 if parsed.uncond_kv is None else parsed.uncond_kv.shape[2]} tokens "
            f"steps={gen_req.sampling.infer_steps} {gen_req.sampling.output_format} {len(image)} B "
            f"in {seconds * 1e3:.0f} ms end-to-end; "
            f"{parallelism_note(self.mode, gen_req, self.engine.guidance_plan(gen_req))}")
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

    def _generation_request(self, parsed: ParsedRequest) -> tuple[GenerationRequest, NoiseStream]:
        """Sampling values and the stream of one request (the instance stream on a copy)."""
        sampling = self.mode.sampling.replace(**parsed.sampling)
        if parsed.seed is not None:
            stream = NoiseStream(parsed.seed)
        elif parsed.rng_state is not None:
            stream = NoiseStream.from_state(parsed.rng_state)
        else:
            stream = NoiseStream.from_state(self.stream.state())
        height, width = parsed.size or self.mode.default_size
        return GenerationRequest(
            cond_kv=parsed.cond_kv, index_offset_cond=parsed.index_offset_cond, height=height, width=width,
            sampling=sampling,
            uncond_kv=parsed.uncond_kv, index_offset_uncond=parsed.index_offset_uncond,
            task=parsed.task or self.settings.default_task,
        ), stream
