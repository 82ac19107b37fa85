"""A generation model's settings: the ``parameters`` of its ``config.pbtxt``, resolved and checked.

See :data:`PARAMETER_DEFAULTS`:

* ``checkpoint``: checkpoint folder; env ``NEOPP_CHECKPOINT_<MODEL NAME UPPER>`` or
  ``NEOPP_CHECKPOINT`` overrides it (env paths resolve against the working directory);
* ``mode_file``: e.g. ``configs/neopp/neopp_dense.json``;
* ``lora_dir``: the folder a relative LoRA path of the mode file (its ``lora_configs``, shipped
  as a file name only) resolves against; env ``NEOPP_LORA_DIR_<MODEL NAME UPPER>`` or
  ``NEOPP_LORA_DIR`` overrides it, as for ``checkpoint``. A LoRA that does not fit the
  checkpoint is refused at load, naming the model, the LoRA file and the first key that misfits.
  The same folder is the model's adapter directory: a request's ``LORA`` names one of its files;
* ``lora_max_bytes``: the bytes of per-request adapters a model keeps resident (default 1 GiB);
  an adapter whose file or factors exceed it alone is refused from its size and header, unread;
* ``device``: ``auto`` (default) | ``cpu`` | ``cuda`` | ``cuda:N``. ``auto`` picks the
  instance's GPU for a KIND_GPU instance; otherwise, with CUDA present, GPU
  ``(instance index * world size) mod device count`` (so the KIND_CPU instances of a group
  land on disjoint GPUs), and the CPU when there is no CUDA;
* ``dtype``: ``auto`` (the pipeline's choice: bf16 on GPU, fp32 on CPU) | ``float32`` |
  ``bfloat16`` | ``float16``; ``num_threads``: torch CPU threads per process; 0 on CPUs shares the cores out
  over a mode's ranks; ``auto`` does too, and a one-process mode on a CPU then times a step on
  1, 2, 4... of its cores at load and keeps the fastest;
* ``gpus``, ``share_gpus``, ``layout``: a multi-GPU layout (``configs/<layout>.pbtxt``, see
  :mod:`neopp.serving.placement`): instance ``i`` of a KIND_MODEL group takes the ``i``-th slice of
  ``gpus``, and models of one layout on the same GPU are refused unless both share;
* limits: ``max_side``, ``max_pixels``, ``max_prefix_tokens``, ``max_steps``,
  ``max_index_offset``, ``max_request_bytes`` (docs/security.md); ``default_task``;
* ``allow_untrained_sizes``: ``false`` (default) refuses a size outside the sizes the checkpoint
  was trained at (its ``image_sizes`` / ``image_size_range``, narrowed by the mode file's) with
  a 400 naming them; ``true`` draws them anyway (they come out as noise, not a worse picture).
  Env ``NEOPP_ALLOW_UNTRAINED_SIZES`` replaces the default. ``max_steps`` is the one step limit:
  the server, ``/v1`` and the playground all hold it (at most 1000, the sampler's own bound);
* ``cache_methods``: the step caches a request may ask for (``CACHE``), comma-separated:
  ``auto`` (default: every method the layout supports, none with Ulysses ranks) or a list,
  ``none`` for none (``neopp_dense_8steps``: eight distilled steps have none to spare);
* ``record_prompt``: ``false`` (default) leaves the prompts out of each picture's record
  (:mod:`neopp.picture_record`; prompts can be private); ``true`` writes those a composing
  model passes (``RECORD_PROMPT``, ``RECORD_NEGATIVE_PROMPT``); env ``NEOPP_RECORD_PROMPT``;
* ``c2pa_certificate``, ``c2pa_key``: PEM files (a certificate chain, its private key) with which
  each final picture carries a signed C2PA manifest (:mod:`neopp.serving.c2pa_signing`); empty
  (default): nothing is signed. Env ``NEOPP_C2PA_CERTIFICATE`` / ``NEOPP_C2PA_KEY``;
* ``offload``: the decoder layers kept in pinned host memory and streamed to the GPU
  (:mod:`neopp.model.layer_offload`): ``none``, ``low`` (one layer on the GPU) or ``balanced``
  (three, copies overlapping compute); empty (default): the mode file's ``offload`` key, else
  ``none``. Env ``NEOPP_OFFLOAD``. Refused on a CPU device and with ``cuda_graphs: on``;
* ``warmup``: ``true`` (default) runs one step at the default size at load (:mod:`neopp.engines.warmup`),
  so the first request is as fast as the next ones; ``false`` skips it.
* step batching (docs/performance.md): ``token_budget``, the image tokens x branches one
  batched step may hold (a request joins the running batch at a step boundary while the sum
  stays within it); ``max_queued``, the requests that may wait to start (past it a request is
  refused at once, UNAVAILABLE "Exceeds maximum queue size", 429 through the HTTP door);
  ``patience``, the steps the oldest request that does not fit may wait while smaller ones pass
  it; ``engine_model`` (streamed twins): the model whose engine this one hands its requests to,
  holding no weights itself (empty: the model loads its own).
* speed on CUDA (:mod:`neopp.model.speed`), opt-in until a recorded GPU run shows each byte-equal
  to eager: ``cuda_graphs`` ``off`` (default) | ``auto`` (on for a one-process model on CUDA) |
  ``on``; ``max_graphs`` (8) graphs kept at once; ``attention_kernel`` ``default`` (default:
  torch's pick) | ``auto`` (the fastest SDPA kernel per shape, measured on CUDA) | ``flash`` |
  ``cudnn`` | ``efficient`` | ``math``; ``compile_layers`` ``off``
  (default) | ``on``. Env ``NEOPP_CUDA_GRAPHS``, ``NEOPP_ATTENTION_KERNEL`` and
  ``NEOPP_COMPILE_LAYERS`` in the server's environment replace these defaults.

Relative ``checkpoint``/``mode_file``/``lora_dir`` parameters resolve against ``NEOPP_BASE_DIR`` when set,
else the folder that holds the model repository (the project root), so the same repository
works from a checkout, from a wheel install and when mounted in NVIDIA's tritonserver container.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import replace as dc_replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..contract.deployment import CHECKPOINT_ENV, LORA_DIR_ENV, env_override, model_env_var
from ..engines.scheduler import DEFAULT_MAX_QUEUED, DEFAULT_PATIENCE, DEFAULT_TOKEN_BUDGET
from ..errors import ConfigError
from ..limits import Limits
from ..model.checkpoint_config import CheckpointConfig
from ..modes import MAX_STEPS_HARD, OFFLOAD_POLICIES, TASKS, ModeSpec, load_mode
from .parameters import read_parameters

if TYPE_CHECKING:  # the stubs that only forward requests read their settings without torch
    import torch

    from ..engines.spec import EngineSpec
    from ..model.speed import SpeedOptions

PARAMETER_DEFAULTS: dict[str, str] = {
    "checkpoint": "checkpoints/neopp",
    "mode_file": "configs/neopp/neopp_dense.json",
    "lora_dir": "checkpoints/lora",
    "lora_max_bytes": str(1 << 30),  # resident per-request adapters of the model, least recently used evicted
    "device": "auto",
    "dtype": "auto",
    "num_threads": "0",
    "worker_processes": "0",
    "collective_timeout_s": "120",
    "default_task": "t2i",
    "warmup": "true",
    "record_prompt": "false",
    "c2pa_certificate": "",
    "c2pa_key": "",
    "allow_untrained_sizes": "false",
    "token_budget": str(DEFAULT_TOKEN_BUDGET),
    "max_queued": str(DEFAULT_MAX_QUEUED),
    "patience": str(DEFAULT_PATIENCE),
    "engine_model": "",
    "cache_methods": "auto",
    "cuda_graphs": "off",
    "attention_kernel": "default",
    "max_graphs": "8",
    "compile_layers": "off",
    "offload": "",
    **{k: str(v) for k, v in Limits().__dict__.items()},
}
# What the server's environment may set for every model whose config does not: parameter -> variable.
ENV_DEFAULTS = {"allow_untrained_sizes": "NEOPP_ALLOW_UNTRAINED_SIZES", "cuda_graphs": "NEOPP_CUDA_GRAPHS",
                "attention_kernel": "NEOPP_ATTENTION_KERNEL", "compile_layers": "NEOPP_COMPILE_LAYERS",
                "c2pa_certificate": "NEOPP_C2PA_CERTIFICATE", "c2pa_key": "NEOPP_C2PA_KEY",
                "record_prompt": "NEOPP_RECORD_PROMPT", "offload": "NEOPP_OFFLOAD"}
_DTYPES = {"auto": None, "": None, "float32": "float32", "fp32": "float32", "bfloat16": "bfloat16",
           "bf16": "bfloat16", "float16": "float16", "fp16": "float16"}  # -> the torch dtype's name


def parameter_defaults(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The defaults of a model's parameters, the server's environment's among them (read at load)."""
    env = os.environ if env is None else env
    return {**PARAMETER_DEFAULTS, **{key: env[var] for key, var in ENV_DEFAULTS.items() if env.get(var)}}


