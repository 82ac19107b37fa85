"""Phrases of the per-request log line, shared by the Triton models and the replay tools.

Users read these lines to learn why a parallel mode did or did not split a request, so the
wording is written once.
"""

from __future__ import annotations

from .modes import ModeSpec
from .pipeline import GenerationRequest


def parallelism_note(mode: ModeSpec, req: GenerationRequest, plan: list[bool]) -> str:
    """One log phrase: was CFG-parallel (and sequence parallelism) active, and if not, why."""
    guided = sum(plan)
    s = req.sampling
    if mode.cfg_p_size < 2:
        guidance = "cfg-parallel off (mode has cfg_p_size 1)"
    elif not s.enable_cfg:
        guidance = "cfg-parallel inactive: guidance disabled (enable_cfg false)"
    elif s.cfg_scale <= 1.0:
        guidance = f"cfg-parallel inactive: CFG_SCALE {s.cfg_scale} <= 1"
    elif req.uncond_kv is None:
        guidance = "cfg-parallel inactive: no UNCOND_KV"
    elif guided == 0:
        guidance = f"cfg-parallel inactive: no step inside cfg_interval {s.cfg_interval}"
    else:
        guidance = f"cfg-parallel active on {guided}/{len(plan)} steps"
        if guided < len(plan):
            guidance += f" ({len(plan) - guided} outside cfg_interval {s.cfg_interval})"
    seq = (f"sequence-parallel (ulysses) active on {mode.seq_p_size} ranks per branch" if mode.seq_p_size > 1
           else "sequence-parallel off")
    return f"{guidance}; {seq}"
