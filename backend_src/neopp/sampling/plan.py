"""A request's step plan and the rules it must meet, each written once.

The plan (the shifted time grid and, per step, which guidance branches run) is computed once
per request from its sampling values, as a diffusers scheduler owns its timesteps; validation,
every engine and the log line read the same one. ``RequestRules`` holds the checks that need the
checkpoint's geometry and the deployment's limits: every engine holds one, and the Triton
request parser calls the same checks at its boundary, so a rule cannot drift between paths.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..errors import InputError, shown
from ..limits import Limits
from ..model.checkpoint_config import CheckpointConfig
from ..model.kv_cache import validate_kv
from ..modes import TASKS, ModeSpec, SamplingParams
from ..request import COND, UNCOND, GenerationRequest, check_offset, check_side_bounds, check_steps
from .guidance import guidance_plan, guided_branches
from .schedule import shifted_timesteps


def step_plan(req: GenerationRequest) -> StepPlan:
    """The request's steps and guidance, computed once for its sampling values."""
    try:
        return _step_plan(req.sampling_params, req.image_editing)
    except TypeError:  # sampling values that do not hash (built by hand): computed each time
        return StepPlan.of(req.sampling_params, req.image_editing)


@dataclass(frozen=True)
class StepPlan:
    """A request's time grid and, per step, whether it is guided and by which branches."""

    times: tuple[float, ...]
    guided_steps: tuple[bool, ...]  # per step: does it run more than the cond branch
    guided_branches: tuple[str, ...]  # what a guided step runs, cond first

    @classmethod
    def of(cls, sampling: SamplingParams, image: bool = False) -> StepPlan:
        times = shifted_timesteps(sampling.infer_steps, sampling.timestep_shift)
        return cls(tuple(times), tuple(guidance_plan(sampling, times, image)), guided_branches(sampling, image))

    @property
    def steps(self) -> int:
        return len(self.times) - 1

    def branch_names(self, k: int) -> tuple[str, ...]:
        """The branches step k runs, cond first: the one place that says so."""
        return self.guided_branches if self.guided_steps[k] else (COND,)

    def reads(self, name: str) -> bool:
        """Does any step of this plan run branch ``name``?"""
        return name == COND or (any(self.guided_steps) and name in self.guided_branches)


@functools.lru_cache(maxsize=256)
def _step_plan(sampling: SamplingParams, image: bool) -> StepPlan:
    return StepPlan.of(sampling, image)


def image_branch_refusal(sampling: SamplingParams) -> str:
    """The one message for image guidance asked for without the image branch (every path uses it)."""
    return (f"image_guidance_scale: {sampling.image_guidance_scale:g} refused without the image branch "
            "(image_kv / IMAGE_KV with its index offset: the input images without the prompt); send it, "
            "or set image_guidance_scale to 1")


def uncond_reason(sampling: SamplingParams, image: bool) -> str:
    """Why this request's guided steps read the uncond branch, in its own values."""
    s = sampling
    where = f"inside cfg_interval {s.cfg_interval}"
    if not image:
        return (f"guidance is on for some steps (cfg_scale {s.cfg_scale} > 1 {where}); "
                "send it, or set cfg_scale <= 1")
    relation = "==" if s.cfg_scale == s.image_guidance_scale else "!="
    return (f"image_guidance_scale {s.image_guidance_scale:g} {relation} cfg_scale {s.cfg_scale:g} and != 1: "
            f"image-editing guidance reads the uncond branch (empty prompt, no image) at the steps {where}; "
            "send it, or set image_guidance_scale to 1")


