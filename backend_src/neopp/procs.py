"""Reading /proc: the processes a server runs (stubs, rank workers) and their memory.

Several servers may share a host, so every lookup of a server's processes starts from that
server's pid and stays inside its process group: nothing here selects another server's stubs.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path


def cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


STUB_NAME = "triton_python_backend_stub"
SPAWN_MARKER = "multiprocessing.spawn"  # a child started with the "spawn" start method


def _stat(pid: int) -> list[str]:
    """Fields of /proc/<pid>/stat after "(comm)": state, ppid, pgrp, ... (empty when gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def ppid(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[1]) if fields else None


def is_stopped(pid: int) -> bool:
    """True for a process stopped by a signal or a tracer (state T or t)."""
    fields = _stat(pid)
    return bool(fields) and fields[0] in ("T", "t")


def pgid(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[2]) if fields else None


def start_ticks(pid: int) -> int | None:
    """When the process started (clock ticks after boot): with the pid, who it is (pids are reused)."""
    fields = _stat(pid)
    return int(fields[19]) if fields else None


def cpu_ticks(pid: int) -> int:
    """CPU time the process has used, user and system (clock ticks; 0 when gone)."""
    fields = _stat(pid)
    return int(fields[11]) + int(fields[12]) if fields else 0


def all_pids() -> list[int]:
    return [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()]


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` (stubs, their rank workers), found through ppids."""
    children: dict[int, list[int]] = {}
    for pid in all_pids():
        parent = ppid(pid)
        if parent is not None:
            children.setdefault(parent, []).append(pid)
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def rss_bytes(pids: list[int]) -> int:
    """Sum of VmRSS of ``pids`` (a process that is gone counts 0)."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
                    break
        except OSError:
            continue
    return total


def rss_parts(pids: list[int]) -> dict[str, int]:
    """RSS of ``pids`` split as the kernel counts it: ``anon`` (heap), ``file``, ``shmem``
    (mapped /dev/shm pages, e.g. the Python backend's regions, counted in every process that
    touched them), and ``total``; a process that is gone counts 0."""
    fields = {"RssAnon:": "anon", "RssFile:": "file", "RssShmem:": "shmem", "VmRSS:": "total"}
    out = dict.fromkeys(fields.values(), 0)
    for pid in pids:
        try:
            lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            key = fields.get(line.split(maxsplit=1)[0]) if line.strip() else None
            if key:
                out[key] += int(line.split()[1]) * 1024
    return out


def process_group_members(group: int) -> list[int]:
    """Live pids in process group ``group`` (the server's stubs inherit its group)."""
    pids = []
    for pid in all_pids():
        fields = _stat(pid)
        # zombies are already gone for our purpose
        if fields and fields[0] != "Z" and int(fields[2]) == group:
            pids.append(pid)
    return pids


def server_processes(server_pid: int) -> list[int]:
    """Processes below ``server_pid`` that are still in its process group (stubs, rank workers).

    Both conditions: a process that left the group, or one in the group but not below the
    server, is not the server's to find or signal.
    """
    group = pgid(server_pid)
    if group is None:
        return []
    out = []
    for pid in descendants(server_pid):
        fields = _stat(pid)
        if fields and fields[0] != "Z" and int(fields[2]) == group:  # a zombie is already gone
            out.append(pid)
    return out


def stub_instance(argv: list[str]) -> str | None:
    """Instance name (``<model>_<group>_<index>``) a Python stub's argv runs, else None."""
    if len(argv) >= 9 and Path(argv[0]).name == STUB_NAME:
        return argv[8]  # argv: stub, model.py, shm name, sizes x2, parent pid, lib dir, ipc key, instance
    return None


def model_stubs(server_pid: int, model: str) -> list[int]:
    """Stub pids of ``model``'s instances started by this server (children of it, in its group).

    The stub's command line must name both the instance (``<model>_<g>_<i>``) and the model's
    ``<model>/<version>/model.py``.
    """
    out = []
    for pid in server_processes(server_pid):
        argv = cmdline(pid)
        instance = stub_instance(argv)
        if instance is None or ppid(pid) != server_pid or instance.rsplit("_", 2)[0] != model:
            continue
        if Path(argv[1]).name == "model.py" and Path(argv[1]).parts[-3:-2] == (model,):
            out.append(pid)
    return sorted(out)


def spawned_children(parent: int, server_pid: int) -> list[int]:
    """Children of ``parent`` started with multiprocessing's "spawn" (rank workers of a stub),
    limited to ``server_pid``'s processes."""
    own = set(server_processes(server_pid))
    return sorted(pid for pid in own if ppid(pid) == parent and any(SPAWN_MARKER in a for a in cmdline(pid)))


# glibc's mallopt parameters and values close to its defaults (64-bit): the server's environment
# tunes malloc to return large freed buffers at once, which suits tritonserver's request buffers
# but costs the denoising loop a page fault per large tensor (20-45% per step, measured).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -2, -3, -8
_MALLOC_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX")


def restore_malloc_defaults() -> None:
    """Undo the server's malloc tuning in a compute process (a model stub), and keep it from
    the processes this one starts (rank workers read the environment at their start)."""
    tuned = [name for name in _MALLOC_VARS if os.environ.pop(name, None) is not None]
    if not tuned:
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc: the variables meant nothing here
        return
    for param, value in ((_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 64 << 20), (_M_TOP_PAD, 128 << 10),
                         (_M_ARENA_MAX, 8 * (os.cpu_count() or 1))):
        mallopt(param, value)


def server_option(argv: list[str], name: str) -> str | None:
    """The value of ``--name=value`` or ``--name value`` in a tritonserver argv (the last one wins)."""
    value = None
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{name}="):
            value = arg.split("=", 1)[1]
        elif arg == f"--{name}" and i + 1 < len(argv):
            value = argv[i + 1]
    return value


def own_server_grpc_url(stub_pid: int | None = None) -> str | None:
    """Where a stub reaches its own tritonserver over gRPC, read from the server's argv.

    None when gRPC is turned off. A wildcard address is dialled over loopback.
    """
    server = ppid(os.getpid() if stub_pid is None else stub_pid)
    argv = cmdline(server) if server else []
    if not argv or (server_option(argv, "allow-grpc") or "true").lower() in ("false", "0"):
        return None
    host = server_option(argv, "grpc-address") or "0.0.0.0"
    host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    return f"{host}:{server_option(argv, 'grpc-port') or '8001'}"
