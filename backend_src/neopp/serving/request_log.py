"""The per-request log line, shared by the Triton models and the replay tools.

One line per delivered image, space-separated fields a script can grep, e.g. (one line)::

    neopp_dense_cfg: 1024x1024 task=t2i prefix=325+9 tokens steps=50 png 1534511 B
    e2e_time_ms=9120 cfg_parallel=on seq_parallel=off(reason=one_seq_rank)

The fields that describe the request (``request_summary``) are known where it runs, in the
engine's stub; the line is written where the image is delivered, which may be another stub: so
the summary is plain strings. The parallel fields come from
:func:`neopp.parallel.split_status.parallel_status`; the wording is written once here so the server's
log and the replay output read the same.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..modes import ModeSpec
from ..parallel.split_status import parallel_status

if TYPE_CHECKING:  # a forwarding stub writes lines without torch
    from ..request import GenerationRequest


def request_summary(mode: ModeSpec, req: GenerationRequest) -> dict[str, str]:
    """What the log line says of the request, as strings."""
    from ..sampling.plan import step_plan

    s = req.sampling_params
    uncond_tokens = 0 if req.uncond_kv is None else req.uncond_kv.shape[2]
    status = parallel_status(mode, s, req.uncond_kv is not None, list(step_plan(req).guided_steps))
    return {"size": f"{req.height}x{req.width}", "task": req.task,
            "prefix": f"{req.cond_kv.shape[2]}+{uncond_tokens}", "steps": str(s.infer_steps),
            "format": s.output_format, "parallel": status.fields()}


def summary_line(name: str, summary: dict[str, str], image_bytes: int, seconds: float) -> str:
    """The log line of one delivered image from its summary; ``seconds`` is its end-to-end time."""
    return (f"{name}: {summary['size']} task={summary['task']} prefix={summary['prefix']} tokens "
            f"steps={summary['steps']} {summary['format']} {image_bytes} B e2e_time_ms={round(seconds * 1e3)} "
            f"{summary['parallel']}")


def request_line(name: str, mode: ModeSpec, req: GenerationRequest, image_bytes: int, seconds: float) -> str:
    """The log line of one image generated in this process."""
    return summary_line(name, request_summary(mode, req), image_bytes, seconds)
