"""Run a generation on a Triton server instead of in this process, for the LightX2V facade.

The request carries the facade's own starting state as ``NOISE`` and every sampling value
explicitly, and asks for PNG, so the server computes exactly what the in-process pipeline
computes and the pixels arrive losslessly; the facade then encodes them as it does
in-process. gRPC is used (BF16 KV travels as raw bytes) and a request whose step hook
raises is cancelled on the server, which stops between steps.
"""

from __future__ import annotations

import io
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from ..errors import GenerationCancelled, InputError
from ..limits import Limits
from ..model.checkpoint_config import CheckpointConfig
from ..modes import ModeSpec
from ..request import GenerationRequest
from ..sampling.pipeline import StepFn, StopFn
from ..sampling.plan import RequestRules
from .engine import CancelledFn, EmitFn, submit_in_caller

POLL_S = 0.05


class TritonEngine:
    """The `Engine` interface over one Triton model (one request at a time, in the caller's thread)."""

    def __init__(self, url: str, model: str, checkpoint: str | Path, mode: ModeSpec,
                 headers: dict[str, str] | None = None, timeout_s: float = 600.0) -> None:
        import tritonclient.grpc as grpcclient

        self.config = CheckpointConfig.from_checkpoint(checkpoint)
        self.mode, self.rules = mode, RequestRules(self.config, Limits())
        self.url, self.model, self.headers, self.timeout_s = url, model, headers, timeout_s
        self.client = grpcclient.InferenceServerClient(url)
        self.device, self.dtype = torch.device("cpu"), torch.float32  # where the facade draws its noise

    def validate(self, req: GenerationRequest) -> None:
        self.rules.validate(req)

    def close(self) -> None:
        self.client.close()

    def submit(self, req: GenerationRequest, emit: EmitFn, cancelled: CancelledFn, preview_every: int = 0) -> None:
        submit_in_caller(self.generate, req, emit, cancelled)

    def generate(self, req: GenerationRequest, should_stop: StopFn | None = None,
                 on_step: StepFn | None = None) -> np.ndarray:
        """Pixels [H, W, 3] of the server's PNG; ``should_stop`` is polled while the request runs."""
        done = threading.Event()
        outcome: dict[str, Any] = {}

        def finished(result: Any, error: Any) -> None:
            outcome["result"], outcome["error"] = result, error
            done.set()

        call = self.client.async_infer(self.model, request_inputs(req), finished, headers=self.headers,
                                       client_timeout=self.timeout_s)
        self._wait(call, done, should_stop, on_step, req.sampling_params.infer_steps)
        if outcome.get("error") is not None:
            raise remote_error(outcome["error"])
        data = outcome["result"].as_numpy("IMAGE").reshape(-1)[0]
        return np.asarray(Image.open(io.BytesIO(bytes(data))).convert("RGB"))

    def _wait(self, call: Any, done: threading.Event, should_stop: StopFn | None, on_step: StepFn | None,
              total: int) -> None:
        """Poll until the answer; Triton reports no steps, so each poll counts as one (up to the
        last), which lets a step hook run, and cancel, while the request is in flight."""
        deadline = time.monotonic() + self.timeout_s + 5.0
        polls = 0
        while not done.wait(POLL_S):
            polls = min(polls + 1, total - 1)
            if on_step is not None and polls >= 1:
                on_step(polls - 1, POLL_S)
            if should_stop is not None and should_stop():
                call.cancel()
                raise GenerationCancelled("cancelled by the step hook; the server stops between steps")
            if time.monotonic() > deadline:
                call.cancel()
                raise GenerationCancelled(f"no answer from {self.url} within {self.timeout_s:.0f} s")


def request_inputs(req: GenerationRequest) -> list[Any]:
    """The contract's inputs for ``req``: prefixes, offsets, size, NOISE and every sampling value."""
    s = req.sampling_params
    inputs = [_bf16("COND_KV", req.cond_kv), _array("INDEX_OFFSET_COND", np.array([req.index_offset_cond]))]
    if req.uncond_kv is not None:
        inputs += [_bf16("UNCOND_KV", req.uncond_kv),
                   _array("INDEX_OFFSET_UNCOND", np.array([req.index_offset_uncond]))]
    image_kv = getattr(req, "image_kv", None)
    if image_kv is not None:
        inputs += [_bf16("IMAGE_KV", image_kv), _array("INDEX_OFFSET_IMAGE", np.array([req.index_offset_image]))]
    cfg_scale = s.cfg_scale if s.enable_cfg else 1.0  # no ENABLE_CFG input: scale 1 guides no step
    inputs += [
        _array("SIZE", np.array([req.height, req.width])),
        _array("NOISE", req.noise.detach().to("cpu", torch.float32).numpy()),
        _text("TASK", req.task), _array("STEPS", np.array([s.infer_steps])),
        _array("CFG_SCALE", np.array([cfg_scale], np.float32)),
        _array("CFG_INTERVAL", np.array(s.cfg_interval, np.float32)), _text("CFG_NORM", s.cfg_norm),
        _array("TIMESTEP_SHIFT", np.array([s.timestep_shift], np.float32)), _text("OUTPUT_FORMAT", "png"),
    ]
    if s.image_guidance_scale != 1.0:
        inputs.append(_array("IMAGE_GUIDANCE_SCALE", np.array([s.image_guidance_scale], np.float32)))
    if s.cache != "off":
        inputs.append(_text("CACHE", s.cache))
        if s.cache_threshold is not None:
            inputs.append(_array("CACHE_THRESHOLD", np.array([s.cache_threshold], np.float32)))
    return inputs


def remote_error(error: Any) -> Exception:
    """The server's refusal as this package's error: INVALID_ARG is the caller's fault."""
    status = str(getattr(error, "status", lambda: "")() or "")
    text = str(getattr(error, "message", lambda: error)() or error)
    if "INVALID_ARG" in status or "INVALID_ARGUMENT" in status:
        return InputError(text)
    if "CANCELLED" in status:
        return GenerationCancelled(text)
    return RuntimeError(f"Triton server: {status} {text}".strip())


def _array(name: str, arr: np.ndarray) -> Any:
    import tritonclient.grpc as grpcclient

    arr = np.ascontiguousarray(arr.astype(np.int64) if arr.dtype.kind in "iu" and arr.dtype != np.uint8 else arr)
    kinds = {np.dtype(np.int64): "INT64", np.dtype(np.float32): "FP32", np.dtype(np.uint8): "UINT8"}
    tensor = grpcclient.InferInput(name, list(arr.shape), kinds[arr.dtype])
    tensor.set_data_from_numpy(arr)
    return tensor


def _text(name: str, value: str) -> Any:
    import tritonclient.grpc as grpcclient

    tensor = grpcclient.InferInput(name, [1], "BYTES")
    tensor.set_data_from_numpy(np.array([value.encode()], dtype=np.object_))
    return tensor


def _bf16(name: str, kv: torch.Tensor) -> Any:
    """BF16 as raw little-endian bytes (tritonclient converts element by element otherwise)."""
    import tritonclient.grpc as grpcclient

    kv = kv.detach().to("cpu", torch.bfloat16).contiguous()
    tensor = grpcclient.InferInput(name, list(kv.shape), "BF16")
    if hasattr(tensor, "_raw_content"):
        tensor._raw_content = kv.view(torch.int16).numpy().tobytes()
    else:
        tensor.set_data_from_numpy(kv.float().numpy())
    return tensor

