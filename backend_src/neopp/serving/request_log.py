"""The per-request log line, shared by the Triton models and the replay tools.

One line per delivered image, space-separated fields a script can grep, e.g. (one line)::

    neopp_dense_cfg: 1024x1024 task=t2i prefix=325+9 tokens steps=50 png 1534511 B
    e2e_time_ms=9120 cfg_parallel=on seq_parallel=off(reason=one_seq_rank)

The parallel fields come from :func:`neopp.parallel.status.parallel_status`; the wording is
written once here so the server's log and the replay output read the same.
"""

from __future__ import annotations

from ..modes import ModeSpec
from ..parallel.status import parallel_status
from ..request import GenerationRequest
from ..sampling.plan import step_plan


def request_line(name: str, mode: ModeSpec, req: GenerationRequest, image_bytes: int, seconds: float) -> str:
    """The log line of one delivered image; `seconds` is its end-to-end time."""
    uncond_tokens = 0 if req.uncond_kv is None else req.uncond_kv.shape[2]
    s = req.sampling
    status = parallel_status(mode, s, req.uncond_kv is not None, list(step_plan(req).guided_steps))
    return (f"{name}: {req.height}x{req.width} task={req.task} prefix={req.cond_kv.shape[2]}+{uncond_tokens} tokens "
            f"steps={s.infer_steps} {s.output_format} {image_bytes} B e2e_time_ms={round(seconds * 1e3)} "
            f"{status.fields()}")
