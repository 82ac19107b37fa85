"""LightLLM's x2i adapter call sequence, written from its ``lightx2v/adapter.py``, against our facade.

What LightLLM does per image: set the inference parameters, hand over the KV prefixes, seed a
session's first image or restore the session's saved global RNG state (then ``seed=None``),
set the delivered resolution, ``generate``, save the session's RNG state. Its two class-level
patches of the runner (the output hook and ``set_resolution``) are reproduced here too, so the
facade is driven exactly as LightLLM drives LightX2V. The one addition: image editing with a
third (image) branch passes that branch's offset and scale, which LightX2V's runner has no
parameter for.

Run as a script (under torchrun for a parallel mode), it replays a fixed two-session scenario
and writes rank 0's images, so tests compare ranks, processes and servers byte for byte.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from neopp.compat.lightx2v import LightX2VPipeline, NeoppRunner


def process_images_after_vae_decoder(self: Any) -> str:
    """LightLLM's output hook: resize to the delivered size if set, encode, base64."""
    r_height, r_width = -1, -1
    if getattr(self, "target_shape", None) is not None:
        r_height, r_width = self.target_shape
    image = self._denorm(self.scheduler.image_prediction.float())
    image = (image.clamp(0, 1) * 255.0).round().to(torch.uint8).cpu()
    pil_image = Image.fromarray(image[0].permute(1, 2, 0).contiguous().numpy())
    if r_height > 0 and r_width > 0 and (pil_image.height, pil_image.width) != (r_height, r_width):
        pil_image = pil_image.resize((r_width, r_height), Image.Resampling.LANCZOS)
    buffer = io.BytesIO()
    fmt = self.output_format.lower() or "jpeg"
    if fmt in ("jpg", "jpeg"):
        pil_image.save(buffer, format="JPEG", quality=90)
    elif fmt == "png":
        pil_image.save(buffer, format="PNG", compress_level=1)
    elif fmt == "webp":
        pil_image.save(buffer, format="WEBP", quality=90, method=0)
    else:
        raise ValueError(f"Unsupported output format: {fmt}")
    return base64.b64encode(buffer.getvalue()).decode("utf-8")


def set_resolution(self: Any, r_width: int, r_height: int) -> None:
    self.target_shape = (r_height, r_width)


def patch_runner_class() -> dict[str, Any]:
    """LightLLM's class-level patches; returns the originals so a test can put them back."""
    saved = {name: NeoppRunner.__dict__[name] for name in ("process_images_after_vae_decoder", "set_resolution")}
    NeoppRunner.process_images_after_vae_decoder = process_images_after_vae_decoder
    NeoppRunner.set_resolution = set_resolution
    return saved


def unpatch_runner_class(saved: dict[str, Any]) -> None:
    for name, value in saved.items():
        setattr(NeoppRunner, name, value)


