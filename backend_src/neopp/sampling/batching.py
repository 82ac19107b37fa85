"""Step-level batching: several requests advance one denoising step together.

Each request keeps its own prepared branches, time grid, state and step index. One batched
step embeds every request on its own grid at its own t, runs the decoder layers ONCE over the
concatenation of every (request, branch) token set (`BatchedBranches` attends each branch over
its own prefix), then per request applies the head, the pipeline's guidance combination and
the Euler update. Which branches a request runs at a step comes from the pipeline
(`step_branches`), so guidance rules live in one place.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..errors import InputError, NeoPPError
from ..model.adapters import Adapter, RowGroup
from ..model.embeddings import patchify, unpatchify
from ..model.transformer import BatchedBranches, BranchContext
from ..request import GenerationRequest
from .pipeline import NeoPPPipeline, Prepared
from .plan import check_cache
from .sampler import StepEvent, to_pixels
from .step_cache import RequestCache, Row, new_cache, run_tower, skipping_branches

# Velocity of (request index in the batch, branch index in its step plan).
BranchKey = tuple[int, int]


@dataclass
class Active:
    """One request inside the batcher: its preparation, its float32 state and its step index."""

    job: int
    req: GenerationRequest
    prep: Prepared
    z: torch.Tensor                 # [tokens, T*T*3] float32, the state the Euler update moves
    x: torch.Tensor                 # [1, 3, H, W], the same state as an image
    preview_every: int = 0
    k: int = 0
    submitted: float = field(default_factory=time.monotonic)
    adapter: Adapter | None = None  # the request's LoRA, held while it runs (even once evicted)
    cache: RequestCache | None = None  # its step cache (None: off)
    served: int = 0  # tokens x branches stepped, counted from where it joined (the fair share's clock)

    @property
    def total(self) -> int:
        return self.prep.sampler.steps

    def wants_preview(self, done: int) -> bool:
        return self.preview_every > 0 and done % self.preview_every == 0 and done < self.total


def start(pipe: NeoPPPipeline, job: int, req: GenerationRequest, preview_every: int = 0,
          submitted: float | None = None) -> Active:
    """Prepare a request's branches and its starting state (as `NeoPPPipeline.sample` does)."""
    if not isinstance(preview_every, int) or preview_every < 0:
        raise InputError(f"preview_every: must be a non-negative integer, got {preview_every!r}")
    check_cache(pipe.mode, req.sampling_params)
    adapter = pipe.adapter(req)
    prep = pipe.prepare(req)
    x = prep.sampler.start(req, pipe.device)
    z = patchify(x, prep.grid.token_size)
    return Active(job, req, prep, z, x, preview_every, 0, submitted if submitted is not None else time.monotonic(),
                  adapter, new_cache(req.sampling_params))


def planned_cost(pipe: NeoPPPipeline, a: Active) -> int:
    """Tokens x branches of a request's next step by its plan, a step cache's skips not taken off
    (every rank counts the same)."""
    return a.prep.grid.num_tokens * len(pipe.step_branch_names(a.prep, a.k))


def step_cost(pipe: NeoPPPipeline, a: Active) -> int:
    """Tokens the layers carry for this request at its next step: tokens x branches that run them
    (a branch that reuses its cached residual carries none)."""
    return planned_cost(pipe, a) - a.prep.grid.num_tokens * skipping_branches(pipe, a.cache, a.x, a.prep, a.k)


def tower_input(pipe: NeoPPPipeline, a: Active) -> torch.Tensor:
    """The request's tower input at its step (a cached request's cost check may have embedded it)."""
    if a.cache is not None:
        return a.cache.tower_input(pipe, a.x, a.prep, a.k)
    return pipe.embed(a.x, a.prep, a.k)


def adapter_rows(batch: list[Active], owners: list[int], sizes: list[int]) -> tuple[RowGroup, ...]:
    """The row groups of a step's concatenated inputs whose request carries an adapter."""
    groups, start_row = [], 0
    for i, size in zip(owners, sizes):
        a = batch[i]
        if a.adapter is not None:
            groups.append(RowGroup(start_row, start_row + size, a.adapter, a.req.lora_scale))
        start_row += size
    return tuple(groups)


