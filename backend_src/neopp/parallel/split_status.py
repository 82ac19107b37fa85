"""Did CFG-parallel and sequence parallelism split a request, and if not, why not.

Users read the answer in each request's log line (and in the replay tools' output), as two
short fields a script can grep::

    cfg_parallel=on  cfg_parallel=partial(steps=3/5,reason=steps_outside_cfg_interval)
    cfg_parallel=off(reason=cfg_scale<=1)  seq_parallel=on(ranks=2)  seq_parallel=off(reason=one_seq_rank)

`docs/troubleshooting.md` explains each reason and its fix. The reasons CFG-parallel can be
off are the ordered rules of :data:`CFG_OFF_RULES`; the first that holds is reported, so a
new guidance branch (an image-guidance scale, say) adds its reason there, in its place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..modes import ModeSpec, SamplingParams

GUIDANCE_OFF_IN_MODE = "guidance_off_in_mode"
ONE_CFG_RANK = "one_cfg_rank"
GUIDANCE_OFF_BY_OVERRIDE = "guidance_off_by_override"
CFG_SCALE_AT_MOST_1 = "cfg_scale<=1"
NO_UNCOND_KV = "no_uncond_kv"
NO_STEP_IN_INTERVAL = "no_step_in_cfg_interval"
STEPS_OUTSIDE_INTERVAL = "steps_outside_cfg_interval"
ONE_SEQ_RANK = "one_seq_rank"


@dataclass(frozen=True)
class RequestFacts:
    """What decides the status: the mode, the request's sampling values, its prefixes, its plan."""

    mode: ModeSpec
    sampling_params: SamplingParams
    has_uncond: bool
    plan: list[bool]


# (reason, does it hold) in order of precedence: a mode-level cause before a request-level one.
CFG_OFF_RULES: tuple[tuple[str, Callable[[RequestFacts], bool]], ...] = (
    (GUIDANCE_OFF_IN_MODE, lambda f: not f.sampling_params.enable_cfg and not f.mode.sampling_params.enable_cfg),
    (ONE_CFG_RANK, lambda f: f.mode.cfg_p_size < 2),
    (GUIDANCE_OFF_BY_OVERRIDE, lambda f: not f.sampling_params.enable_cfg),
    (CFG_SCALE_AT_MOST_1, lambda f: f.sampling_params.cfg_scale <= 1.0),
    (NO_UNCOND_KV, lambda f: not f.has_uncond),
    (NO_STEP_IN_INTERVAL, lambda f: not any(f.plan)),
)


@dataclass(frozen=True)
class ParallelStatus:
    cfg_state: str            # "on", "partial" or "off"
    cfg_reason: str | None    # why not (on every step); None when on
    guided_steps: int         # steps that run guidance (on whichever ranks)
    steps: int
    seq_ranks: int            # Ulysses ranks per branch; 1 when off
    seq_reason: str | None

    @property
    def cfg_field(self) -> str:
        if self.cfg_state == "on":
            return "cfg_parallel=on"
        if self.cfg_state == "partial":
            return f"cfg_parallel=partial(steps={self.guided_steps}/{self.steps},reason={self.cfg_reason})"
        return f"cfg_parallel=off(reason={self.cfg_reason})"

    @property
    def seq_field(self) -> str:
        if self.seq_reason is None:
            return f"seq_parallel=on(ranks={self.seq_ranks})"
        return f"seq_parallel=off(reason={self.seq_reason})"

    def fields(self) -> str:
        return f"{self.cfg_field} {self.seq_field}"


def parallel_status(mode: ModeSpec, sampling: SamplingParams, has_uncond: bool, plan: list[bool]) -> ParallelStatus:
    """The status of one request; `plan` is its guidance plan (one flag per step)."""
    facts = RequestFacts(mode, sampling, has_uncond, plan)
    guided, steps = sum(plan), len(plan)
    reason = next((name for name, holds in CFG_OFF_RULES if holds(facts)), None)
    if reason is not None:
        state = "off"
    elif guided < steps:
        state, reason = "partial", STEPS_OUTSIDE_INTERVAL
    else:
        state = "on"
    seq_on = mode.seq_p_size > 1
    return ParallelStatus(state, reason, guided, steps, mode.seq_p_size if seq_on else 1,
                          None if seq_on else ONE_SEQ_RANK)
