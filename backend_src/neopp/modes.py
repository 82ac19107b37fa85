"""Mode files (`configs/neopp/*.json`) and the sampling values a call may override."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from dataclasses import replace as dc_replace
from pathlib import Path
from typing import Any

from .contract.inputs import CFG_NORMS
from .errors import ConfigError, InputError, shown
from .image_sizes import TrainedSizes
from .json_file import read_json_object
from .limits import CFG_SCALE_MAX_ABS, TIMESTEP_SHIFT_RANGE

OUTPUT_FORMATS = ("jpeg", "png", "webp")
TASKS = ("t2i", "i2i")
MAX_STEPS_HARD = 1000
# Per-request step caches (neopp.sampling.step_cache): off, first-block residual difference, and a
# forecast of the tower's residual (TaylorSeer, first order) decided before the tower.
CACHE_METHODS = ("off", "fbcache", "taylorseer")
OFFLOAD_POLICIES = ("none", "low", "balanced")  # see neopp.model.layer_offload


@dataclass(frozen=True)
class SamplingParams:
    """Per-call sampling values; a call overrides some, the rest keep the mode's defaults."""

    infer_steps: int = 50
    cfg_scale: float = 4.0
    timestep_shift: float = 3.0
    cfg_interval: tuple[float, float] = (-1.0, 2.0)
    enable_cfg: bool = True
    cfg_norm: str = "global"
    output_format: str = "jpeg"
    image_guidance_scale: float = 1.0
    cache: str = "off"
    cache_threshold: float | None = None  # None: the method's documented default

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise InputError naming the field and the rule: the one home of these rules."""
        if not isinstance(self.infer_steps, int) or not 1 <= self.infer_steps <= MAX_STEPS_HARD:
            raise InputError(f"infer_steps: must be an integer in 1..{MAX_STEPS_HARD}, got {shown(self.infer_steps)}")
        for name in ("cfg_scale", "timestep_shift", "image_guidance_scale"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise InputError(f"{name}: must be a finite number, got {shown(value)}")
        if abs(self.cfg_scale) > CFG_SCALE_MAX_ABS:  # a huge scale overflows the guided velocity to inf
            raise InputError(f"cfg_scale: must be within -{CFG_SCALE_MAX_ABS:g}..{CFG_SCALE_MAX_ABS:g}, "
                             f"got {self.cfg_scale:g}")
        if self.timestep_shift <= 0:
            raise InputError(f"timestep_shift: must be > 0, got {self.timestep_shift:g}")
        low, high = TIMESTEP_SHIFT_RANGE  # near 0 the schedule's denominator rounds to 0
        if not low <= self.timestep_shift <= high:
            raise InputError(f"timestep_shift: must be in {low:g}..{high:g}, got {self.timestep_shift:g}")
        lo_hi = self.cfg_interval
        if len(lo_hi) != 2 or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in lo_hi):
            raise InputError(f"cfg_interval: must be two finite numbers [low, high], got {shown(lo_hi)}")
        if lo_hi[0] > lo_hi[1]:
            raise InputError(f"cfg_interval: low ({lo_hi[0]}) must not exceed high ({lo_hi[1]})")
        if self.cfg_norm not in CFG_NORMS:
            raise InputError(f"cfg_norm: unknown normalisation {shown(self.cfg_norm)}; expected one of {CFG_NORMS}")
        if self.output_format not in OUTPUT_FORMATS:
            raise InputError(f"output_format: unknown format {shown(self.output_format)}; "
                             f"expected one of {OUTPUT_FORMATS}")
        if abs(self.image_guidance_scale) > CFG_SCALE_MAX_ABS:
            raise InputError(f"image_guidance_scale: must be within -{CFG_SCALE_MAX_ABS:g}..{CFG_SCALE_MAX_ABS:g}, "
                             f"got {self.image_guidance_scale:g}")
        self.check_cache()
        if self.image_guidance_scale != 1.0 and not self.enable_cfg:
            raise InputError(f"image_guidance_scale: {self.image_guidance_scale:g} refused; guidance is disabled "
                             "(enable_cfg false, e.g. the 8-step mode), only 1.0 is accepted")

    def check_cache(self) -> None:
        """A known method; a threshold, when given, in (0, 1] (a relative change: 1 is already a
        picture that drifts by its own size)."""
        if self.cache not in CACHE_METHODS:
            raise InputError(f"cache: unknown method {shown(self.cache)}; expected one of {CACHE_METHODS}")
        t = self.cache_threshold
        if t is None:
            return
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or not 0.0 < t <= 1.0:
            raise InputError(f"cache_threshold: must be a number in (0, 1], got {shown(t)}")
        if self.cache == "off":
            raise InputError(f"cache_threshold: {t:g} given with cache off; choose a method in cache too")

    def replace(self, **overrides: Any) -> SamplingParams:
        """A validated copy; `None` values keep the current field."""
        known = {f.name for f in fields(self)}
        for key in overrides:
            if key not in known:
                raise InputError(f"{key}: unknown sampling parameter")
        kept = {k: v for k, v in overrides.items() if v is not None}
        if "cfg_interval" in kept:
            kept["cfg_interval"] = tuple(float(v) for v in kept["cfg_interval"])
        if "output_format" in kept:
            kept["output_format"] = normalise_format(kept["output_format"])
        return dc_replace(self, **kept)


def normalise_format(fmt: str) -> str:
    fmt = str(fmt).lower()
    return "jpeg" if fmt == "jpg" else fmt


@dataclass(frozen=True)
class ModeSpec:
    """One deployable mode: model version, parallel layout, weight options, sampling defaults."""

    name: str = "neopp_dense"
    version: str = "dense"
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    cfg_p_size: int = 1
    seq_p_size: int = 1
    seq_p_attn_type: str = "ulysses"
    dit_quantized: bool = False
    dit_quant_scheme: str | None = None
    lora_configs: tuple[dict, ...] = ()
    default_size: tuple[int, int] = (1024, 1024)
    sizes: TrainedSizes = TrainedSizes()  # narrows the checkpoint's trained sizes (none: no narrowing)
    cache_methods: tuple[str, ...] | None = None  # step caches offered (None: every one the layout supports)
    offload: str = "none"  # decoder layers in host memory, streamed to the GPU: none | low | balanced

    @property
    def world_size(self) -> int:
        return self.cfg_p_size * self.seq_p_size

    @property
    def step_caches(self) -> tuple[str, ...]:
        """The step caches a request may ask for: none on Ulysses ranks (each would decide on its
        own token shard, and the ranks must agree), else ``cache_methods`` or every method."""
        if self.seq_p_size > 1:
            return ()
        return CACHE_METHODS[1:] if self.cache_methods is None else self.cache_methods

    def check(self) -> None:
        if self.offload not in OFFLOAD_POLICIES:
            raise ConfigError(f"mode {self.name}: offload: one of {', '.join(OFFLOAD_POLICIES)}, got {self.offload!r}")
        if self.cache_methods:
            unknown = [m for m in self.cache_methods if m not in CACHE_METHODS[1:]]
            if unknown:
                raise ConfigError(f"mode {self.name}: cache_methods: unknown method {unknown[0]!r}; "
                                  f"expected some of {CACHE_METHODS[1:]}")
            if self.seq_p_size > 1:
                raise ConfigError(f"mode {self.name}: cache_methods: a step cache is not offered with Ulysses "
                                  "(seq_p_size > 1): each rank would decide on its own token shard; list none")
        if self.version not in ("dense", "moe"):
            raise ConfigError(f"mode {self.name}: 'version' must be 'dense' or 'moe', got {self.version!r}")
        if self.cfg_p_size not in (1, 2):
            raise ConfigError(f"mode {self.name}: 'parallel.cfg_p_size' must be 1 or 2, got {self.cfg_p_size}")
        if self.seq_p_size < 1:
            raise ConfigError(f"mode {self.name}: 'parallel.seq_p_size' must be >= 1, got {self.seq_p_size}")
        if self.seq_p_size > 1 and self.seq_p_attn_type != "ulysses":
            raise ConfigError(f"mode {self.name}: 'seq_p_attn_type' {self.seq_p_attn_type!r} unsupported; "
                              "only 'ulysses'")
        if self.dit_quantized and self.dit_quant_scheme not in ("fp8-sgl", "fp8"):
            raise ConfigError(f"mode {self.name}: 'dit_quant_scheme' {self.dit_quant_scheme!r} unsupported; "
                              "use 'fp8-sgl'")
        for entry in self.lora_configs:
            if "path" not in entry:
                raise ConfigError(f"mode {self.name}: every 'lora_configs' entry needs a 'path'")


def resolve_lora_path(path: str, base_dir: Path | None, lora_dir: Path | None) -> str:
    """An absolute LoRA path as given; a relative one against ``lora_dir``, else ``base_dir``.

    Shipped mode files name only the LoRA's file: where LoRAs live is a deployment setting
    (a model's ``lora_dir``), so the same mode file serves the tiny test LoRA and the real one.
    """
    if Path(path).is_absolute():
        return path
    folder = lora_dir if lora_dir is not None else base_dir
    return str((Path(folder).expanduser() / path).resolve()) if folder is not None else path


def mode_from_dict(raw: dict, name: str = "mode", base_dir: Path | None = None,
                   lora_dir: Path | None = None) -> ModeSpec:
    """Build a ModeSpec from the seed's JSON layout; LoRA paths resolve as :func:`resolve_lora_path`."""
    parallel = raw.get("parallel") or {}
    sampling_keys = {f.name for f in fields(SamplingParams)}
    try:
        sampling = SamplingParams(**{k: (tuple(v) if k == "cfg_interval" else v)
                                     for k, v in raw.items() if k in sampling_keys})
    except InputError as exc:
        raise ConfigError(f"mode {name}: {exc}") from exc
    loras = []
    for entry in raw.get("lora_configs") or []:
        entry = dict(entry)
        if "path" in entry:
            entry["path"] = resolve_lora_path(str(entry["path"]), base_dir, lora_dir)
        loras.append(entry)
    size = raw.get("target_shape") or raw.get("default_size") or [1024, 1024]
    mode = ModeSpec(
        name=name, version=raw.get("version", "dense"), sampling_params=sampling,
        cfg_p_size=int(parallel.get("cfg_p_size", 1)), seq_p_size=int(parallel.get("seq_p_size", 1)),
        seq_p_attn_type=parallel.get("seq_p_attn_type", "ulysses"),
        dit_quantized=bool(raw.get("dit_quantized", False)), dit_quant_scheme=raw.get("dit_quant_scheme"),
        lora_configs=tuple(loras), default_size=(int(size[0]), int(size[1])),
        sizes=TrainedSizes.from_raw(raw, f"mode {name}"), offload=str(raw.get("offload", "none")),
    )
    mode.check()
    return mode


def load_mode(path: str | Path, lora_dir: str | Path | None = None) -> ModeSpec:
    """A mode file; its relative LoRA paths resolve against ``lora_dir`` (else the file's folder)."""
    path = Path(path)
    raw = read_json_object(path, "mode file")
    return mode_from_dict(raw, name=path.stem, base_dir=path.parent,
                          lora_dir=None if lora_dir is None else Path(lora_dir))
