"""The OpenAI Images API on the door: ``POST /v1/images/generations``, ``POST /v1/images/edits``
and ``GET /v1/models``.

What every OpenAI SDK, LangChain or Open WebUI sends for an image is answered from the prompt
model (``neopp_t2i``: the prompt encoder, then the generation model named by ``model``), so a
client written for OpenAI draws with NeoPP unchanged. Our extensions ride in the same body:
``seed``, ``negative_prompt``, ``num_inference_steps``, ``guidance_scale``, ``cache`` and
``cache_threshold`` (the step cache; the model checks the method it offers), ``cfg_norm`` and
``timestep_shift`` and ``cfg_interval`` (the model checks their values). Errors have OpenAI's
shape (``{"error": {"message", "type", "param", "code"}}``) and name the parameter. An edit is
the same request with pictures (``openai_edits`` reads its form): the encoder reads them with the
prompt, and its image-only branch reaches the generation model beside the two prompt branches.
"""

from __future__ import annotations

import math
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tritonclient.grpc import service_pb2 as pb

from ...contract.adapter_names import MAX_NAME_CHARS, SCALE_MAX_ABS
from ...contract.inputs import (
    DEFAULT_THINK_TOKENS,
    EDIT_OUTPUTS,
    ENCODER_OUTPUTS,
    MAX_PROMPT_CHARS,
    MAX_THINK_TOKENS,
)
from ...contract.sizes import is_openai_size, openai_size, openai_text
from . import strict_json
from .spliced_request import WireRequest
from .tensors import deserialize_bytes, serialize_bytes

PROMPT_MODEL = "neopp_t2i"
ENCODER_MODEL = "neopp_prompt_encoder"
STREAM_SUFFIX = "_stream"  # the streamed twin of a generation model
DEFAULT_MODEL = "neopp_dense"
FORMATS = ("png", "jpeg", "webp")
MAX_IMAGES, MAX_PROMPT = 4, MAX_PROMPT_CHARS
# OpenAI's parameters whose only values here are what this server does anyway: any other value
# would be a promise the answer does not keep, so it is refused by name
ACCEPTED_AND_IGNORED = {"quality": ("auto",), "background": ("auto", "opaque"), "moderation": ("auto", "low")}
UNSUPPORTED = {"quality": "this server draws one quality; more steps ('num_inference_steps') draw finer detail",
               "background": "images are drawn opaque", "style": "the model has no styles to choose from"}
VARIATIONS = ("Image variations are not served: this model edits a picture as a prompt says; send the picture "
              "and the prompt to POST /v1/images/edits")
MAX_USER = 256
MAX_CACHE_NAME = 32
PARAMETERS = ("prompt", "model", "n", "size", "response_format", "output_format", "stream", "partial_images",
              "seed", "negative_prompt", "num_inference_steps", "guidance_scale", "progress", "user",
              "output_compression", "style", "lora", "lora_scale", "cache",
              "cache_threshold", "think", "think_max_tokens", "cfg_norm", "timestep_shift", "cfg_interval",
              *ACCEPTED_AND_IGNORED)
EDIT_PARAMETERS = ("image_guidance_scale",)  # an edit's only parameter beyond a generation's (its pictures aside)
PREFIXES = (*ENCODER_OUTPUTS, *EDIT_OUTPUTS)  # what the encoder answers that a generation model takes
MAX_LORA_NAME = MAX_NAME_CHARS  # the model checks the name's characters and that the adapter exists


class OpenAIError(Exception):
    """An answer in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers, self.code = headers or {}, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def __reduce__(self):
        """Raised in a parse worker, rebuilt in the door."""
        return type(self), (self.status, self.message, self.param, self.kind, self.headers, self.code)


@dataclass(frozen=True)
class ImagesRequest:
    """A checked generations request; ``size`` is (height, width), None for the model's own."""

    prompt: str
    model: str
    n: int
    size: tuple[int, int] | None
    output_format: str
    seed: int
    negative_prompt: str | None
    steps: int | None
    guidance_scale: float | None
    cache: str | None = None
    cache_threshold: float | None = None
    partial_images: int = 0
    progress: bool = False  # ours: a neopp.progress event after every step (with partial_images)
    lora: str | None = None  # ours: an adapter of the model's adapter directory, by name
    lora_scale: float | None = None
    think: bool = False  # ours: the tower reasons before the image (U1 checkpoints); the answer says how
    think_max_tokens: int | None = None
    images: tuple[bytes, ...] = field(default=(), repr=False)  # an edit's pictures, encoded files in order
    image_guidance_scale: float | None = None  # an edit's guidance towards its pictures (img_cfg_scale)
    cfg_norm: str | None = None  # ours: the guidance's renormalisation (the model checks the name)
    timestep_shift: float | None = None  # ours: the schedule's shift (the model checks its range)
    cfg_interval: tuple[float, float] | None = None  # ours: the times guidance runs at (the model checks it)

    @property
    def size_text(self) -> str:
        """OpenAI's ``WIDTHxHEIGHT`` of the size drawn ("auto" only before the door resolved it)."""
        return "auto" if self.size is None else openai_text(self.size)


