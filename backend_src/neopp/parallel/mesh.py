"""The `cfg_p x seq_p` layout of ranks and its process groups.

Rank `r` is CFG rank `r // seq_p` and sequence rank `r % seq_p`: the ranks of one CFG branch
are contiguous, so on GPUs a branch's all-to-alls stay between neighbouring devices.
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..modes import ModeSpec
from ..ports import free_ports

DEFAULT_COLLECTIVE_TIMEOUT_S = 120.0


@dataclass
class Mesh:
    rank: int
    world_size: int
    cfg_p_size: int
    seq_p_size: int
    world_group: Any = None
    cfg_group: Any = None     # the ranks holding the same token shard of the two branches
    seq_group: Any = None     # the ranks of this rank's branch

    @property
    def cfg_rank(self) -> int:
        return self.rank // self.seq_p_size

    @property
    def seq_rank(self) -> int:
        return self.rank % self.seq_p_size

    def global_rank(self, cfg_rank: int, seq_rank: int) -> int:
        return cfg_rank * self.seq_p_size + seq_rank


def check_world(mode: ModeSpec, world_size: int) -> None:
    if world_size != mode.world_size:
        raise ConfigError(
            f"mode {mode.name}: {world_size} worker processes, but the number of worker processes must equal the "
            f"product of the parallel sizes (cfg_p_size {mode.cfg_p_size} x seq_p_size {mode.seq_p_size} "
            f"= {mode.world_size})")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def build_mesh(mode: ModeSpec, rank: int, world_size: int,
               timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> Mesh:
    """Create the groups; every rank must call this in the same order.

    Sub-groups get the same collective timeout as the world group: without it they would
    fall back to torch's 30-minute default and a hung rank would stall its branch peers.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    check_world(mode, world_size)
    mesh = Mesh(rank, world_size, mode.cfg_p_size, mode.seq_p_size, world_group=dist.group.WORLD)
    for seq_rank in range(mode.seq_p_size):
        ranks = [mesh.global_rank(c, seq_rank) for c in range(mode.cfg_p_size)]
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            mesh.cfg_group = group
    for cfg_rank in range(mode.cfg_p_size):
        ranks = [mesh.global_rank(cfg_rank, s) for s in range(mode.seq_p_size)]
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            mesh.seq_group = group
    return mesh


def rendezvous(rank: int, world_size: int, port: Any, timeout_s: float, host: str = "127.0.0.1") -> Any:
    """The ranks' key-value store. Rank 0 binds it on a port the kernel picks and publishes it
    in ``port.value`` (shared memory); the others wait for it (bounded). No port is picked in
    advance, so two pools starting at once cannot meet on the same one."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        store = dist.TCPStore(host, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        port.value = store.port
        return store
    deadline = time.monotonic() + timeout_s
    while port.value == 0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 published no rendezvous port within {timeout_s:.0f}s")
        time.sleep(0.02)
    return dist.TCPStore(host, port.value, world_size, is_master=False, timeout=timeout)


def init_mesh(mode: ModeSpec, rank: int, world_size: int, init_method: str | None, device: torch.device,
              timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S, store: Any = None) -> Mesh:
    """Join the process group through ``init_method`` (a URL) or an existing ``store``."""
    check_world(mode, world_size)
    dist.init_process_group(backend_for(device), init_method=init_method, store=store, rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    return build_mesh(mode, rank, world_size, timeout_s)


LEAVE_BARRIER_S = 10.0  # how long a rank waits at the exit for the others to reach it


def leave_mesh() -> None:
    """Destroys this process's groups, once every rank has come to it. A process that exits with
    a live gloo group can abort in teardown ("terminate called without an active exception") and
    fail its launcher; so can one whose peer tears its connections down while this one still
    uses them, so the ranks meet first (a rank that never comes is waited for LEAVE_BARRIER_S)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_world_size() > 1 and dist.get_backend() == "gloo":
        try:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=LEAVE_BARRIER_S))
        except RuntimeError:  # a rank is gone: nothing left to wait for
            pass
    dist.destroy_process_group()


def init_mesh_from_env(mode: ModeSpec, device: torch.device | None = None) -> Mesh:
    """Under `torchrun`: RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from the environment."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    check_world(mode, world_size)
    device = device or torch.device("cpu")
    if world_size == 1 and "MASTER_ADDR" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_ports(1)[0]), RANK="0")
    return init_mesh(mode, int(os.environ.get("RANK", "0")), world_size, "env://", device)


