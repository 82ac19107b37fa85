"""Reading /proc: the processes a server runs (stubs, rank workers) and their memory."""

from __future__ import annotations

from pathlib import Path


def cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


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


def process_group_members(pgid: int) -> list[int]:
    """Live pids in process group ``pgid`` (the server's stubs inherit its group)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # fields after "(comm)": state, ppid, pgrp, ...; zombies are already gone for our purpose
        if fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(int(entry.name))
    return pids