def capture_rng_state() -> dict[str, Any]:
    state = {"random": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("torch_cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["torch_cuda"])


@dataclass
class X2IParams:
    """The fields of LightLLM's X2IParams the adapter reads (KV already fetched from its cache)."""

    cond: torch.Tensor
    cond_len: int
    uncond: torch.Tensor | None
    uncond_len: int | None
    session_id: int
    first_image: bool
    seed: int = 0
    height: int = 64
    width: int = 64
    r_height: int = -1
    r_width: int = -1
    cfg_interval: tuple[float, float] = (-1.0, 2.0)
    guidance_scale: float = 4.0
    cfg_norm: str = "global"
    timestep_shift: float = 3.0
    output_format: str = "png"
    image: torch.Tensor | None = None  # image editing's image branch (set_kvcache_i2i)
    image_len: int | None = None
    image_guidance_scale: float = 1.0


class AdapterCopy:
    """LightLLM's ``LightX2VServer`` minus its sockets: ``process(param)`` is its ``_process``."""

    def __init__(self, model_dir: str, config_json: str, enable_cfg: bool = True, **pipeline_kwargs: Any) -> None:
        self.enable_cfg = enable_cfg
        self.rng_states: dict[int, dict[str, Any]] = {}
        self.pipe = LightX2VPipeline(model_path=model_dir, model_cls="neopp", support_tasks=["t2i", "i2i"],
                                     **pipeline_kwargs)
        self.pipe.create_generator(config_json=config_json)
        self.pipe.modify_config({"load_kv_cache_in_pipeline_for_debug": False, "save_result_for_debug": False})

    def process(self, param: X2IParams) -> list[str]:
        is_t2i = param.image is None
        extra = {}
        if not is_t2i:
            extra = {"index_offset_image": param.image_len, "image_guidance_scale": param.image_guidance_scale}
        self.pipe.runner.set_inference_params(
            index_offset_cond=param.cond_len,
            index_offset_uncond=param.uncond_len if self.enable_cfg else None,
            cfg_interval=param.cfg_interval, cfg_scale=param.guidance_scale, cfg_norm=param.cfg_norm,
            timestep_shift=param.timestep_shift, output_format=param.output_format, **extra)
        uncond = param.uncond if self.enable_cfg else None
        if is_t2i:
            self.pipe.runner.set_kvcache(param.cond, uncond)
        else:
            self.pipe.runner.set_kvcache_i2i(param.cond, uncond, param.image)
        if param.first_image:
            seed = param.seed
        else:
            seed = None
            if param.session_id in self.rng_states:
                restore_rng_state(self.rng_states[param.session_id])
        self.pipe.runner.set_resolution(param.r_width, param.r_height)
        image = self.pipe.generate(seed=seed, save_result_path="", target_shape=[param.height, param.width])
        if param.session_id != 0:
            self.rng_states[param.session_id] = capture_rng_state()
        return [image]


def scenario(kv: dict[str, torch.Tensor]) -> list[tuple[str, X2IParams]]:
    """Two interleaved sessions: A seeds, B seeds, A continues (restored), B continues at another size;
    with an ``image`` prefix, a third session edits with three-branch guidance (image scale 2)."""
    base = dict(cond=kv["cond"], cond_len=int(kv["cond"].shape[2]), uncond=kv["uncond"],
                uncond_len=int(kv["uncond"].shape[2]))
    return [
        ("a0", X2IParams(**base, session_id=1, first_image=True, seed=11)),
        ("b0", X2IParams(**base, session_id=2, first_image=True, seed=22, output_format="jpeg")),
        ("a1", X2IParams(**base, session_id=1, first_image=False, r_height=48, r_width=80)),
        ("b1", X2IParams(**base, session_id=2, first_image=False, height=64, width=96, cfg_norm="channel")),
    ] + ([("c0", X2IParams(**base, session_id=3, first_image=True, seed=33, image=kv["image"],
                          image_len=int(kv["image"].shape[2]) + 2, image_guidance_scale=2.0))]
         if "image" in kv else [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="LightLLM's adapter sequence against the LightX2V facade")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--kv", required=True, help="a .pt/safetensors folder with cond_kv and uncond_kv (online)")
    parser.add_argument("--out-dir", required=True, type=Path)
    parser.add_argument("--server-url", help="run each generation on this Triton gRPC server")
    parser.add_argument("--triton-model", default="neopp_dense")
    args = parser.parse_args(argv)
    from safetensors.torch import load_file

    kv = load_file(str(Path(args.kv)))
    remote = {"server_url": args.server_url, "triton_model": args.triton_model} if args.server_url else {}
    patch_runner_class()
    adapter = AdapterCopy(args.model_path, args.config_json, **remote)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    timings = {}
    try:
        for name, param in scenario(kv):
            start = time.perf_counter()
            (image,) = adapter.process(param)
            timings[name] = round(time.perf_counter() - start, 3)
            if rank == 0:
                args.out_dir.mkdir(parents=True, exist_ok=True)
                (args.out_dir / f"{name}.bin").write_bytes(base64.b64decode(image))
    finally:
        adapter.pipe.close()
    if torch.distributed.is_initialized():
        print("closing the pipeline left the process group open", file=sys.stderr)
        return 1
    if rank == 0:
        print(json.dumps(timings))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
