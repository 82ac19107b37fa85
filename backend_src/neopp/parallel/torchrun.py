"""A rank of a parallel mode started by torchrun (or by any launcher that sets its env vars).

LightLLM and the replay tools start one process per rank themselves, with ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set; each process then runs the same
calls on its own ``ParallelPipeline``.
"""

from __future__ import annotations

import atexit
import os
from pathlib import Path

import torch

from ..errors import ConfigError
from ..modes import ModeSpec


def rank_pipeline(checkpoint: str | Path, mode: ModeSpec, device: torch.device | str | None,
                  dtype: torch.dtype | None):
    """This process's rank of ``mode``; refuses a world size that is not the mode's."""
    from .mesh import check_world, init_mesh_from_env, leave_mesh
    from .parallel_pipeline import ParallelPipeline

    n = mode.world_size
    if "WORLD_SIZE" not in os.environ:
        raise ConfigError(f"mode {mode.name} runs on {n} processes (cfg_p_size {mode.cfg_p_size} x "
                          f"seq_p_size {mode.seq_p_size}): start it with "
                          f"torchrun --standalone --nproc_per_node={n} ...")
    check_world(mode, int(os.environ["WORLD_SIZE"]))
    dev = torch.device(device) if device is not None else None
    if (dev is None or dev == torch.device("cuda")) and torch.cuda.is_available():
        dev = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")
    dev = dev or torch.device("cpu")
    mesh = init_mesh_from_env(mode, dev)
    atexit.register(leave_mesh)  # a caller that never closes the pipeline still exits cleanly
    return ParallelPipeline.from_pretrained(str(checkpoint), mode, mesh, device=str(dev), dtype=dtype)