@dataclass(frozen=True)
class RequestRules:
    """The checks that need the checkpoint's geometry and the deployment's limits."""

    config: CheckpointConfig
    limits: Limits
    support_tasks: tuple[str, ...] = TASKS

    def validate(self, req: GenerationRequest) -> None:
        """Every rule a request can break, checked before any heavy work or noise draw."""
        if req.task not in self.support_tasks:
            raise InputError(f"task: unsupported task {shown(req.task)}; supported: {self.support_tasks}")
        self.check_size(req.height, req.width)
        check_steps(req.sampling_params.infer_steps, self.limits)
        dims, max_tokens = self.config.kv_dims, self.limits.max_prefix_tokens
        validate_kv(req.cond_kv, dims, "cond_kv", max_tokens)
        check_offset(req.index_offset_cond, self.limits, "index_offset_cond")
        if req.uncond_kv is not None:
            validate_kv(req.uncond_kv, dims, "uncond_kv", max_tokens)
            if req.index_offset_uncond is None:
                raise InputError("index_offset_uncond: required when uncond_kv is given")
            check_offset(req.index_offset_uncond, self.limits, "index_offset_uncond")
        self.check_image_branch(req)
        self.check_branches_present(req)

    def check_image_branch(self, req: GenerationRequest) -> None:
        """IMAGE_KV checked like the uncond prefix; its offset comes with it, never alone."""
        if req.image_kv is not None:
            validate_kv(req.image_kv, self.config.kv_dims, "image_kv", self.limits.max_prefix_tokens)
            if req.index_offset_image is None:
                raise InputError("index_offset_image: required when image_kv is given")
            check_offset(req.index_offset_image, self.limits, "index_offset_image")
        elif req.index_offset_image is not None:
            raise InputError("index_offset_image: given without image_kv; send both or neither")
        elif req.sampling_params.image_guidance_scale != 1.0:
            raise InputError(image_branch_refusal(req.sampling_params))

    @staticmethod
    def check_branches_present(req: GenerationRequest) -> None:
        """The uncond branch, when a guided step of this request reads it, must have been sent
        (the image branch cannot be missing: sending it is what selects image-editing guidance)."""
        if req.uncond_kv is None and step_plan(req).reads(UNCOND):
            raise InputError(f"uncond_kv: required because {uncond_reason(req.sampling_params, req.image_editing)}")

    def check_size(self, height: int, width: int, field: str = "size") -> None:
        """Bounds, then what the checkpoint needs: whole tokens and enough vision positions."""
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in (height, width)):
            raise InputError(f"{field}: height and width must be integers, got {shown((height, width))}")
        t = self.config.token_size
        check_side_bounds(height, width, self.limits, field, t)
        wrong = [f"{what} {v}" for what, v in (("height", height), ("width", width)) if v % t]
        if wrong:
            raise InputError(f"{field}: height and width must each be a positive multiple of {t}, got "
                             f"[{height}, {width}] ({' and '.join(wrong)} {'is' if len(wrong) == 1 else 'are'} not)")
        max_patches = self.config.max_position_embeddings_vision
        if max(height, width) // self.config.patch_size > max_patches:
            raise InputError(f"{field}: {max(height, width)} pixels exceed the vision positions of the checkpoint "
                             f"({max_patches} patches of {self.config.patch_size})")


CACHE_MIN_STEPS = 10  # a step cache on fewer steps (a distilled sampler): no step to spare


def check_cache(mode: ModeSpec, sampling: SamplingParams) -> None:
    """The cache a request asks for must be one this model offers, on enough steps."""
    if sampling.cache == "off":
        return
    offered = mode.step_caches
    if sampling.cache not in offered:
        why = ("its Ulysses ranks would each decide on a shard of the tokens" if mode.seq_p_size > 1
               else "its config parameter cache_methods does not list it")
        raise InputError(f"cache: {sampling.cache!r} is not offered by this model (mode {mode.name}: {why}); "
                         f"offered: {['off', *offered]}")
    if sampling.infer_steps < CACHE_MIN_STEPS:
        raise InputError(f"cache: needs at least {CACHE_MIN_STEPS} steps, got {sampling.infer_steps} "
                         "(a few-step sampler has no step to spare); send cache off")
