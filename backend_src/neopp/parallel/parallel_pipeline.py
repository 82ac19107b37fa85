"""CFG-parallel and Ulysses sequence-parallel denoising.

The guidance branches split across ranks; image tokens split within a branch.

Every rank runs the same loop on the same state; ranks differ only in which branch and which
token shard they compute. The result equals the sequential pipeline's up to float
reassociation, because each rank runs the very same layer code on its part.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..limits import Limits
from ..model.attention import Attention, grouped_attention
from ..model.checkpoint_config import CheckpointConfig
from ..model.embeddings import Grid
from ..model.speed import SpeedOptions
from ..model.transformer import BranchContext
from ..modes import ModeSpec, SamplingParams
from ..request import GenerationRequest
from ..sampling.guidance import COND, IMAGE, UNCOND
from ..sampling.pipeline import NeoPPPipeline, Prepared, StepFn, StopFn
from .mesh import Mesh, leave_mesh

# Which branches each of the 2 CFG ranks runs at a step that needs three: cond stays on rank 0
# (where unguided steps run it) and the two shorter prefixes share rank 1. Measured against the
# other pairings (bench/cfg_layout.py, bench/RESULTS.md): as fast or faster; cond+image the slowest.
THREE_BRANCH_SPLIT: tuple[tuple[str, ...], tuple[str, ...]] = ((COND,), (UNCOND, IMAGE))


def branches_by_rank(guided: tuple[str, ...],
                     three: tuple[tuple[str, ...], ...] = THREE_BRANCH_SPLIT) -> tuple[tuple[str, ...], ...]:
    """The branches of a guided step spread over 2 CFG ranks: one each, or ``three`` for three."""
    if len(guided) == 2:
        return (guided[:1], guided[1:])
    if sorted(sum(three, ())) != sorted(guided) or COND not in three[0]:
        raise ConfigError(f"three-branch split {three} must place {guided} once each, cond on rank 0")
    return three


class CommTimer:
    """Wall time spent inside collectives, to report the price of parallelism."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0

    @contextmanager
    def __call__(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


def check_heads(config: CheckpointConfig, mode: ModeSpec) -> None:
    sp = mode.seq_p_size
    if config.num_heads % sp or config.num_kv_heads % sp:
        raise ConfigError(f"mode {mode.name}: seq_p_size {sp} must divide num_attention_heads ({config.num_heads}) "
                          f"and num_key_value_heads ({config.num_kv_heads}) for Ulysses attention")


class UlyssesBranch(BranchContext):
    """A branch whose rank holds one token shard; attention runs on a head shard over all tokens."""

    def __init__(self, kv_online: torch.Tensor, offset: int, grid: Grid, config: CheckpointConfig,
                 device: torch.device, dtype: torch.dtype, mesh: Mesh, timer: CommTimer,
                 attention: Attention = grouped_attention) -> None:
        sp, r = mesh.seq_p_size, mesh.seq_rank
        kv_local = config.num_kv_heads // sp
        super().__init__(kv_online[:, :, :, r * kv_local:(r + 1) * kv_local], offset, grid, config, device, dtype,
                         attention)
        self.mesh, self.timer = mesh, timer
        self.num_tokens = grid.num_tokens
        self.shard = -(-grid.num_tokens // sp)
        self.padded = self.shard * sp
        self.start = r * self.shard
        self.rope = self.rope.padded_slice(self.padded, self.start, self.start + self.shard)

    def _exchange(self, x: torch.Tensor, split_dim: int, join_dim: int) -> torch.Tensor:
        """One all-to-all over the sequence group: chunk ``split_dim``, gather along ``join_dim``."""
        sp = self.mesh.seq_p_size
        send = [c.contiguous() for c in x.chunk(sp, dim=split_dim)]
        recv = [torch.empty_like(send[0]) for _ in range(sp)]
        with self.timer():
            dist.all_to_all(recv, send, group=self.mesh.seq_group)
        return torch.cat(recv, dim=join_dim)

    def _tokens_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[shard, H, HD] -> [padded, H/sp, HD]: trade the token split for a head split."""
        return self._exchange(x, split_dim=1, join_dim=0)

    def _heads_to_tokens(self, y: torch.Tensor) -> torch.Tensor:
        """[padded, H/sp, HD] -> [shard, H*HD]: back to this rank's tokens, all heads."""
        return self._exchange(y, split_dim=0, join_dim=1).reshape(self.shard, -1)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n = self.num_tokens
        q, k, v = (self._tokens_to_heads(t)[:n] for t in (q, k, v))
        out = super().attend(layer, q, k, v).view(n, q.shape[1], q.shape[2])
        if self.padded > n:
            out = torch.cat([out, out.new_zeros(self.padded - n, *out.shape[1:])])
        return self._heads_to_tokens(out)


class ParallelPipeline(NeoPPPipeline):
    """One rank of a `cfg_p x seq_p` mesh; all ranks call `generate` with the same request."""

    mesh: Mesh
    comm: CommTimer

    @classmethod
    def from_pretrained(cls, ckpt_dir: str | Path, mode: ModeSpec | None = None, mesh: Mesh | None = None,
                        device: str | None = None, dtype: torch.dtype | None = None, limits: Limits | None = None,
                        layer_linear=None, speed: SpeedOptions | None = None) -> ParallelPipeline:
        if mesh is None:
            raise ConfigError("ParallelPipeline needs a mesh (see neopp.parallel.mesh)")
        pipe = super().from_pretrained(ckpt_dir, mode, device, dtype, limits, layer_linear, speed)
        check_heads(pipe.config, pipe.mode)
        pipe.mesh, pipe.comm = mesh, CommTimer()
        return pipe

    def close(self) -> None:
        """Leaves the mesh: every rank calls this once its last request is done."""
        leave_mesh()

    @property
    def cfg_parallel(self) -> bool:
        return self.mesh.cfg_p_size > 1

    def batch_cfg(self, num_tokens: int) -> bool:
        """Sharded branches shard their own tokens; they are never batched together."""
        return self.mesh.seq_p_size == 1 and super().batch_cfg(num_tokens)

    def branch(self, kv: torch.Tensor, offset: int, grid: Grid) -> BranchContext:
        if self.mesh.seq_p_size == 1:
            return super().branch(kv, offset, grid)
        return UlyssesBranch(kv, offset, grid, self.config, self.device, self.dtype, self.mesh, self.comm,
                             self.attention)

    three_branch_split = THREE_BRANCH_SPLIT  # a benchmark or test may try another pairing

    def rank_branches(self, prep: Prepared) -> tuple[tuple[str, ...], ...]:
        """Which branches each CFG rank runs at this request's guided steps."""
        return branches_by_rank(prep.guided, self.three_branch_split)

    def prepare(self, req: GenerationRequest, names: tuple[str, ...] | None = None) -> Prepared:
        """This CFG rank lays out only its own branches (rank 0 always has cond)."""
        if not self.cfg_parallel:
            return super().prepare(req, names)
        prep = super().prepare(req, names=())
        rank = self.mesh.cfg_rank
        if any(prep.plan.guided_steps):
            mine = self.rank_branches(prep)[rank]
        else:
            mine = (COND,) if rank == 0 else ()
        prep.branches = {n: self.branch(*req.branch_input(n), prep.grid) for n in mine}
        return prep

    def velocity(self, hid: torch.Tensor, z: torch.Tensor, prep: Prepared, k: int,
                 branch: BranchContext) -> torch.Tensor:
        if not isinstance(branch, UlyssesBranch):
            return super().velocity(hid, z, prep, k, branch)
        n = branch.num_tokens
        if branch.padded > n:
            hid = torch.cat([hid, hid.new_zeros(branch.padded - n, hid.shape[1])])
        local = self.transformer.run_layers(hid[branch.start:branch.start + branch.shard], branch)
        parts = [torch.empty_like(local) for _ in range(self.mesh.seq_p_size)]
        with self.comm():
            dist.all_gather(parts, local.contiguous(), group=self.mesh.seq_group)
        return self.head_velocity(torch.cat(parts)[:n], z, prep, k)

    def step_velocity(self, prep: Prepared, x: torch.Tensor, z: torch.Tensor, k: int,
                      sampling: SamplingParams) -> torch.Tensor:
        if not self.cfg_parallel:
            return super().step_velocity(prep, x, z, k, sampling)
        first = self.mesh.cfg_rank == 0
        if not prep.plan.guided_steps[k]:
            # Outside guidance only the cond branch runs; its velocity is shared.
            if first:
                v = self.velocity(self.embed(x, prep, k), z, prep, k, prep.cond)
            else:
                v = torch.empty_like(z)
            with self.comm():
                dist.broadcast(v, src=self.mesh.global_rank(0, self.mesh.seq_rank), group=self.mesh.cfg_group)
            return v
        layout = self.rank_branches(prep)
        mine = layout[self.mesh.cfg_rank]
        vs = self.branch_velocities(self.embed(x, prep, k), z, prep, k, mine)
        # Equal-sized pieces for all_gather: a rank with fewer branches pads with zeros.
        width = max(len(names) for names in layout)
        sent = torch.stack([vs[n] for n in mine] + [torch.zeros_like(z)] * (width - len(mine)))
        got = [torch.empty_like(sent) for _ in range(self.mesh.cfg_p_size)]
        with self.comm():
            dist.all_gather(got, sent, group=self.mesh.cfg_group)
        every = {n: got[r][i] for r, names in enumerate(layout) for i, n in enumerate(names)}
        return self.combine_step(prep, k, [every[n] for n in self.step_branch_names(prep, k)], sampling)

    def sample(self, req: GenerationRequest, should_stop: StopFn | None = None, on_step: StepFn | None = None,
               prep: Prepared | None = None) -> torch.Tensor:
        """Rank 0's noise for every rank; a stop is agreed by all ranks before each step."""
        noise = req.noise.to(self.device, torch.float32).contiguous()
        with self.comm():
            dist.broadcast(noise, src=0, group=self.mesh.world_group)
        req.noise = noise

        def agreed_stop() -> bool:
            flag = torch.tensor([1.0 if (should_stop is not None and should_stop()) else 0.0], device=self.device)
            with self.comm():
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.mesh.world_group)
            return bool(flag.item())

        return super().sample(req, agreed_stop, on_step, prep)