class StepBatcher:
    """Runs one batched step over a list of active requests (single process)."""

    def __init__(self, pipe: NeoPPPipeline) -> None:
        self.pipe = pipe

    # ---- what a subclass (a CFG-parallel rank) changes -------------------------------
    def owns(self, j: int, branch: BranchContext | None) -> bool:
        """Does this process compute branch j of a step? Here: all of them."""
        return branch is not None

    def exchange(self, batch: list[Active], plans: list[list[BranchContext | None]],
                 velocities: dict[BranchKey, torch.Tensor]) -> dict[BranchKey, torch.Tensor]:
        """Complete the velocities other processes computed (nothing to do in one process)."""
        return velocities

    def layer_input(self, hid: torch.Tensor, branch: BranchContext) -> torch.Tensor:
        return hid

    def layer_output(self, out: torch.Tensor, branch: BranchContext) -> torch.Tensor:
        return out

    # ---- the step --------------------------------------------------------------------
    @torch.inference_mode()
    def velocities(self, batch: list[Active]) -> tuple[list[list[BranchContext | None]],
                                                       dict[BranchKey, torch.Tensor]]:
        """Every (request, branch) velocity of the step, the layers run once for all."""
        pipe = self.pipe
        plans = [pipe.step_branches(a.prep, a.k) for a in batch]
        owned: list[tuple[int, int, BranchContext]] = [(i, j, b) for i, bs in enumerate(plans)
                                                       for j, b in enumerate(bs) if self.owns(j, b)]
        out: dict[BranchKey, torch.Tensor] = {}
        if owned:
            hids = {i: tower_input(pipe, batch[i]) for i in sorted({i for i, _, _ in owned})}
            inputs = [self.layer_input(hids[i], b) for i, _, b in owned]
            if any(batch[i].cache is not None for i, _, _ in owned):  # some rows may reuse (step_cache)
                names = {i: pipe.step_branch_names(batch[i].prep, batch[i].k) for i, _, _ in owned}
                hidden = run_tower(pipe, [Row(batch[i].cache, names[i][j], batch[i].k, h, b, batch[i].adapter,
                                              batch[i].req.lora_scale) for (i, j, b), h in zip(owned, inputs)])
            else:
                groups = adapter_rows(batch, [i for i, _, _ in owned], [t.shape[0] for t in inputs])
                hidden = pipe.run_layers(torch.cat(inputs), BatchedBranches([b for _, _, b in owned]), groups)
                hidden = hidden.split([t.shape[0] for t in inputs])
            for (i, j, b), h in zip(owned, hidden):
                a = batch[i]
                out[i, j] = pipe.head_velocity(self.layer_output(h, b), a.z, a.prep, a.k)
        return plans, self.exchange(batch, plans, out)

    @torch.inference_mode()
    def step(self, batch: list[Active]) -> list[StepEvent]:
        """Advance every request one step; one event per request, in batch order.

        A request whose state goes non-finite gets its error event alone; the others go on.
        """
        plans, vs = self.velocities(batch)
        return [self._advance(a, [vs[i, j] for j in range(len(plans[i]))]) for i, a in enumerate(batch)]

    def _advance(self, a: Active, velocities: list[torch.Tensor]) -> StepEvent:
        pipe, prep, k = self.pipe, a.prep, a.k
        try:
            v = pipe.combine_step(prep, k, velocities, a.req.sampling_params)
            done, t_size = k + 1, prep.grid.token_size
            preview = None
            if a.wants_preview(done):  # the clean-image prediction behind the guided velocity
                x_pred = prep.sampler.clean_estimate(a.z, v, k)
                preview = to_pixels(unpatchify(x_pred, a.req.height, a.req.width, t_size))
            prep.sampler.step(a.z, v, k)
        except NeoPPError as exc:
            return StepEvent(k, a.total, error=exc)
        a.x = unpatchify(a.z, a.req.height, a.req.width, t_size)
        a.k = done
        final = to_pixels(a.x) if done == a.total else None
        return StepEvent(done, a.total, preview=preview, final=final)

