"""The checks a request passes against the input table (``neopp.contract.inputs``) before any heavy work.

Pure Python/torch (no Triton import) so the rules are testable without a server and
identical for every generation model. Every failure is an ``InputError`` whose message
starts with the input's name and states the rule it broke.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..contract.inputs import INPUT_SPECS, TensorSpec
from ..errors import SHOWN_CHARS, InputError, shown
from ..limits import Limits, text_value
from ..model.adapter_store import lora_inputs
from ..modes import TASKS, SamplingParams
from ..request import check_offset, check_side_bounds, check_steps
from .picture_records import RecordedInputs, recorded_inputs

if TYPE_CHECKING:  # torch is imported where a tensor is handled: the session model never needs it
    import torch


TOKEN_PIXELS = 32  # an image token's side in every NeoPP checkpoint; RequestRules checks the real one
# NOISE bound: the noise scale is capped at 8 in every NeoPP checkpoint, and a standard normal
# draw of even 4096x4096x3 values stays far below 20, so a legitimate start is under 200.
NOISE_MAX_ABS = 1000.0

_NUMPY_KINDS = {"TYPE_INT64": np.int64, "TYPE_FP32": np.float32, "TYPE_UINT8": np.uint8}


@dataclass
class ParsedRequest:
    """A request's inputs, typed and checked against the contract and the limits."""

    cond_kv: torch.Tensor
    index_offset_cond: int
    uncond_kv: torch.Tensor | None = None
    index_offset_uncond: int | None = None
    image_kv: torch.Tensor | None = None
    index_offset_image: int | None = None
    size: tuple[int, int] | None = None
    seed: int | None = None
    rng_state: np.ndarray | None = None
    noise: np.ndarray | None = None  # the starting state itself, [1, 3, H, W] (LightX2V's draw)
    task: str | None = None
    resize: tuple[int, int] | None = None
    sampling_overrides: dict[str, Any] = field(default_factory=dict)  # SamplingParams.replace overrides
    sampling_params: SamplingParams = field(default_factory=SamplingParams)  # the defaults with them, checked
    lora: str | None = None  # an adapter's name (checked as a name; the model checks it exists)
    lora_scale: float = 1.0
    lane: str = ""  # the client lane (a request parameter, neopp.contract.client_lanes)
    recorded: RecordedInputs = field(default_factory=lambda: RecordedInputs())  # for the picture's record only

    @property
    def uses_instance_stream(self) -> bool:
        """No SEED, RNG_STATE or NOISE: the noise comes from the instance's own stream."""
        return self.seed is None and self.rng_state is None and self.noise is None

    @property
    def prefix_tokens(self) -> int:
        return int(self.cond_kv.shape[2])


def _check_shape(name: str, value: Any, spec: TensorSpec) -> None:
    shape = tuple(value.shape)
    if len(shape) != len(spec.dims) or any(d not in (-1, s) for d, s in zip(spec.dims, shape)):
        raise InputError(f"{name}: shape must be {list(spec.dims)} (-1 = any), got {list(shape)}")


def _numeric(name: str, value: Any, spec: TensorSpec) -> np.ndarray:
    import torch

    arr = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    want = _NUMPY_KINDS[spec.data_type]
    if arr.dtype != want:
        raise InputError(f"{name}: datatype must be {spec.data_type[5:]}, got {arr.dtype}")
    _check_shape(name, arr, spec)
    return arr


def _string(name: str, value: Any, spec: TensorSpec) -> str:
    arr = np.asarray(value)
    _check_shape(name, arr, spec)
    return text_value(name, arr.reshape(-1)[0])


def _choice(name: str, value: Any, choices: tuple[str, ...], what: str) -> str:
    """A string input looked up in a fixed table (lower-cased), before the core sees it."""
    word = _string(name, value, INPUT_SPECS[name]).lower()
    if word not in choices:
        raise InputError(f"{name}: unknown {what} {shown(word)}; expected one of {list(choices)}")
    return word


def _kv(name: str, value: Any) -> torch.Tensor:
    """Only the type here; geometry, length and NaN checks are RequestRules' (validate_kv)."""
    import torch

    if not isinstance(value, torch.Tensor):
        raise InputError(f"{name}: must be a BF16 tensor")
    if value.dtype != torch.bfloat16:
        raise InputError(f"{name}: datatype must be BF16, got {value.dtype}")
    if value.dim() != 5:
        raise InputError(f"{name}: must be 5-D [layers, 2, seq, kv_heads, head_dim], got shape {list(value.shape)}")
    return value


def _int(name: str, value: Any) -> int:
    return int(_numeric(name, value, INPUT_SPECS[name])[0])


def _pair(name: str, value: Any) -> tuple[int, int]:
    h, w = (int(v) for v in _numeric(name, value, INPUT_SPECS[name]))
    return h, w


def _size(value: Any, limits: Limits) -> tuple[int, int]:
    """SIZE's bounds; the multiple-of-token rule needs the checkpoint (RequestRules.check_size)."""
    h, w = _pair("SIZE", value)
    check_side_bounds(h, w, limits, "SIZE", TOKEN_PIXELS)
    return h, w