def _int(doc: dict[str, Any], key: str, low: int, high: int, default: int | None) -> int | None:
    value = doc.get(key, default)
    if value is None:
        return None
    if type(value) is not int or not low <= value <= high:
        raise OpenAIError(400, f"'{key}' must be an integer from {low} to {high}", key)
    return value


def _text(doc: dict[str, Any], key: str, default: str | None, limit: int = MAX_PROMPT) -> str | None:
    value = doc.get(key, default)
    if value is not None and (not isinstance(value, str) or len(value) > limit):
        raise OpenAIError(400, f"'{key}' must be a string of at most {limit} characters", key)
    return value


def _size(value: Any) -> tuple[int, int] | None:
    if value in (None, "auto"):
        return None
    if not isinstance(value, str) or not is_openai_size(value):
        raise OpenAIError(400, f"'size' must be 'auto' or 'WIDTHxHEIGHT' (e.g. '256x256'), got {str(value)[:32]!r}",
                          "size")
    return openai_size(value)


def parse_images_request(doc: Any, images: tuple[bytes, ...] = ()) -> tuple[ImagesRequest, bool]:
    """The checked request and whether it asked for a stream; with ``images`` (checked by the
    caller) an edit, which also takes ``image_guidance_scale``."""
    if not isinstance(doc, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    unknown = sorted(set(doc) - set(PARAMETERS) - set(EDIT_PARAMETERS if images else ()))
    if unknown:
        raise OpenAIError(400, f"Unknown parameter: '{unknown[0][:64]}'.", unknown[0][:64])
    prompt = _text(doc, "prompt", None)
    if not prompt or not prompt.strip():
        raise OpenAIError(400, "'prompt' is required: the text of the image", "prompt")
    if doc.get("response_format", "b64_json") != "b64_json":
        raise OpenAIError(400, "'response_format' must be 'b64_json': this server returns images inline and "
                          "keeps no files to link to", "response_format")
    output_format = _text(doc, "output_format", "png")
    if output_format not in FORMATS:
        raise OpenAIError(400, f"'output_format' must be one of {', '.join(FORMATS)}", "output_format")
    stream = doc.get("stream", False)
    if type(stream) is not bool:
        raise OpenAIError(400, "'stream' must be true or false", "stream")
    partial = _int(doc, "partial_images", 0, 3, 0)
    if partial and not stream:
        raise OpenAIError(400, "'partial_images' needs 'stream': true", "partial_images")
    progress = doc.get("progress", False)
    if type(progress) is not bool or (progress and not partial):
        raise OpenAIError(400, "'progress' must be true or false, and true only with 'partial_images'", "progress")
    seed = _int(doc, "seed", 0, 2**63 - MAX_IMAGES - 1, None)
    lora, lora_scale = _lora(doc)
    cache, cache_threshold = _cache(doc)
    think, think_max_tokens = _think(doc)
    _ignored(doc)
    request = ImagesRequest(
        prompt=prompt, model=_text(doc, "model", DEFAULT_MODEL, 128) or DEFAULT_MODEL,
        n=_int(doc, "n", 1, MAX_IMAGES, 1), size=_size(doc.get("size")), output_format=output_format,
        seed=secrets.randbelow(2**31) if seed is None else seed,
        negative_prompt=_text(doc, "negative_prompt", None), steps=_steps(doc.get("num_inference_steps")),
        guidance_scale=_scale(doc, "guidance_scale"), partial_images=partial, progress=progress,
        lora=lora, lora_scale=lora_scale, cache=cache, cache_threshold=cache_threshold, think=think,
        think_max_tokens=think_max_tokens, images=images, image_guidance_scale=_scale(doc, "image_guidance_scale"),
        cfg_norm=_text(doc, "cfg_norm", None, MAX_CACHE_NAME), timestep_shift=_shift(doc),
        cfg_interval=_interval(doc))
    return request, stream


def _shift(doc: dict[str, Any]) -> float | None:
    """``timestep_shift``: a finite positive number (the model holds it to its own range)."""
    value = doc.get("timestep_shift")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise OpenAIError(400, "'timestep_shift' must be a positive number", "timestep_shift")
    return float(value)


def _interval(doc: dict[str, Any]) -> tuple[float, float] | None:
    """``cfg_interval``: two finite numbers [low, high] (the model holds them to its own rules)."""
    value = doc.get("cfg_interval")
    if value is None:
        return None
    if (not isinstance(value, list) or len(value) != 2
            or not all(type(v) in (int, float) and math.isfinite(v) for v in value)):
        raise OpenAIError(400, "'cfg_interval' must be two numbers [low, high]", "cfg_interval")
    return float(value[0]), float(value[1])


def _scale(doc: dict[str, Any], key: str) -> float | None:
    """A guidance scale: a number from 0 to 100 (the model holds it to its own range too)."""
    value = doc.get(key)
    if value is not None and (type(value) not in (int, float) or not 0 <= value <= 100):
        raise OpenAIError(400, f"'{key}' must be a number from 0 to 100", key)
    return None if value is None else float(value)


def _think(doc: dict[str, Any]) -> tuple[bool, int | None]:
    """``think`` (true or false) and ``think_max_tokens`` (only with ``think``: 1 to the cap)."""
    think = doc.get("think", False)
    if type(think) is not bool:
        raise OpenAIError(400, "'think' must be true or false", "think")
    cap = _int(doc, "think_max_tokens", 1, MAX_THINK_TOKENS, None)
    if cap is not None and not think:
        raise OpenAIError(400, "'think_max_tokens' needs 'think': true", "think_max_tokens")
    return think, cap


def _steps(value: Any) -> int | None:
    """A positive integer; the model's own limit (``steps.max`` in /v1/models) is held by the door."""
    if value is not None and (type(value) is not int or not 1 <= value <= 2**31):
        raise OpenAIError(400, "'num_inference_steps' must be a positive integer (at most the model's steps.max "
                          "in /v1/models)", "num_inference_steps")
    return value


def _lora(doc: dict[str, Any]) -> tuple[str | None, float | None]:
    """``lora`` (a name, at most MAX_NAME_CHARS characters) and ``lora_scale`` (only with ``lora``)."""
    lora = _text(doc, "lora", None, MAX_LORA_NAME)
    scale = doc.get("lora_scale")
    if scale is not None and (type(scale) not in (int, float) or not abs(scale) <= SCALE_MAX_ABS):
        raise OpenAIError(400, f"'lora_scale' must be a number from -{SCALE_MAX_ABS:g} to {SCALE_MAX_ABS:g}",
                          "lora_scale")
    if scale is not None and lora is None:
        raise OpenAIError(400, "'lora_scale' needs 'lora': the adapter it scales", "lora_scale")
    if lora is not None and not lora.strip():
        raise OpenAIError(400, "'lora' must name an adapter", "lora")
    return lora, None if scale is None else float(scale)


def _cache(doc: dict[str, Any]) -> tuple[str | None, float | None]:
    """``cache`` (a method name; which ones the model offers is the model's to say) and
    ``cache_threshold`` (a number in (0, 1])."""
    cache = _text(doc, "cache", None, MAX_CACHE_NAME)
    threshold = doc.get("cache_threshold")
    if threshold is not None and (type(threshold) not in (int, float) or not 0 < threshold <= 1):
        raise OpenAIError(400, "'cache_threshold' must be a number in (0, 1]", "cache_threshold")
    return cache, None if threshold is None else float(threshold)


def _ignored(doc: dict[str, Any]) -> None:
    """OpenAI's parameters this server has no choice for: only the values it keeps anyway."""
    for key in ("style", *ACCEPTED_AND_IGNORED):
        if key in doc and doc[key] not in ACCEPTED_AND_IGNORED.get(key, ()):
            allowed = ACCEPTED_AND_IGNORED.get(key)
            rule = f"send {' or '.join(repr(a) for a in allowed)} or leave it out" if allowed else "leave it out"
            raise OpenAIError(400, f"'{key}': {str(doc[key])[:32]!r} is not supported ({UNSUPPORTED[key]}); {rule}",
                              key)
    _text(doc, "user", None, MAX_USER)
    _int(doc, "output_compression", 0, 100, None)


def parse_images_body(body: bytes, max_values: int) -> tuple[ImagesRequest, bool]:
    """``parse_images_request`` of a body, parsed strictly (run away from the door's event loop)."""
    strict_json.count_values(body, max_values, "request body")
    return parse_images_request(strict_json.loads(body, "request body"))


def prompt_model_request(req: ImagesRequest, index: int) -> WireRequest:
    """The ``neopp_t2i`` request of image ``index`` (its own noise: seed + index)."""
    wire = WireRequest(pb.ModelInferRequest(model_name=PROMPT_MODEL))
    _texts(wire, {"PROMPT": req.prompt, "NEGATIVE_PROMPT": req.negative_prompt, "MODEL": req.model})
    _thinking(wire, req)
    _sampling(wire, req, req.size, index)
    return wire


def encoder_request(req: ImagesRequest) -> WireRequest:
    """The prompt encoder's request: what ``neopp_t2i`` sends it first; an edit's pictures too,
    as they came (the encoder decodes and checks them)."""
    wire = WireRequest(pb.ModelInferRequest(model_name=ENCODER_MODEL))
    _texts(wire, {"PROMPT": req.prompt, "NEGATIVE_PROMPT": req.negative_prompt})
    _thinking(wire, req)
    if req.images:
        _add(wire, "IMAGES", "BYTES", [len(req.images)], serialize_bytes(req.images))
    return wire


def _thinking(wire: WireRequest, req: ImagesRequest) -> None:
    if req.think:
        _add(wire, "THINK", "BOOL", [1], b"\x01")
    if req.think_max_tokens is not None:
        _add(wire, "THINK_MAX_TOKENS", "INT64", [1], np.array([req.think_max_tokens], "<i8").tobytes())


def generation_request(req: ImagesRequest, encoded: pb.ModelInferResponse, index: int,
                       model: str | None = None) -> WireRequest:
    """Image ``index`` from the encoder's answer: its prefixes (an edit's image-only branch
    too, when it answered one) and the sampling inputs ``neopp_t2i`` would pass ``model``."""
    wire = WireRequest(pb.ModelInferRequest(model_name=model or req.model))
    for out, raw in zip(encoded.outputs, encoded.raw_output_contents):
        if out.name in PREFIXES:  # not THINK_TEXT: the answer carries that
            _add(wire, out.name, out.datatype, list(out.shape), raw)
    _sampling(wire, req, req.size, index)
    _recorded(wire, req)
    return wire


def _recorded(wire: WireRequest, req: ImagesRequest) -> None:
    """What the picture's record says of the prompts (kept where the model allows) and think mode."""
    _texts(wire, {"RECORD_PROMPT": req.prompt, "RECORD_NEGATIVE_PROMPT": req.negative_prompt})
    cap = (req.think_max_tokens or DEFAULT_THINK_TOKENS) if req.think else 0
    _add(wire, "RECORD_THINK", "INT64", [1], np.array([cap], "<i8").tobytes())


def streamed_request(req: ImagesRequest, encoded: pb.ModelInferResponse, preview_every: int) -> WireRequest:
    """The streamed twin's request: the generation request plus previews; the final image is the same bytes."""
    wire = generation_request(req, encoded, 0, req.model + STREAM_SUFFIX)
    _add(wire, "PREVIEW_EVERY", "INT64", [1], np.array([preview_every], "<i8").tobytes())
    return wire


def _texts(wire: WireRequest, texts: dict[str, str | None]) -> None:
    for name, text in texts.items():
        if text is not None:
            _add(wire, name, "BYTES", [1], serialize_bytes([text.encode()]))


def _sampling(wire: WireRequest, req: ImagesRequest, size: tuple[int, int] | None, index: int) -> None:
    _texts(wire, {"OUTPUT_FORMAT": req.output_format})
    _add(wire, "SEED", "INT64", [1], np.array([req.seed + index], "<i8").tobytes())
    if size is not None:
        _add(wire, "SIZE", "INT64", [2], np.array(size, "<i8").tobytes())
    if req.steps is not None:
        _add(wire, "STEPS", "INT64", [1], np.array([req.steps], "<i8").tobytes())
    if req.guidance_scale is not None:
        _add(wire, "CFG_SCALE", "FP32", [1], np.array([req.guidance_scale], "<f4").tobytes())
    if req.image_guidance_scale is not None:
        _add(wire, "IMAGE_GUIDANCE_SCALE", "FP32", [1], np.array([req.image_guidance_scale], "<f4").tobytes())
    if req.lora is not None:
        _texts(wire, {"LORA": req.lora})
    if req.lora_scale is not None:
        _add(wire, "LORA_SCALE", "FP32", [1], np.array([req.lora_scale], "<f4").tobytes())
    _texts(wire, {"CACHE": req.cache, "CFG_NORM": req.cfg_norm})
    if req.timestep_shift is not None:
        _add(wire, "TIMESTEP_SHIFT", "FP32", [1], np.array([req.timestep_shift], "<f4").tobytes())
    if req.cache_threshold is not None:
        _add(wire, "CACHE_THRESHOLD", "FP32", [1], np.array([req.cache_threshold], "<f4").tobytes())
    if req.cfg_interval is not None:
        _add(wire, "CFG_INTERVAL", "FP32", [2], np.array(req.cfg_interval, "<f4").tobytes())


def preview_plan(partial_images: int, steps: int | None) -> int:
    """PREVIEW_EVERY for ``partial_images`` previews: spread over known steps, else every step
    (the door then keeps the ones spread over the total the first event reports)."""
    return max(1, steps // (partial_images + 1)) if steps else 1


def wanted_preview(step: int, total: int, sent: int, partial_images: int) -> bool:
    """Whether the preview of ``step`` is the next partial image to send."""
    return sent < partial_images and step < total and step * (partial_images + 1) >= (sent + 1) * total


def _add(wire: WireRequest, name: str, datatype: str, shape: list[int], raw: bytes) -> None:
    wire.message.inputs.add(name=name, datatype=datatype, shape=shape)
    wire.raws.append(raw)


PARAMETER_OF_INPUT = {"PROMPT": "prompt", "NEGATIVE_PROMPT": "negative_prompt", "MODEL": "model", "SIZE": "size",
                      "STEPS": "num_inference_steps", "CFG_SCALE": "guidance_scale", "SEED": "seed",
                      "OUTPUT_FORMAT": "output_format", "LORA": "lora", "LORA_SCALE": "lora_scale", "CACHE": "cache",
                      "CACHE_THRESHOLD": "cache_threshold", "THINK": "think", "THINK_MAX_TOKENS": "think_max_tokens",
                      "IMAGES": "image", "IMAGE_GUIDANCE_SCALE": "image_guidance_scale", "CFG_NORM": "cfg_norm",
                      "TIMESTEP_SHIFT": "timestep_shift", "CFG_INTERVAL": "cfg_interval"}


def refusal(status: int, message: str, headers: dict[str, str]) -> OpenAIError:
    """A server refusal in OpenAI's shape; the parameter is named where the message names its input."""
    match = re.search(r"\b([A-Z_]+):", message)
    param = PARAMETER_OF_INPUT.get(match.group(1)) if match else None
    if status == 429:
        return OpenAIError(429, message, None, "rate_limit_error", headers)
    if 400 <= status < 500:
        return OpenAIError(status, message, param, headers=headers)
    return OpenAIError(status if status >= 500 else 500, message, None, "server_error", headers)


def image_bytes(response: pb.ModelInferResponse) -> bytes:
    """The encoded image of a ``neopp_t2i`` or generation model's answer."""
    return _one_bytes(response, "IMAGE")


def think_text(response: pb.ModelInferResponse) -> str:
    """The reasoning a ``neopp_t2i`` or encoder answer carries ("" without think mode)."""
    return _one_bytes(response, "THINK_TEXT").decode("utf-8", errors="replace")


def _one_bytes(response: pb.ModelInferResponse, name: str) -> bytes:
    for out, raw in zip(response.outputs, response.raw_output_contents):
        if out.name == name:
            return deserialize_bytes(raw, 1, name)[0]
    raise OpenAIError(500, f"{response.model_name or 'the model'} answered without {name}", kind="server_error")

