"""The checkpoint's `config.json`, read once and checked, so bad files fail at load with a name."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..image_sizes import TrainedSizes
from ..json_file import read_json_object
from ..modes import ModeSpec

# Modes whose noise grows with the token count; any other mode (upstream names "constant") keeps
# noise_scale as given. Every mode is capped at noise_scale_max_value, as upstream does.
SIZE_SCALED_NOISE_MODES = ("resolution", "dynamic", "dynamic_sqrt")
DEFAULT_RMS_NORM_EPS = 1e-6
_log = logging.getLogger(__name__)


def _get(section: dict, key: str, where: str, default: Any = ..., kind: type = int) -> Any:
    if key not in section:
        if default is ...:
            raise ConfigError(f"config.json: required key '{where}{key}' is missing")
        return default
    value = section[key]
    try:
        return kind(value) if kind is not bool else bool(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"config.json: '{where}{key}' = {value!r} is not {kind.__name__}") from exc


def _first_set(section: dict, keys: tuple[str, ...]) -> str | None:
    """The first of ``keys`` present with a non-null value (upstream treats null as unset)."""
    return next((k for k in keys if section.get(k) is not None), None)


def _moe_sizes(llm: dict) -> tuple[int, int]:
    """(experts, top-k) of the generation tower's MoE; (0, 0) for a dense tower.

    The official model reads ``gen_num_experts`` / ``gen_num_experts_per_tok`` and falls back
    to the understanding tower's ``num_experts`` / ``num_experts_per_tok`` when they are unset.
    """
    L = "llm_config."
    key = _first_set(llm, ("gen_num_experts", "num_experts"))
    experts = _get(llm, key, L) if key else 0
    if not experts:
        return 0, 0
    key = _first_set(llm, ("gen_num_experts_per_tok", "num_experts_per_tok"))
    if key is None:
        raise ConfigError("config.json: required key 'llm_config.gen_num_experts_per_tok' (or "
                          "'llm_config.num_experts_per_tok') is missing for an MoE checkpoint")
    return experts, _get(llm, key, L)


GGUF_SUFFIX = ".gguf"


def is_gguf(path: str | Path) -> bool:
    """A checkpoint named by its GGUF file (its config.json and tokenizer beside it)."""
    return Path(path).suffix == GGUF_SUFFIX


def checkpoint_folder(path: str | Path) -> Path:
    """The folder holding ``config.json``: the checkpoint itself, or a GGUF file's folder."""
    return Path(path).parent if is_gguf(path) else Path(path)