def _resize(value: Any, limits: Limits) -> tuple[int, int]:
    """RESIZE is the serving layer's own: any positive size within the same bounds as SIZE."""
    h, w = _pair("RESIZE", value)
    check_side_bounds(h, w, limits, "RESIZE")
    return h, w


def _offset(name: str, value: Any, limits: Limits) -> int:
    offset = _int(name, value)
    check_offset(offset, limits, name)
    return offset


def _nbytes(value: Any) -> int:
    """Bytes an input holds, read from its header (no copy); strings count their payload."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    arr = np.asarray(value)
    if arr.dtype == np.object_:
        return sum(len(item) if isinstance(item, (bytes, str)) else 8 for item in arr.reshape(-1))
    return int(arr.nbytes)


def _check_request_bytes(inputs: Mapping[str, Any], limits: Limits) -> None:
    """``max_request_bytes`` over every input, before the request leads to any allocation here.

    Triton has already received the tensors by then: over the wire its own transport bound
    applies first (gRPC: 2 GiB per message); through shared memory this is the bound.
    """
    check_request_bytes({name: _nbytes(value) for name, value in inputs.items() if value is not None}, limits)


def check_request_bytes(sizes: Mapping[str, int], limits: Limits) -> None:
    """``max_request_bytes`` over the inputs' sizes, the biggest input named in the refusal."""
    total = sum(sizes.values())
    if total > limits.max_request_bytes:
        biggest = max(sizes, key=sizes.__getitem__)
        raise InputError(f"{biggest}: the request's inputs hold {total} bytes ({biggest}: {sizes[biggest]}), "
                         f"over the limit max_request_bytes={limits.max_request_bytes}")


def parse_request(inputs: Mapping[str, Any], limits: Limits, defaults: SamplingParams | None = None) -> ParsedRequest:
    """Type and shape checks of every contract input, plus the rules the core does not know.

    ``defaults``: the model's sampling values, which the request's overrides replace (checked
    once, here, under the inputs' names).

    ``inputs`` maps input names to numpy arrays (torch tensors for BF16 KV); absent optional
    inputs are simply missing. The checks that need the checkpoint (KV geometry, NaN, size,
    offsets, guidance needing UNCOND_KV) are ``RequestRules.validate``'s, still before any
    denoising.
    """
    unknown = sorted(set(inputs) - set(INPUT_SPECS))
    if unknown:
        name = unknown[0] if len(unknown[0]) <= SHOWN_CHARS else shown(unknown[0])
        raise InputError(f"{name}: unknown input; expected names from {sorted(INPUT_SPECS)}")
    for name, spec in INPUT_SPECS.items():
        if not spec.optional and inputs.get(name) is None:
            raise InputError(f"{name}: required input is missing")
    _check_request_bytes(inputs, limits)
    req = ParsedRequest(cond_kv=_kv("COND_KV", inputs["COND_KV"]),
                        index_offset_cond=_offset("INDEX_OFFSET_COND", inputs["INDEX_OFFSET_COND"], limits))
    req.uncond_kv, req.index_offset_uncond = _optional_branch(inputs, "UNCOND", limits)
    req.image_kv, req.index_offset_image = _optional_branch(inputs, "IMAGE", limits)
    if inputs.get("SIZE") is not None:
        req.size = _size(inputs["SIZE"], limits)
    if inputs.get("RESIZE") is not None:
        req.resize = _resize(inputs["RESIZE"], limits)
    _parse_randomness(inputs, req)
    if inputs.get("TASK") is not None:
        req.task = _choice("TASK", inputs["TASK"], TASKS, "task")
    _parse_sampling(inputs, req, limits, defaults or SamplingParams())
    req.recorded = recorded_inputs(inputs)
    if inputs.get("LORA") is not None or inputs.get("LORA_SCALE") is not None:
        req.lora, req.lora_scale = lora_inputs(_string("LORA", inputs["LORA"], INPUT_SPECS["LORA"])
                                               if inputs.get("LORA") is not None else None,
                                               _numeric("LORA_SCALE", inputs["LORA_SCALE"], INPUT_SPECS["LORA_SCALE"])
                                               if inputs.get("LORA_SCALE") is not None else None)
    return req


def _optional_branch(inputs: Mapping[str, Any], branch: str, limits: Limits) -> tuple[Any, int | None]:
    """An optional prefix (``<branch>_KV``) and its offset (``INDEX_OFFSET_<branch>``): both or neither."""
    kv_name, off_name = f"{branch}_KV", f"INDEX_OFFSET_{branch}"
    has_kv, has_off = inputs.get(kv_name) is not None, inputs.get(off_name) is not None
    if has_kv != has_off:
        missing, other = (off_name, kv_name) if has_kv else (kv_name, off_name)
        raise InputError(f"{missing}: required together with {other}")
    if not has_kv:
        return None, None
    return _kv(kv_name, inputs[kv_name]), _offset(off_name, inputs[off_name], limits)


