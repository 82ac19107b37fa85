"""The denoising loop: validate a request, prepare its branches once, step, decode.

`NeoPPPipeline` is what every serving path calls; the parallel engine reuses it per rank
and overrides only how a step's velocities are computed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError, GenerationCancelled, InputError
from ..limits import Limits
from ..model.adapter_store import DEFAULT_MAX_BYTES, AdapterDirectory, AdapterStore
from ..model.adapters import Adapter, RowGroup, build_adapter, row_adapters, tower_linears
from ..model.checkpoint import default_dtype, load_checkpoint
from ..model.checkpoint_config import CheckpointConfig
from ..model.embeddings import Grid, patchify, unpatchify
from ..model.gguf_checkpoint import GGUFWeight
from ..model.layer_offload import LayerOffload, layer_offload
from ..model.layers import ROW_ADAPTERS
from ..model.lora import apply_loras_
from ..model.quant import fp8_layer_linear, quantize_layer_linears_
from ..model.speed import SpeedOptions
from ..model.transformer import BatchedBranches, BranchContext, LinearFactory, NeoPPTransformer
from ..modes import TASKS, ModeSpec, SamplingParams
from ..request import GenerationRequest
from .guidance import COND, UNCOND, combine
from .plan import RequestRules, StepPlan, check_cache, step_plan
from .sampler import FlowSampler, to_pixels
from .schedule import initial_noise_scale

StopFn = Callable[[], bool]
StepFn = Callable[[int, float], None]
# (step index, prediction thunk): the thunk returns step k's clean-image estimate [1, 3, H, W]; valid
# only during the call (the state moves on right after), so a preview costs nothing unless asked for.
# Batched CFG wins where matmuls are short (few tokens); see bench/RESULTS.md.
BATCH_CFG_MAX_TOKENS = 4096


@dataclass
class Prepared:
    """Everything about a request that does not change from step to step."""

    grid: Grid
    plan: StepPlan
    sampler: FlowSampler
    branches: dict[str, BranchContext]  # the branches this process runs, by name
    image: bool = False  # image-editing guidance

    @property
    def times(self) -> tuple[float, ...]:
        return self.plan.times

    @property
    def noise_scale(self) -> float:
        return self.sampler.noise_scale

    @property
    def guided(self) -> tuple[str, ...]:
        """The branches a guided step combines, cond first."""
        return self.plan.guided_branches

    @property
    def cond(self) -> BranchContext | None:
        return self.branches.get(COND)

    @property
    def uncond(self) -> BranchContext | None:
        return self.branches.get(UNCOND)


class NeoPPPipeline:
    def __init__(self, config: CheckpointConfig, transformer: NeoPPTransformer, mode: ModeSpec,
                 device: torch.device, dtype: torch.dtype, limits: Limits | None = None,
                 support_tasks: tuple[str, ...] = TASKS, speed: SpeedOptions | None = None) -> None:
        self.config, self.transformer, self.mode = config, transformer, mode
        self.device, self.dtype = device, dtype
        self.limits = limits or Limits()
        self.rules = RequestRules(config, self.limits, support_tasks)
        self.cfg_batching = "auto"
        self.use_speed(speed or SpeedOptions())
        self.use_adapter_dir(None)

    @classmethod
    def from_pretrained(cls, ckpt_dir: str | Path, mode: ModeSpec | None = None, device: str | None = None,
                        dtype: torch.dtype | None = None, limits: Limits | None = None,
                        layer_linear: LinearFactory | None = None, speed: SpeedOptions | None = None,
                        offload: LayerOffload | None = None) -> NeoPPPipeline:
        """``offload``: the layers' offload, in place of the one the mode's ``offload`` names (a
        test's stand-in on the CPU)."""
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = dtype or default_dtype(dev)
        mode = mode or ModeSpec()
        config, tensors = load_checkpoint(ckpt_dir)
        mode = config.fit(mode)
        if (mode.version == "moe") != config.is_moe:
            raise ConfigError(f"mode {mode.name}: version {mode.version!r} does not match the checkpoint "
                              f"({'MoE' if config.is_moe else 'dense'} weights in {ckpt_dir})")
        if mode.lora_configs:  # merged into the weights, before any quantisation
            apply_loras_(tensors, mode.lora_configs)
        if mode.dit_quantized and any(isinstance(w, GGUFWeight) for w in tensors.values()):
            raise ConfigError(f"mode {mode.name}: FP8 quantisation of a GGUF checkpoint: its linears are "
                              "quantized already; serve it with a mode without dit_quantized")
        if mode.dit_quantized:  # FP8 layer linears; quantise in place so originals are freed early
            quantize_layer_linears_(tensors)
            layer_linear = layer_linear or fp8_layer_linear(dev)
        offload = offload or layer_offload(mode.offload, dev)
        transformer = NeoPPTransformer.from_tensors(config, tensors, dev, dtype, layer_linear, offload)
        return cls(config, transformer, mode, dev, dtype, limits, speed=speed)

    def use_speed(self, speed: SpeedOptions) -> None:
        """Take these speed options from the next request on (a benchmark compares them on one tower)."""
        self.speed = speed
        self.attention = speed.attention()
        self.transformer.compile_layers(speed.compile_layers == "on")
        # Graphs hold one process's launches; a rank of a parallel mode exchanges with others mid-layer.
        one_process = self.mode.world_size == 1
        tower = self.transformer
        if tower.offload is not None and speed.cuda_graphs == "on":
            raise ConfigError(f"parameter cuda_graphs: 'on' cannot run with offload {tower.offload.policy!r}: a graph "
                              "would replay one layer's weights; use auto (off with offload) or off")
        self.layer_graphs = speed.layer_graphs(tower.run_layers, self.device, tower.reads_host_values) \
            if one_process and tower.offload is None else None

    # ---- adapters (LoRA per request) -----------------------------------------------------
    def use_adapter_dir(self, folder: str | Path | None, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        """Offer the adapters of ``folder`` (None: none), at most ``max_bytes`` of them resident."""
        linears = tower_linears(self.transformer)

        def load(name: str, path: Path, recommended: dict, max_bytes: int) -> Adapter:
            return build_adapter(name, path, linears, self.device, self.dtype, recommended, max_bytes)

        self.adapters = AdapterStore(AdapterDirectory(folder), load, max_bytes)

    def adapter(self, req: GenerationRequest) -> Adapter | None:
        """The adapter a request names, loaded if need be (None: the base model). Each rank of a
        parallel mode loads it from the same folder: its rows (a CFG rank's branches, a Ulysses
        rank's token shard) take the same per-row delta as on one device. An adapter loaded when
        the request was accepted (``req.adapter``, off the step thread) is the one it runs on."""
        if req.lora is None:
            return None
        return req.adapter if req.adapter is not None else self.adapters.get(req.lora)

    # ---- validation -------------------------------------------------------------------
    def validate(self, req: GenerationRequest) -> None:
        """Every rule a request can break, checked before any heavy work (see RequestRules)."""
        self.rules.validate(req)
        check_cache(self.mode, req.sampling_params)

    def close(self) -> None:
        """Drop the graphs (the worker pool stops its ranks here)."""
        if self.layer_graphs is not None:
            self.layer_graphs.clear()

    # ---- preparation ------------------------------------------------------------------
    def guidance_plan(self, req: GenerationRequest) -> list[bool]:
        """Per step: does it run guidance (the request's plan, computed once)."""
        return list(step_plan(req).guided_steps)

    def grid(self, height: int, width: int) -> Grid:
        c = self.config
        return Grid.build(height, width, c.patch_size, c.merge_size, c.vision_hidden_size, c.rope_theta_vision,
                          self.device)

    def branch(self, kv: torch.Tensor, offset: int, grid: Grid) -> BranchContext:
        return BranchContext(kv, offset, grid, self.config, self.device, self.dtype, self.attention)

    def prepare(self, req: GenerationRequest, names: tuple[str, ...] | None = None) -> Prepared:
        """Lay out the branches ``names`` (default: cond, plus what guided steps read, if any)."""
        plan, grid = step_plan(req), self.grid(req.height, req.width)
        if names is None:
            names = plan.guided_branches if any(plan.guided_steps) else (COND,)
        branches = {name: self.branch(*req.branch_input(name), grid) for name in names}
        sampler = FlowSampler(plan.times, initial_noise_scale(self.config, grid.num_tokens))
        return Prepared(grid, plan, sampler, branches, req.image_editing)

    # ---- the loop ---------------------------------------------------------------------
    def velocity(self, hid: torch.Tensor, z: torch.Tensor, prep: Prepared, k: int,
                 branch: BranchContext) -> torch.Tensor:
        """One branch's velocity at step k: the layers, then the head."""
        return self.head_velocity(self.run_layers(hid, branch), z, prep, k)

    def run_layers(self, hid: torch.Tensor, branches: BranchContext | BatchedBranches,
                   adapters: tuple[RowGroup, ...] = (), layers: range | None = None) -> torch.Tensor:
        """The decoder layers (``layers``: a part of them, as a step cache runs), through a CUDA graph
        where the model has them; a step carrying adapters runs eagerly (a graph or a compiled layer
        holds only the base computation)."""
        if adapters:
            with row_adapters(adapters):
                return self.transformer.run_layers(hid, branches, layers, eager=True)
        if ROW_ADAPTERS.get():  # a whole request under its adapter (``sample``)
            return self.transformer.run_layers(hid, branches, layers, eager=True)
        if layers is not None:
            return self.transformer.run_layers(hid, branches, layers)
        graphs = self.layer_graphs
        return self.transformer.run_layers(hid, branches) if graphs is None else graphs(hid, branches)

    def release(self, prep: Prepared) -> None:
        """Free what a finished request held beyond its branches (its graphs)."""
        if self.layer_graphs is not None:
            self.layer_graphs.release(prep.branches.values())

    def head_velocity(self, hid: torch.Tensor, z: torch.Tensor, prep: Prepared, k: int) -> torch.Tensor:
        """The head on the final hidden states; the sampler turns its prediction into a velocity."""
        return prep.sampler.velocity(self.transformer.predict(hid, prep.grid), z, k)

    def embed(self, x: torch.Tensor, prep: Prepared, k: int) -> torch.Tensor:
        """The image tokens entering the layers at step k."""
        return self.transformer.embed(x.to(self.dtype), prep.times[k], prep.noise_scale, prep.grid)

    def step_branch_names(self, prep: Prepared, k: int) -> tuple[str, ...]:
        """The branches step k runs, cond first (the request's plan says so)."""
        return prep.plan.branch_names(k)

    def step_branches(self, prep: Prepared, k: int) -> list[BranchContext | None]:
        """The contexts of `step_branch_names`, in order; a rank of the CFG-parallel engine holds
        None for the branches another rank computes."""
        return [prep.branches.get(name) for name in self.step_branch_names(prep, k)]

    def combine_step(self, prep: Prepared, k: int, velocities: list[torch.Tensor],
                     sampling: SamplingParams) -> torch.Tensor:
        """The step's velocity from its branches' ones (ordered as `step_branch_names`)."""
        names = self.step_branch_names(prep, k)
        if len(names) == 1:
            return velocities[0]
        return combine(dict(zip(names, velocities)), sampling, prep.image)

    def step_velocity(self, prep: Prepared, x: torch.Tensor, z: torch.Tensor, k: int,
                      sampling: SamplingParams) -> torch.Tensor:
        """The (guided) velocity of step k; the parallel engine overrides this."""
        hid = self.embed(x, prep, k)
        names = self.step_branch_names(prep, k)
        vs = self.branch_velocities(hid, z, prep, k, names)
        return self.combine_step(prep, k, [vs[n] for n in names], sampling)

    def branch_velocities(self, hid: torch.Tensor, z: torch.Tensor, prep: Prepared, k: int,
                          names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """Velocities of several branches at one step: one batch, or one pass each."""
        if len(names) > 1 and self.batch_cfg(prep.grid.num_tokens):
            batch = BatchedBranches([prep.branches[n] for n in names])
            out = self.run_layers(torch.cat([hid] * len(names)), batch).split(hid.shape[0])
            return {n: self.head_velocity(h, z, prep, k) for n, h in zip(names, out)}
        return {n: self.velocity(hid, z, prep, k, prep.branches[n]) for n in names}

    def batch_cfg(self, num_tokens: int) -> bool:
        """Run a step's branches as one batch? `cfg_batching` is on, off, or auto (by token count)."""
        if self.cfg_batching == "auto":
            return num_tokens <= BATCH_CFG_MAX_TOKENS
        return self.cfg_batching == "on"

    @torch.inference_mode()
    def sample(self, req: GenerationRequest, should_stop: StopFn | None = None, on_step: StepFn | None = None,
               prep: Prepared | None = None) -> torch.Tensor:
        """Run every step; the state stays float32 whatever the run dtype."""
        if req.sampling_params.cache != "off":  # the cache's state lives in the step batcher's requests
            raise InputError(f"cache: {req.sampling_params.cache!r} runs only in a step-batching engine; "
                             "send cache off")
        adapter = self.adapter(req)
        prep = prep or self.prepare(req)
        groups = () if adapter is None else (RowGroup(0, None, adapter, req.lora_scale),)
        try:
            with row_adapters(groups):
                return self._steps(req, prep, should_stop, on_step)
        finally:
            self.release(prep)

    def _steps(self, req: GenerationRequest, prep: Prepared, should_stop: StopFn | None,
               on_step: StepFn | None) -> torch.Tensor:
        sampler, t_size = prep.sampler, prep.grid.token_size
        x = sampler.start(req, self.device)
        z = patchify(x, t_size)
        for k in range(sampler.steps):
            if should_stop is not None and should_stop():
                raise GenerationCancelled(f"cancelled before step {k + 1} of {sampler.steps}")
            start = time.perf_counter()
            v = self.step_velocity(prep, x, z, k, req.sampling_params)
            sampler.step(z, v, k)
            x = unpatchify(z, req.height, req.width, t_size)
            if on_step is not None:
                on_step(k, time.perf_counter() - start)
        return x

    def generate(self, req: GenerationRequest, should_stop: StopFn | None = None,
                 on_step: StepFn | None = None) -> np.ndarray:
        """Final uint8 pixels [H, W, 3]."""
        return to_pixels(self.sample(req, should_stop, on_step))


def set_threads(threads: int | None) -> None:
    """Intra-op threads for this process (a model instance or a rank)."""
    if threads:
        torch.set_num_threads(int(threads))
    elif "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
