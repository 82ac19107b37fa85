"""The runner object of the LightX2V facade: LightX2V's NeoPP runner methods and hook points.

LightLLM calls ``set_inference_params``, ``set_kvcache`` / ``set_kvcache_i2i`` and
``set_resolution`` on ``pipe.runner``, replaces ``process_images_after_vae_decoder`` (what it
returns is what ``generate`` returns) and wraps ``_run_infer_step`` (called once per step,
before the step; an exception raised there stops the generation and propagates). The steps
themselves run in one of this package's engines: the in-process pipeline, a torchrun rank,
a pool of rank processes, or a Triton server.
"""

from __future__ import annotations

import base64
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from PIL import Image

from ..contract.image_formats import FORMAT_OF_SUFFIX
from ..engines.engine import Engine
from ..errors import GenerationCancelled, InputError
from ..image_io import encode_image
from ..model.kv_cache import load_kv_file
from ..modes import ModeSpec, SamplingParams, normalise_format
from ..request import GenerationRequest
from ..sampling.schedule import initial_noise_scale
from ..serving.request_log import request_line
from .lightx2v_config import LockedConfig
from .lightx2v_rng import draw_start

log = logging.getLogger("neopp.compat.lightx2v")


@dataclass
class SchedulerState:
    """What LightX2V's scheduler exposes that hooks read: the final image in [-1, 1] among it."""

    infer_steps: int
    timestep_shift: float
    noise_scale: float = 0.0
    latents: torch.Tensor | None = None  # the starting state of the last generation
    image_prediction: torch.Tensor | None = None  # its result, [1, 3, H, W] float32 on the CPU


class StepHooks:
    """Calls ``hook(k, n)`` once per step, before step k, from the engines' two callbacks.

    Engines poll ``should_stop`` (before each step in-process, repeatedly for a rank pool or a
    remote server) and report finished steps through ``on_step``; step k's hook is due once
    k steps are done, and ``finish`` calls any left. A hook that raises stops the engine
    cleanly (every rank agrees to stop) and its exception is re-raised by ``rethrow``.
    """

    def __init__(self, hook: Any, total: int) -> None:
        self.hook, self.total = hook, total
        self.called = self.finished = 0
        self.error: BaseException | None = None

    def should_stop(self) -> bool:
        while self.error is None and self.called < min(self.finished + 1, self.total):
            try:
                self.hook(self.called, self.total)
            except Exception as exc:  # noqa: BLE001 - re-raised by rethrow once the engine has stopped
                self.error = exc
            self.called += 1
        return self.error is not None

    def on_step(self, k: int, _seconds: float) -> None:
        self.finished = max(self.finished, k + 1)

    def finish(self) -> None:
        """The hooks not yet called (an engine that reports no steps), in order, after the result."""
        self.finished = self.total
        if self.should_stop():
            raise self.error

    def rethrow(self, exc: GenerationCancelled) -> None:
        if self.error is not None:
            raise self.error from None
        raise exc


