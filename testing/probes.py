"""Single-velocity probes of a loaded pipeline, for comparing it with the float64 reference."""

from __future__ import annotations

import torch

from neopp.embeddings import patchify
from neopp.pipeline import NeoPPPipeline
from neopp.request import GenerationRequest
from neopp.schedule import initial_noise_scale


@torch.inference_mode()
def branch_velocity(pipe: NeoPPPipeline, req: GenerationRequest, x: torch.Tensor, t: float,
                    branch: str = "cond") -> torch.Tensor:
    """One unguided velocity of ``branch`` at time ``t`` (the branch is prepared on each call)."""
    grid = pipe.grid(req.height, req.width)
    kv, off = (req.cond_kv, req.index_offset_cond) if branch == "cond" else (req.uncond_kv, req.index_offset_uncond)
    ctx = pipe.branch(kv, off, grid)
    ns = initial_noise_scale(pipe.config, grid.num_tokens)
    hid = pipe.transformer.embed(x.to(pipe.device, pipe.dtype), t, ns, grid)
    return pipe.velocity(hid, patchify(x.to(pipe.device, torch.float32), grid.token_size), t, ctx, grid)
