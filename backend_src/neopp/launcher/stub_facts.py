"""What the launcher can see of a server's Python stubs without asking anyone: from ``/proc``,
each stub's identity (pid and start time), whether it is stopped, and the CPU time it and its rank
workers have used; from the server's metrics, which models have requests waiting, and how far
each has got (requests answered, denoising steps run). The stub watchdog judges stubs from these
facts only.
"""

from __future__ import annotations

import os
import re
import urllib.request
from dataclasses import dataclass

from ..procs import all_pids, cmdline, stub_instance

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
PENDING = "nv_inference_pending_request_count"
PROGRESS = ("nv_inference_request_success", "nv_inference_request_failure", "neopp_denoising_steps_total")


@dataclass(frozen=True)
class Stub:
    """One stub process seen at one moment; ``pid`` and ``started`` say which process it is."""

    instance: str
    pid: int
    started: int
    stopped: bool
    cpu_s: float  # the stub's and its descendants' (rank workers') CPU time


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """True while ``pid`` exists and has not exited (a zombie has)."""
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def server_stubs(server_pid: int) -> dict[str, Stub]:
    """Instance name -> its live stub, for every Python stub ``server_pid`` started (one pass over /proc)."""
    stats = {pid: fields for pid in all_pids() if (fields := _stat(pid)) and fields[0] not in ("Z", "X")}
    children: dict[int, list[int]] = {}
    for pid, fields in stats.items():
        children.setdefault(int(fields[1]), []).append(pid)

    def tree_cpu(root: int) -> float:
        ticks, todo = 0, [root]
        while todo:
            fields = stats.get(pid := todo.pop())
            if fields:
                ticks += int(fields[11]) + int(fields[12])
                todo += children.get(pid, [])
        return ticks * TICK_S

    stubs = {}
    for pid in children.get(server_pid, []):
        instance = stub_instance(cmdline(pid))
        if instance is not None:
            fields = stats[pid]
            stubs[instance] = Stub(instance, pid, int(fields[19]), fields[0] in ("T", "t"), tree_cpu(pid))
    return stubs


def model_of(instance: str) -> str:
    """``<model>_<group>_<index>`` -> ``<model>``."""
    return instance.rsplit("_", 2)[0]


_SERIES = re.compile(r'^(\w+)\{(?:[^}]*,)?model="([^"]+)"[^}]*\} (\S+)$', re.MULTILINE)


def model_traffic(metrics_url: str, timeout_s: float = 5.0) -> dict[str, tuple[float, float]]:
    """Model -> (requests waiting now, requests answered and steps run so far), from the server's metrics."""
    with urllib.request.urlopen(metrics_url, timeout=timeout_s) as resp:
        text = resp.read().decode("utf-8", "replace")
    out: dict[str, tuple[float, float]] = {}
    for name, model, value in _SERIES.findall(text):
        pending, progress = out.get(model, (0.0, 0.0))
        if name == PENDING:
            pending += float(value)
        elif name in PROGRESS:
            progress += float(value)
        else:
            continue
        out[model] = (pending, progress)
    return out