def project_root(model_dir: Path | str | None, env: Mapping[str, str] | None = None) -> Path:
    """Where relative parameters resolve: env ``NEOPP_BASE_DIR``, else the folder that holds the
    model repository (Triton hands each model its own folder), never the installed package."""
    env = os.environ if env is None else env
    if env.get("NEOPP_BASE_DIR"):
        return Path(env["NEOPP_BASE_DIR"]).expanduser().resolve()
    if model_dir is None:
        raise ConfigError("the model's folder is unknown: set NEOPP_BASE_DIR or MODEL_DIR in model.py")
    return Path(model_dir).resolve().parent.parent


def resolve_deployment_path(params: Mapping[str, str], key: str, env_var: str, model_name: str, root: Path,
                            env: Mapping[str, str] | None = None) -> Path:
    """``<env_var>_<MODEL>``, then ``<env_var>``, then parameter ``key``: the weights a model
    serves are a deployment's choice, so the same repository serves tiny and real ones."""
    given = env_override(os.environ if env is None else env, env_var, model_name)
    if given is not None:
        return Path(given).expanduser().resolve()
    path = Path(params[key]).expanduser()
    return path if path.is_absolute() else root / path


def resolve_checkpoint(params: Mapping[str, str], model_name: str, root: Path,
                       env: Mapping[str, str] | None = None) -> Path:
    """Per-model env override, then NEOPP_CHECKPOINT, then the ``checkpoint`` parameter."""
    return resolve_deployment_path(params, "checkpoint", CHECKPOINT_ENV, model_name, root, env)


