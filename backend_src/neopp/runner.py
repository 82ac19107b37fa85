"""The stateful API LightLLM calls in-process: set KV, set params, generate.

A thin facade over `NeoPPPipeline` plus a `NoiseStream`, so the serving models and this
class compute the same thing from the same code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from .errors import InputError
from .image_io import encode_image
from .model.kv_cache import load_kv_file
from .modes import TASKS, ModeSpec, load_mode
from .request import GenerationRequest
from .sampling.pipeline import NeoPPPipeline
from .sampling.rng import NoiseStream

_KEEP = object()


class InProcessRunner:
    """The stateful in-process API, shaped as LightLLM calls it: set the KV prefixes and the
    parameters, generate; one noise stream carries across calls. (LightX2V's own runner face,
    ``NeoppRunner``, is ``neopp.compat.lightx2v``'s.)"""

    def __init__(self, ckpt_dir: str | Path, mode: ModeSpec | str | Path | None = None, device: str | None = None,
                 dtype: torch.dtype | None = None, default_task: str = "t2i",
                 support_tasks: Sequence[str] = TASKS, pipeline: NeoPPPipeline | None = None,
                 lora_dir: str | Path | None = None) -> None:
        """``lora_dir``: where the LoRA files a mode file names are (default: the mode file's folder)."""
        mode = load_mode(mode, lora_dir=lora_dir) if isinstance(mode, (str, Path)) else (mode or ModeSpec())
        self.pipeline = pipeline or NeoPPPipeline.from_pretrained(ckpt_dir, mode, device, dtype)
        self.pipeline.rules = replace(self.pipeline.rules, support_tasks=tuple(support_tasks))
        self.support_tasks = tuple(support_tasks)
        if default_task not in self.support_tasks:
            raise InputError(f"task: default task {default_task!r} is not in support_tasks {self.support_tasks}")
        self.default_task = default_task
        self.mode_sampling = mode.sampling_params
        self.sampling_params = mode.sampling_params
        self.default_size = self.pipeline.config.fit(mode).default_size
        self.noise_stream = NoiseStream()
        self._cond: torch.Tensor | None = None
        self._uncond: torch.Tensor | None = None
        self._image: torch.Tensor | None = None
        self._offsets: tuple[int | None, int | None] = (None, None)
        self._offset_image: int | None = None
        self._resize: tuple[int, int] | None = None

    def set_kvcache(self, cond: torch.Tensor, uncond: torch.Tensor | None = None) -> None:
        """Prefixes in the online layout [layers, 2, seq, kv_heads, head_dim]."""
        self._cond, self._uncond, self._image = cond, uncond, None

    def set_kvcache_i2i(self, cond: torch.Tensor, text_uncond: torch.Tensor | None = None,
                        img_uncond: torch.Tensor | None = None) -> None:
        """Image editing: prompt + images, empty prompt, and the images alone (online layout)."""
        self._cond, self._uncond, self._image = cond, text_uncond, img_uncond

    def load_kvcache(self, cond_path: str | Path, uncond_path: str | Path | None = None) -> None:
        """Prefixes from replay-layout files (`.pt` or safetensors)."""
        self.set_kvcache(load_kv_file(cond_path), load_kv_file(uncond_path) if uncond_path else None)

    def set_inference_params(self, index_offset_cond: int, index_offset_uncond: int | None = None,
                             cfg_interval: Any = _KEEP, cfg_scale: Any = _KEEP, cfg_norm: Any = _KEEP,
                             timestep_shift: Any = _KEEP, output_format: Any = _KEEP, infer_steps: Any = _KEEP,
                             enable_cfg: Any = _KEEP, image_guidance_scale: Any = _KEEP,
                             resize: Any = _KEEP, index_offset_image: int | None = None) -> None:
        """Offsets of this turn; values given here override the mode's for this turn only."""
        overrides = {k: v for k, v in dict(cfg_interval=cfg_interval, cfg_scale=cfg_scale, cfg_norm=cfg_norm,
                                           timestep_shift=timestep_shift, output_format=output_format,
                                           infer_steps=infer_steps, enable_cfg=enable_cfg,
                                           image_guidance_scale=image_guidance_scale).items() if v is not _KEEP}
        self.sampling_params = self.mode_sampling.replace(**overrides)
        self._offsets = (index_offset_cond, index_offset_uncond)
        self._offset_image = index_offset_image
        if resize is not _KEEP:
            self._resize = tuple(resize) if resize else None

    def generate(self, seed: int | None = None, size: Sequence[int] | None = None, task: str | None = None,
                 save_result_path: str = "", target_shape: Sequence[int] | None = None) -> bytes:
        """Encoded image bytes; also written to `save_result_path` when given.

        An explicit seed starts a fresh stream; `None` continues the previous generation's.
        """
        if self._cond is None or self._offsets[0] is None:
            raise InputError("cond_kv: call set_kvcache and set_inference_params before generate")
        size = size if size is not None else target_shape
        height, width = (int(v) for v in (size or self.default_size))
        if seed is not None:
            self.noise_stream.reseed(seed)
        req = GenerationRequest(cond_kv=self._cond, uncond_kv=self._uncond, index_offset_cond=self._offsets[0],
                                index_offset_uncond=self._offsets[1], height=height, width=width,
                                sampling_params=self.sampling_params, task=task or self.default_task,
                                image_kv=self._image, index_offset_image=self._offset_image)
        self.pipeline.validate(req)  # before drawing, so a refused request does not advance the stream
        req.noise = self.noise_stream.draw(height, width)
        data = encode_image(self.pipeline.generate(req), self.sampling_params.output_format, self._resize)
        if save_result_path:  # its folder is made, as for any image file this project writes
            Path(save_result_path).parent.mkdir(parents=True, exist_ok=True)
            Path(save_result_path).write_bytes(data)
        return data
