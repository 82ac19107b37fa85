"""Single-velocity probes of a loaded pipeline, for comparing it with the float64 reference."""

from __future__ import annotations

import torch

from neopp.model.embeddings import patchify
from neopp.request import GenerationRequest
from neopp.sampling.pipeline import NeoPPPipeline, Prepared
from neopp.sampling.plan import StepPlan
from neopp.sampling.sampler import FlowSampler
from neopp.sampling.schedule import initial_noise_scale


@torch.inference_mode()
def branch_velocity(pipe: NeoPPPipeline, req: GenerationRequest, x: torch.Tensor, t: float,
                    branch: str = "cond") -> torch.Tensor:
    """One unguided velocity of ``branch`` at time ``t`` (the branch is prepared on each call)."""
    grid = pipe.grid(req.height, req.width)
    kv, off = (req.cond_kv, req.index_offset_cond) if branch == "cond" else (req.uncond_kv, req.index_offset_uncond)
    ctx = pipe.branch(kv, off, grid)
    one_step = (t, 1.0)  # a plan whose step 0 is at time t
    prep = Prepared(grid, StepPlan(one_step, (False,), ("cond",)),
                    FlowSampler(one_step, initial_noise_scale(pipe.config, grid.num_tokens)), {branch: ctx})
    hid = pipe.embed(x.to(pipe.device), prep, 0)
    return pipe.velocity(hid, patchify(x.to(pipe.device, torch.float32), grid.token_size), prep, 0, ctx)
