"""A warm-up generation at load, so the first request does not pay for lazy initialisation.

Triton's ``model_warmup`` needs fixed input dims in config.pbtxt, but the KV geometry is the
checkpoint's and only known at load. So a model warms itself up instead, through the same
engine a request uses: one denoising step at the mode's default size, guidance on where the
mode guides (both branches, the CFG-parallel ranks and their collectives), encoded in the
mode's output format. The prefix is synthetic and small; nothing of the warm-up is kept (the
instance's random stream and the metrics are untouched).
"""

from __future__ import annotations

import time

import torch

from ..image_io import encode_image
from ..modes import ModeSpec
from ..request import GenerationRequest
from ..sampling.rng import NoiseStream
from .engine import Engine

PREFIX_TOKENS = 16


def warm_up_request(engine: Engine, mode: ModeSpec, prefix_tokens: int = PREFIX_TOKENS) -> GenerationRequest:
    """One guided step at the default size on a small synthetic prefix, validated, noise drawn."""
    layers, kv_heads, head_dim = engine.config.kv_dims
    gen = torch.Generator().manual_seed(0)

    def kv() -> torch.Tensor:
        return (torch.randn(layers, 2, prefix_tokens, kv_heads, head_dim, generator=gen) * 0.5).to(torch.bfloat16)

    height, width = mode.default_size
    req = GenerationRequest(cond_kv=kv(), uncond_kv=kv(), index_offset_cond=prefix_tokens,
                            index_offset_uncond=prefix_tokens, height=height, width=width,
                            sampling_params=mode.sampling_params.replace(infer_steps=1, cfg_interval=(0.0, 1.0)))
    engine.validate(req)
    req.noise = NoiseStream(0).draw(height, width)
    return req


def warm_up(engine: Engine, mode: ModeSpec, prefix_tokens: int = PREFIX_TOKENS) -> float:
    """Seconds one warm-up generation took (through a batching engine's loop and ranks too)."""
    start = time.perf_counter()
    req = warm_up_request(engine, mode, prefix_tokens)
    encode_image(engine.generate(req), mode.sampling_params.output_format, None)
    return time.perf_counter() - start