class NeoppRunner:
    """LightX2V's ``NeoppRunner`` surface over a ``Engine``."""

    def __init__(self, config: LockedConfig, mode: ModeSpec, engine: Engine,
                 noise_device: torch.device) -> None:
        self.config, self.mode, self.engine, self.noise_device = config, mode, engine, noise_device
        self.scheduler = SchedulerState(mode.sampling_params.infer_steps, mode.sampling_params.timestep_shift)
        self.sampling_params: SamplingParams = mode.sampling_params
        self.output_format = mode.sampling_params.output_format
        self.target_shape: tuple[int, int] | None = None  # delivered size (set_resolution)
        self.input_info: SimpleNamespace | None = None
        self.index_offset_cond: int | None = None
        self.index_offset_uncond: int | None = None
        self.index_offset_image: int | None = None
        self.clear_kvcache()

    # ---- LightLLM's calls -------------------------------------------------------------
    def set_inference_params(self, index_offset_cond: int, index_offset_uncond: int | None = None,
                             cfg_interval: Any = None, cfg_scale: float | None = None, cfg_norm: str | None = None,
                             timestep_shift: float | None = None, output_format: str | None = None,
                             infer_steps: int | None = None, image_guidance_scale: float | None = None,
                             index_offset_image: int | None = None, enable_cfg: bool | None = None) -> None:
        """Offsets and sampling values of the next generation; omitted ones keep the mode's."""
        self.sampling_params = self.mode.sampling_params.replace(
            cfg_interval=cfg_interval, cfg_scale=cfg_scale, cfg_norm=cfg_norm, timestep_shift=timestep_shift,
            output_format=output_format, infer_steps=infer_steps, image_guidance_scale=image_guidance_scale,
            enable_cfg=enable_cfg)
        self.index_offset_cond, self.index_offset_uncond = index_offset_cond, index_offset_uncond
        self.index_offset_image = index_offset_image
        self.output_format = self.sampling_params.output_format
        self.scheduler.infer_steps, self.scheduler.timestep_shift = self.sampling_params.infer_steps, \
            self.sampling_params.timestep_shift

    def set_kvcache(self, to_x2v_cond_kv: torch.Tensor, to_x2v_uncond_kv: torch.Tensor | None = None) -> None:
        """Prefixes in the online layout [layers, 2, seq, kv_heads, head_dim]."""
        self.past_key_values_cond, self.past_key_values_uncond = to_x2v_cond_kv, to_x2v_uncond_kv
        self.past_key_values_img_uncond = None

    def set_kvcache_i2i(self, to_x2v_cond_kv: torch.Tensor, to_x2v_text_uncond_kv: torch.Tensor | None,
                        to_x2v_img_uncond_kv: torch.Tensor | None) -> None:
        """Image editing: cond (prompt + image), uncond (empty prompt), image branch (image, no prompt)."""
        self.past_key_values_cond, self.past_key_values_uncond = to_x2v_cond_kv, to_x2v_text_uncond_kv
        self.past_key_values_img_uncond = to_x2v_img_uncond_kv

    def load_kvcache(self, to_x2v_cond_kv_path: str | Path, to_x2v_uncond_kv_path: str | Path | None = None) -> None:
        """Prefixes from replay-layout files (``.pt`` read with weights_only, or safetensors)."""
        self.set_kvcache(load_kv_file(to_x2v_cond_kv_path),
                         load_kv_file(to_x2v_uncond_kv_path) if to_x2v_uncond_kv_path else None)

    def set_resolution(self, r_width: int, r_height: int) -> None:
        """The delivered size; the image is resized (Lanczos) to it unless it is <= 0."""
        self.target_shape = (int(r_height), int(r_width))

    def clear_kvcache(self) -> None:
        self.past_key_values_cond: torch.Tensor | None = None
        self.past_key_values_uncond: torch.Tensor | None = None
        self.past_key_values_img_uncond: torch.Tensor | None = None

    # ---- hook points (LightX2V's names) -----------------------------------------------
    def _run_infer_step(self, step_index: int, infer_steps: int) -> None:
        """Called before each denoising step; wrap it to watch progress or raise to cancel."""

    def process_images_after_vae_decoder(self) -> Any:
        """The result of ``generate``: base64 of the image encoded as ``output_format``."""
        return base64.b64encode(self._encoded(self.output_format)).decode("ascii")

    def process_images_after_vae_decoder_for_debug(self) -> Image.Image:
        """``save_result_for_debug``: write the image to ``save_result_path`` and return it."""
        path = Path(self.input_info.save_result_path)
        fmt = FORMAT_OF_SUFFIX.get(path.suffix.lower())
        if fmt is None:
            raise InputError(f"save_result_path: extension must be one of {sorted(FORMAT_OF_SUFFIX)}, "
                             f"got {path.name!r}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(self._encoded(fmt))
        return Image.open(path)

    def _denorm(self, x: torch.Tensor, mean: Any = (0.5, 0.5, 0.5), std: Any = (0.5, 0.5, 0.5)) -> torch.Tensor:
        """[B, 3, H, W] in the model's range -> [0, 1]."""
        m = torch.tensor(mean, device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
        s = torch.tensor(std, device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
        return (x * s + m).clamp(0, 1)

    def _encoded(self, fmt: str) -> bytes:
        pixels = (self._denorm(self.scheduler.image_prediction.float()) * 255.0).round().to(torch.uint8)
        resize = self.target_shape if self.target_shape and min(self.target_shape) > 0 else None
        return encode_image(pixels[0].permute(1, 2, 0).contiguous().numpy(), normalise_format(fmt or "jpeg"), resize)

    # ---- one generation ---------------------------------------------------------------
    def run_pipeline(self, input_info: SimpleNamespace) -> Any:
        """Validate, draw the start from the global generator, run the steps, hand the image to the hook."""
        self.input_info = input_info
        start = time.perf_counter()
        try:
            req = self._request(input_info)
            self.engine.validate(req)  # before the draw: a refused request leaves the global RNG alone
            req.noise, req.noise_scaled = self._draw(req), True
            hooks = StepHooks(self._run_infer_step, req.sampling_params.infer_steps)
            try:
                pixels = self.engine.generate(req, should_stop=hooks.should_stop, on_step=hooks.on_step)
            except GenerationCancelled as exc:
                hooks.rethrow(exc)
            hooks.finish()
            self.scheduler.image_prediction = pixels_to_prediction(pixels)
            if self.config.get("save_result_for_debug", True):
                result = self.process_images_after_vae_decoder_for_debug()
            else:
                result = self.process_images_after_vae_decoder()
            size = len(result) if isinstance(result, (bytes, str)) else 0
            log.info(request_line(self.mode.name, self.mode, req, size,
                                  time.perf_counter() - start))
            return result
        finally:
            self.clear_kvcache()

    def _request(self, info: SimpleNamespace) -> GenerationRequest:
        if self.past_key_values_cond is None or self.index_offset_cond is None:
            raise InputError("cond_kv: call set_kvcache and set_inference_params before generate")
        height, width = info.size
        req = GenerationRequest(
            cond_kv=self.past_key_values_cond, index_offset_cond=self.index_offset_cond, height=height, width=width,
            sampling_params=self.sampling_params, uncond_kv=self.past_key_values_uncond,
            index_offset_uncond=self.index_offset_uncond, task=info.task)
        if self.past_key_values_img_uncond is not None:
            req.image_kv, req.index_offset_image = self.past_key_values_img_uncond, self.index_offset_image
        return req

    def _draw(self, req: GenerationRequest) -> torch.Tensor:
        t = self.engine.config.token_size
        self.scheduler.noise_scale = initial_noise_scale(self.engine.config, (req.height // t) * (req.width // t))
        self.scheduler.latents = draw_start(req.height, req.width, self.scheduler.noise_scale, self.noise_device)
        return self.scheduler.latents


def pixels_to_prediction(pixels: np.ndarray) -> torch.Tensor:
    """uint8 [H, W, 3] -> [1, 3, H, W] in [-1, 1], so ``_denorm`` then x255 and rounding give the pixels back."""
    x = torch.from_numpy(np.array(pixels, dtype=np.uint8)).permute(2, 0, 1).unsqueeze(0).to(torch.float32)
    return x / 127.5 - 1.0