def resolve_lora_dir(params: Mapping[str, str], model_name: str, root: Path,
                     env: Mapping[str, str] | None = None) -> Path:
    """Per-model env override, then NEOPP_LORA_DIR, then the ``lora_dir`` parameter."""
    return resolve_deployment_path(params, "lora_dir", LORA_DIR_ENV, model_name, root, env)


def choose_device(param: str, instance_kind: str, device_id: int, instance_index: int,
                  world_size: int = 1) -> str:
    """Map the ``device`` parameter and the instance to a torch device (see module doc)."""
    param = (param or "auto").strip().lower()
    if param == "cpu" or param.startswith("cuda:"):
        return param
    if param not in ("auto", "cuda"):
        raise ConfigError(f"parameter device: {param!r} is not auto, cpu, cuda or cuda:N")
    import torch

    if not torch.cuda.is_available():
        if param == "cuda":
            raise ConfigError("parameter device: 'cuda' requested but CUDA is not available")
        return "cpu"
    if instance_kind.upper().endswith("GPU"):
        return f"cuda:{device_id}"
    return f"cuda:{(instance_index * world_size) % torch.cuda.device_count()}"


AUTO_THREADS = -1  # ``num_threads: auto``: measured at load where the mode runs in one CPU process


def threads_param(value: str) -> int:
    """``num_threads``: a count of 0 or more, or ``auto`` (``AUTO_THREADS``)."""
    if value.strip() == "auto":
        return AUTO_THREADS
    threads = int_param({"num_threads": value}, "num_threads")
    if threads < 0:
        raise ConfigError(f"parameter num_threads: 0 or more, or auto, got {value!r}")
    return threads


