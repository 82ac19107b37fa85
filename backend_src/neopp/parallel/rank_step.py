"""How one step is split across ranks: what each rank is sent, and its share of a batched step.

A request goes to every rank with only the KV of the branches that rank runs
(``rank_request``). In a batched step each CFG rank computes the branches its
``ParallelPipeline.prepare`` gave it, all in one pass of the layers, a Ulysses rank on its token
shard; a sum over the CFG group of zero-filled buffers then gives every rank every velocity
(adding exact zeros changes no bit).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from ..model.transformer import BranchContext
from ..modes import ModeSpec
from ..request import COND, IMAGE, UNCOND, GenerationRequest
from ..sampling.batching import Active, BranchKey, StepBatcher
from ..sampling.guidance import guided_branches
from .parallel_pipeline import THREE_BRANCH_SPLIT, UlyssesBranch, branches_by_rank


def rank_request(mode: ModeSpec, req: GenerationRequest, rank: int,
                 three: tuple[tuple[str, ...], ...] | None = None) -> GenerationRequest:
    """What rank ``rank`` is sent: only the KV of the branches it runs under the three-branch
    layout ``three`` (default: the engine's); the offsets all stay, so every rank plans alike."""
    if mode.cfg_p_size < 2:
        return req
    cfg_rank = rank // mode.seq_p_size
    guided = guided_branches(req.sampling_params, req.image_editing)
    mine = branches_by_rank(guided, three or THREE_BRANCH_SPLIT)[cfg_rank]
    if cfg_rank == 0:
        mine = (COND, *mine)  # unguided steps run cond on CFG rank 0
    return replace(req, **{f"{name}_kv": getattr(req, f"{name}_kv") if name in mine else None
                           for name in (COND, UNCOND, IMAGE)})


class ParallelStepBatcher(StepBatcher):
    """The batched step on one rank: its share of the branches, velocities completed by a sum."""

    def owns(self, j: int, branch: BranchContext | None) -> bool:
        """This CFG rank prepared exactly the branches it runs (`ParallelPipeline.prepare`)."""
        return branch is not None

    def layer_input(self, hid: torch.Tensor, branch: BranchContext) -> torch.Tensor:
        if not isinstance(branch, UlyssesBranch):
            return hid
        if branch.padded > branch.num_tokens:
            hid = torch.cat([hid, hid.new_zeros(branch.padded - branch.num_tokens, hid.shape[1])])
        return hid[branch.start:branch.start + branch.shard]

    def layer_output(self, out: torch.Tensor, branch: BranchContext) -> torch.Tensor:
        if not isinstance(branch, UlyssesBranch):
            return out
        parts = [torch.empty_like(out) for _ in range(self.pipe.mesh.seq_p_size)]
        with self.pipe.comm():
            dist.all_gather(parts, out.contiguous(), group=self.pipe.mesh.seq_group)
        return torch.cat(parts)[:branch.num_tokens]

    def exchange(self, batch: list[Active], plans: list[list[BranchContext | None]],
                 velocities: dict[BranchKey, torch.Tensor]) -> dict[BranchKey, torch.Tensor]:
        mesh = self.pipe.mesh
        if mesh.cfg_p_size == 1:
            return velocities
        keys = [(i, j) for i, bs in enumerate(plans) for j in range(len(bs))]
        shapes = [batch[i].z.shape for i, _ in keys]
        flat = torch.cat([velocities[key].reshape(-1) if key in velocities
                          else torch.zeros(s.numel(), device=self.pipe.device) for key, s in zip(keys, shapes)])
        with self.pipe.comm():
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=mesh.cfg_group)
        parts = flat.split([s.numel() for s in shapes])
        return {key: p.view(s) for key, p, s in zip(keys, parts, shapes)}