def _parse_randomness(inputs: Mapping[str, Any], req: ParsedRequest) -> None:
    """At most one source of the starting noise: SEED, RNG_STATE or NOISE (else the instance's stream)."""
    given = [name for name in ("SEED", "RNG_STATE", "NOISE") if inputs.get(name) is not None]
    if len(given) > 1:
        raise InputError(f"{given[0]}: give one of SEED, RNG_STATE and NOISE, not both {given[0]} and {given[1]} "
                         "(SEED starts a stream, RNG_STATE continues one, NOISE is the starting state itself)")
    if inputs.get("SEED") is not None:
        req.seed = _int("SEED", inputs["SEED"])
    if inputs.get("RNG_STATE") is not None:
        req.rng_state = _numeric("RNG_STATE", inputs["RNG_STATE"], INPUT_SPECS["RNG_STATE"])
    if inputs.get("NOISE") is not None:
        req.noise = _noise(inputs["NOISE"], req.size)


def _noise(value: Any, size: tuple[int, int] | None) -> np.ndarray:
    """NOISE: finite, within ``NOISE_MAX_ABS``, and the request's size (checked again against the
    mode's default size once that is known, in ``check_noise``)."""
    arr = _numeric("NOISE", value, INPUT_SPECS["NOISE"])
    if size is not None:
        check_noise(arr, size)
    if not np.isfinite(arr).all():
        raise InputError("NOISE: must be finite (no NaN or Inf)")
    peak = float(np.abs(arr).max()) if arr.size else 0.0
    if peak > NOISE_MAX_ABS:
        raise InputError(f"NOISE: values must lie within -{NOISE_MAX_ABS:g}..{NOISE_MAX_ABS:g} (a scaled normal draw "
                         f"does), got {peak:g}")
    return arr


def check_noise(noise: np.ndarray, size: tuple[int, int]) -> None:
    """NOISE's shape is [1, 3, height, width] of the image it starts."""
    if tuple(noise.shape[2:]) != tuple(size):
        raise InputError(f"NOISE: shape must be [1, 3, {size[0]}, {size[1]}] for a {size[0]}x{size[1]} image "
                         f"(SIZE, or the model's default size), got {list(noise.shape)}")


def _parse_sampling(inputs: Mapping[str, Any], req: ParsedRequest, limits: Limits, defaults: SamplingParams) -> None:
    """Sampling overrides, keyed by SamplingParams field; the mode keeps what is absent.

    Types are checked here; the values' rules are SamplingParams' and the step bound the
    deployment's, each written once and reported under the input's name.
    """
    s = req.sampling_overrides
    if inputs.get("STEPS") is not None:
        s["infer_steps"] = _int("STEPS", inputs["STEPS"])
        check_steps(s["infer_steps"], limits, "STEPS")
    for name, key in (("CFG_SCALE", "cfg_scale"), ("TIMESTEP_SHIFT", "timestep_shift"),
                      ("IMAGE_GUIDANCE_SCALE", "image_guidance_scale"), ("CACHE_THRESHOLD", "cache_threshold")):
        if inputs.get(name) is not None:
            s[key] = float(_numeric(name, inputs[name], INPUT_SPECS[name])[0])
    if inputs.get("CFG_INTERVAL") is not None:
        s["cfg_interval"] = tuple(float(v) for v in _numeric("CFG_INTERVAL", inputs["CFG_INTERVAL"],
                                                             INPUT_SPECS["CFG_INTERVAL"]))
    for name, key in (("CFG_NORM", "cfg_norm"), ("OUTPUT_FORMAT", "output_format"), ("CACHE", "cache")):
        if inputs.get(name) is not None:
            s[key] = _string(name, inputs[name], INPUT_SPECS[name]).lower()
    try:
        req.sampling_params = defaults.replace(**s)
    except InputError as exc:
        raise InputError(exc.named(SAMPLING_INPUT_NAMES)) from None


# Which input a SamplingParams field comes from, so the core's messages name the input.
SAMPLING_INPUT_NAMES = {
    "infer_steps": "STEPS", "cfg_scale": "CFG_SCALE", "timestep_shift": "TIMESTEP_SHIFT",
    "cfg_interval": "CFG_INTERVAL", "cfg_norm": "CFG_NORM", "output_format": "OUTPUT_FORMAT",
    "image_guidance_scale": "IMAGE_GUIDANCE_SCALE", "cache": "CACHE", "cache_threshold": "CACHE_THRESHOLD",
}
# GenerationRequest field -> input name: the core's errors name fields, clients know inputs.
REQUEST_INPUT_NAMES = {
    "cond_kv": "COND_KV", "uncond_kv": "UNCOND_KV", "index_offset_cond": "INDEX_OFFSET_COND",
    "index_offset_uncond": "INDEX_OFFSET_UNCOND", "image_kv": "IMAGE_KV", "index_offset_image": "INDEX_OFFSET_IMAGE",
    "size": "SIZE", "noise": "NOISE",
    "task": "TASK", "lora": "LORA", "lora_scale": "LORA_SCALE", **SAMPLING_INPUT_NAMES,
}
