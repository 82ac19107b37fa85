"""What `make serve` costs in memory and processes, per profile, on the demo checkpoint.

Each profile's models are read from make's own dry run (`make -n serve PROFILE=...`), so the
figures are of the lists the Makefile serves. The launcher serves them on free ports; once it is
ready and idle, every process below it (the launcher, its workers, tritonserver and its stubs,
the parallel modes' ranks) is counted, with its resident memory (RSS, shared pages counted in
each process) and its proportional share (PSS, shared pages split between the processes that
map them: the sum is what the tree takes from the machine).

    python -m bench.serve_memory [--out bench]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO, section_main
from neopp.ports import free_ports
from testing.launched import READY, run_launcher

PROFILES = ("small", "full")
MiB = 1024 * 1024


def profile_models(profile: str) -> list[str]:
    done = subprocess.run(["make", "-n", "serve", f"PROFILE={profile}", "STAMP=Makefile"], cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=True)
    return re.findall(r"--load-model=(\w+)", done.stdout)


def descendants(root: int) -> list[int]:
    """``root`` and every process below it, from each process's parent in /proc."""
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(stat.parent.name)] = int(fields[1])
    found, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, ppid in parent.items() if ppid in frontier]
        found += frontier
    return found


def memory(pid: int) -> tuple[int, int]:
    """(RSS, PSS) in bytes, from smaps_rollup; (0, 0) for a process that ended meanwhile."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0, 0
    kb = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(Rss|Pss):\s+(\d+) kB", text, re.MULTILINE)}
    return kb.get("Rss", 0) * 1024, kb.get("Pss", 0) * 1024


def measure(profile: str, log: Path) -> tuple[int, int, int, float]:
    """(processes, RSS, PSS, seconds to ready) of the tree serving ``profile``."""
    http, grpc, metrics = free_ports(3)
    cmd = [sys.executable, "-m", "neopp.launcher", "serve", "--http-port", str(http), "--grpc-port", str(grpc),
           "--metrics-port", str(metrics), "--", "--model-control-mode=explicit",
           *(f"--load-model={m}" for m in profile_models(profile))]
    demo = REPO / "demo" / "checkpoints"
    env = {"NEOPP_CHECKPOINT": str(demo / "dense"), "NEOPP_CHECKPOINT_NEOPP_MOE": str(demo / "moe"),
           "NEOPP_CHECKPOINT_NEOPP_MOE_CFG": str(demo / "moe"), "NEOPP_LORA_DIR": str(demo / "lora")}
    start = time.monotonic()
    handle = run_launcher(cmd, log, env, http, grpc, metrics)
    try:
        handle.wait_for(READY, timeout=600)
        ready = time.monotonic() - start
        time.sleep(5)  # idle: the warm-up steps done, nothing in flight
        pids = descendants(handle.proc.pid)
        sizes = [memory(pid) for pid in pids]
    finally:
        handle.stop()
    return len(pids), sum(r for r, _ in sizes), sum(p for _, p in sizes), ready


def body(args: argparse.Namespace) -> str:
    lines = ["Each profile served by the launcher on the demo checkpoint, idle after it is ready; every process "
             "below the launcher counted.", "",
             "| profile | models | processes | RSS GiB (shared pages in each) | PSS GiB (the machine's share) | "
             "ready after s |", "|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for profile in PROFILES:
            count, rss, pss, ready = measure(profile, Path(tmp) / f"{profile}.log")
            lines.append(f"| {profile} | {' '.join(profile_models(profile))} | {count} | {rss / 1024 / MiB:.2f} | "
                         f"{pss / 1024 / MiB:.2f} | {ready:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    section_main(argv, __doc__, "serve_memory.md", "What each serving profile costs", body)


if __name__ == "__main__":
    main()