def int_param(params: Mapping[str, str], key: str) -> int:
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
    dtype_name: str | None  # a torch dtype's name; None: the engine's choice
    num_threads: int
    worker_processes: int
    collective_timeout_s: float
    default_task: str
    limits: Limits
    warmup: bool = True
    token_budget: int = DEFAULT_TOKEN_BUDGET
    max_queued: int = DEFAULT_MAX_QUEUED
    patience: int = DEFAULT_PATIENCE
    engine_model: str = ""
    lora_max_bytes: int = 1 << 30
    speed_params: tuple[str, str, int, str] = ("auto", "auto", 8, "off")  # SpeedOptions' fields
    untrained_sizes: bool = False
    cache_methods: tuple[str, ...] | None = None  # None: every method the mode supports
    record_prompt: bool = False  # the pictures' records keep the prompts they were given
    c2pa_certificate: Path | None = None  # with c2pa_key: final pictures carry a signed C2PA manifest
    c2pa_key: Path | None = None
    offload: str | None = None  # None: the mode file's

    @staticmethod
    def from_config(model_config: Mapping[str, Any], model_dir: Path | None) -> TritonModelSettings:
        params = read_parameters(model_config, parameter_defaults())
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
            int_param(params, key)
        limits = Limits.from_params(params)
        if not 1 <= limits.max_steps <= MAX_STEPS_HARD:
            raise ConfigError(f"parameter max_steps: must be in 1..{MAX_STEPS_HARD}, got {limits.max_steps}")
        return TritonModelSettings(
            model_name=name,
            checkpoint=resolve_checkpoint(params, name, root),
            mode_file=mode_file if mode_file.is_absolute() else root / mode_file,
            lora_dir=resolve_lora_dir(params, name, root),
            device_param=params["device"], dtype_name=_DTYPES[dtype_key],
            num_threads=threads_param(params["num_threads"]), default_task=task, limits=limits,
            worker_processes=int_param(params, "worker_processes"),
            collective_timeout_s=float(int_param(params, "collective_timeout_s")),
            warmup=_bool_param(params, "warmup"),
            untrained_sizes=_bool_param(params, "allow_untrained_sizes"),
            token_budget=int_param(params, "token_budget"),
            max_queued=int_param(params, "max_queued"),
            patience=int_param(params, "patience"),
            engine_model=_engine_model(params["engine_model"], name),
            lora_max_bytes=int_param(params, "lora_max_bytes"),
            speed_params=(params["cuda_graphs"].strip().lower(), params["attention_kernel"].strip().lower(),
                          int_param(params, "max_graphs"), params["compile_layers"].strip().lower()),
            cache_methods=_cache_methods(params["cache_methods"]),
            record_prompt=_bool_param(params, "record_prompt"),
            c2pa_certificate=_optional_path(params["c2pa_certificate"], root),
            c2pa_key=_optional_path(params["c2pa_key"], root),
            offload=_offload(params["offload"]),
        )


    @property
    def dtype(self) -> torch.dtype | None:
        import torch

        return None if self.dtype_name is None else getattr(torch, self.dtype_name)

    @property
    def speed(self) -> SpeedOptions:
        """The speed options (checked here: only the stub that loads the engine asks)."""
        from ..model.speed import SpeedOptions

        return SpeedOptions(*self.speed_params)

    def engine_spec(self) -> EngineSpec:
        """The engine's settings from this config; the mode, devices and threads are filled in at load."""
        from ..engines.spec import EngineSpec

        if self.token_budget < 1 or self.max_queued < 1 or self.patience < 0:
            raise ConfigError(f"model {self.model_name}: token_budget and max_queued must be positive and patience "
                              f"not negative, got {self.token_budget}, {self.max_queued}, {self.patience}")
        return EngineSpec(str(self.checkpoint), dtype=self.dtype, limits=self.limits,
                          collective_timeout_s=self.collective_timeout_s, speed=self.speed,
                          token_budget=self.token_budget, max_queued=self.max_queued, patience=self.patience,
                          lora_dir=str(self.lora_dir), lora_max_bytes=self.lora_max_bytes)


def _engine_model(value: str, own_name: str) -> str:
    name = value.strip()
    if name and (not re.fullmatch(r"[a-z][a-z0-9_]{0,63}", name) or name == own_name):
        raise ConfigError(f"parameter engine_model: {value!r} is not another model's name")
    return name


def _cache_methods(value: str) -> tuple[str, ...] | None:
    """``auto`` -> None; ``none`` (or empty) -> no method; else the listed names (the mode checks them
    against what it supports)."""
    text = value.strip().lower()
    if text == "auto":
        return None
    return () if text == "none" else tuple(m.strip() for m in text.split(",") if m.strip())


def _offload(value: str) -> str | None:
    text = value.strip().lower()
    if text and text not in OFFLOAD_POLICIES:
        raise ConfigError(f"parameter offload: one of {', '.join(OFFLOAD_POLICIES)} (empty: the mode file's), "
                          f"got {value!r}")
    return text or None


def _optional_path(value: str, root: Path) -> Path | None:
    """A file the operator names (relative: against the project root); empty: none."""
    if not value.strip():
        return None
    path = Path(value.strip()).expanduser()
    return path if path.is_absolute() else root / path


def _bool_param(params: Mapping[str, str], key: str) -> bool:
    value = params[key].strip().lower()
    if value not in ("true", "false", "1", "0"):
        raise ConfigError(f"parameter {key}: must be true or false, got {value!r}")
    return value in ("true", "1")


def load_model_mode(settings: TritonModelSettings) -> ModeSpec:
    """The model's mode with its LoRAs found in ``lora_dir`` and checked against the checkpoint's
    shapes, before any weight is read; a misfit names the model, the LoRA file and the key."""
    from ..model.checkpoint import generation_shapes
    from ..model.lora import check_loras

    try:
        mode = load_mode(settings.mode_file, lora_dir=settings.lora_dir)
        if mode.lora_configs:
            missing = [e["path"] for e in mode.lora_configs if not Path(e["path"]).is_file()]
            if missing:
                override = model_env_var(LORA_DIR_ENV, settings.model_name)
                raise ConfigError(f"LoRA file {missing[0]} does not exist (lora_dir {settings.lora_dir}; "
                                  f"set parameter lora_dir or env {override} / NEOPP_LORA_DIR)")
            check_loras(generation_shapes(settings.checkpoint), mode.lora_configs)
        mode = dc_replace(mode, cache_methods=settings.cache_methods, offload=settings.offload or mode.offload)
        mode.check()
        return CheckpointConfig.from_checkpoint(settings.checkpoint).fit(mode)
    except ConfigError as exc:
        raise ConfigError(f"model {settings.model_name}: {exc}") from exc