@dataclass(frozen=True)
class CheckpointConfig:
    """Geometry and constants of the generation tower, read from the checkpoint's config.json."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rope_theta_hw: float
    vision_hidden_size: int
    rope_theta_vision: float
    max_position_embeddings_vision: int
    patch_size: int = 16
    merge_size: int = 2
    noise_scale: float = 1.0
    noise_scale_mode: str = "resolution"
    noise_scale_base_image_seq_len: int = 64
    noise_scale_max_value: float = 8.0
    add_noise_scale_embedding: bool = True
    use_pixel_head: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = True
    rms_norm_eps: float = DEFAULT_RMS_NORM_EPS
    # Ours, optional: the size the checkpoint draws well ([height, width]); absent, a mode file's
    # default_size stands. The demo model (trained at 256x256) carries it.
    default_image_size: tuple[int, int] | None = None
    # Ours, optional: the sizes it was trained at (``image_sizes`` / ``image_size_range``, see
    # neopp.image_sizes); the server refuses others unless the operator allows untrained sizes.
    trained_sizes: TrainedSizes = TrainedSizes()

    @property
    def token_size(self) -> int:
        """Pixels per side of one image token (`T = P * M`)."""
        return self.patch_size * self.merge_size

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def kv_dims(self) -> tuple[int, int, int]:
        """(layers, kv_heads, head_dim): what a KV prefix must match."""
        return (self.num_layers, self.num_kv_heads, self.head_dim)

    @staticmethod
    def from_dict(raw: dict) -> CheckpointConfig:
        llm = raw.get("llm_config")
        vision = raw.get("vision_config")
        if not isinstance(llm, dict):
            raise ConfigError("config.json: required section 'llm_config' is missing")
        if not isinstance(vision, dict):
            raise ConfigError("config.json: required section 'vision_config' is missing")
        L, V = "llm_config.", "vision_config."
        num_experts, top_k = _moe_sizes(llm)
        config = CheckpointConfig(
            num_layers=_get(llm, "num_hidden_layers", L),
            hidden_size=_get(llm, "hidden_size", L),
            num_heads=_get(llm, "num_attention_heads", L),
            num_kv_heads=_get(llm, "num_key_value_heads", L),
            head_dim=_get(llm, "head_dim", L),
            rope_theta=_get(llm, "rope_theta", L, kind=float),
            rope_theta_hw=_get(llm, "rope_theta_hw", L, kind=float),
            vision_hidden_size=_get(vision, "hidden_size", V),
            rope_theta_vision=_get(vision, "rope_theta_vision", V, kind=float),
            max_position_embeddings_vision=_get(vision, "max_position_embeddings_vision", V),
            patch_size=_get(raw, "patch_size", "", 16),
            noise_scale=_get(raw, "noise_scale", "", 1.0, float),
            noise_scale_mode=_get(raw, "noise_scale_mode", "", "resolution", str),
            noise_scale_base_image_seq_len=_get(raw, "noise_scale_base_image_seq_len", "", 64),
            noise_scale_max_value=_get(raw, "noise_scale_max_value", "", 8.0, float),
            add_noise_scale_embedding=_get(raw, "add_noise_scale_embedding", "", True, bool),
            use_pixel_head=_get(raw, "use_pixel_head", "", False, bool),
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            norm_topk_prob=_get(llm, "norm_topk_prob", L, True, bool),
            rms_norm_eps=_get(llm, "rms_norm_eps", L, DEFAULT_RMS_NORM_EPS, float),
            default_image_size=_image_size(raw.get("default_image_size")),
            trained_sizes=TrainedSizes.from_raw(raw, "config.json", _get(raw, "patch_size", "", 16) * 2),
        )
        config.check()
        return config

    def fit(self, mode: ModeSpec) -> ModeSpec:
        """``mode`` with this checkpoint's default size, where it names one (a mode file's 1024x1024
        is the default only for a checkpoint that can draw it)."""
        if self.default_image_size is None or mode.default_size == self.default_image_size:
            return mode
        return replace(mode, default_size=self.default_image_size)

    @staticmethod
    def from_checkpoint(ckpt_dir: str | Path) -> CheckpointConfig:
        return CheckpointConfig.from_dict(read_json_object(checkpoint_folder(ckpt_dir) / "config.json",
                                                           "checkpoint config"))

    def check(self) -> None:
        """Reject geometry the computation cannot run, naming the key."""
        positive = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                    "vision_hidden_size", "patch_size", "max_position_embeddings_vision")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"config.json: '{name}' must be positive, got {getattr(self, name)}")
        if self.head_dim % 8:
            raise ConfigError(f"config.json: 'llm_config.head_dim' ({self.head_dim}) must be divisible by 8")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("config.json: 'num_attention_heads' must be a multiple of 'num_key_value_heads'")
        if self.vision_hidden_size % 4:
            raise ConfigError("config.json: 'vision_config.hidden_size' must be divisible by 4 (2-D RoPE)")
        if not (math.isfinite(self.rms_norm_eps) and self.rms_norm_eps > 0):
            raise ConfigError(f"config.json: 'llm_config.rms_norm_eps' must be a positive finite number, "
                              f"got {self.rms_norm_eps}")
        if self.noise_scale_mode not in SIZE_SCALED_NOISE_MODES + ("constant",):
            # Upstream does not refuse it either: it keeps noise_scale as given (capped).
            _log.warning("config.json: 'noise_scale_mode' %r is not one of %s; the initial noise uses "
                         "noise_scale unscaled (capped at noise_scale_max_value), as 'constant' does",
                         self.noise_scale_mode, SIZE_SCALED_NOISE_MODES + ("constant",))
        if self.default_image_size is not None and not self.trained_sizes.allows(*self.default_image_size):
            raise ConfigError(f"config.json: default_image_size {list(self.default_image_size)} is not among its "
                              f"trained sizes ({self.trained_sizes.describe()})")
        if self.is_moe and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"config.json: the MoE top-k ('llm_config.gen_num_experts_per_tok', else "
                              f"'num_experts_per_tok') must be in 1..{self.num_experts} (the expert count), "
                              f"got {self.num_experts_per_tok}")


def _image_size(value: Any) -> tuple[int, int] | None:
    """``default_image_size``: two positive multiples of 32, or absent."""
    if value is None:
        return None
    if not (isinstance(value, list) and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 and v % 32 == 0 for v in value)):
        raise ConfigError(f"config.json: default_image_size must be [height, width], positive multiples of 32, "
                          f"got {value!r}")
    return int(value[0]), int(value[1])
