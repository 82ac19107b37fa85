"""The ``serve`` launcher run as an operator runs it: a subprocess on free loopback ports.

Its servers are found from the launcher's own output (it prints each tritonserver's pid), never
by looking for process names on the machine.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from neopp.ports import free_ports
from neopp.procs import process_group_members
from testing import REPO

READY = "NeoPP Triton server ready"
SERVER_LINE = re.compile(r"tritonserver pid (\d+), own HTTP on (\S+) .*?prefix (\S+)")


@dataclass
class Launched:
    """A running launcher, its output file and its ports."""

    proc: subprocess.Popen
    log: Path
    http_port: int
    grpc_port: int
    metrics_port: int | None = None

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def servers(self) -> list[tuple[int, str, str]]:
        """(pid, Triton's own HTTP address, shm prefix) of every server this launcher started."""
        return [(int(pid), address, prefix) for pid, address, prefix in SERVER_LINE.findall(self.text())]

    def server_pids(self) -> list[int]:
        return [pid for pid, _, _ in self.servers()]

    @property
    def server_pid(self) -> int:
        """The server running now (the last one started)."""
        return self.servers()[-1][0]

    def wait_for(self, pattern: str, count: int = 1, timeout: float = 300.0) -> None:
        """Until ``pattern`` shows ``count`` times in the output; fails if the launcher exits first."""
        deadline = time.monotonic() + timeout
        while len(re.findall(pattern, self.text())) < count:
            assert self.proc.poll() is None, f"launcher exited {self.proc.returncode}:\n{self.text()[-4000:]}"
            assert time.monotonic() < deadline, f"no {pattern!r} x{count} after {timeout}s:\n{self.text()[-4000:]}"
            time.sleep(0.25)

    def stop(self, timeout: float = 90.0) -> int:
        """SIGTERM, a bounded wait, then SIGKILL; the launcher's exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode

    def leftovers(self) -> dict[int, list[int]]:
        """Processes still alive in the group of each server this launcher started."""
        return {pid: members for pid in self.server_pids() if (members := process_group_members(pid))}


def launch(log: Path, env: dict[str, str], models: Sequence[str], max_restarts: int = 0,
           launcher_args: Sequence[str] = ()) -> Launched:
    """The real launcher, explicit model control, an exit timeout a model of several instances
    unloads within (Triton stops its stubs one by one); ``env`` adds to ours."""
    http_port, grpc_port, metrics_port = free_ports(3)
    cmd = [sys.executable, "-m", "neopp.launcher", "serve", "--http-port", str(http_port),
           "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port), "--max-restarts", str(max_restarts),
           *launcher_args, "--", "--model-control-mode=explicit", "--exit-timeout-secs=15",
           *(f"--load-model={m}" for m in models)]
    return run_launcher(cmd, log, env, http_port, grpc_port, metrics_port)


def run_launcher(cmd: Sequence[str], log: Path, env: dict[str, str], http_port: int, grpc_port: int,
                 metrics_port: int | None = None) -> Launched:
    """``cmd`` (a launcher, or a script that execs one) from the repository root, its output in ``log``."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("NEOPP_CHECKPOINT", "NEOPP_LORA_DIR"))}
    full.update(PYTHONUNBUFFERED="1", **env)
    with open(log, "wb") as out:
        proc = subprocess.Popen(list(cmd), env=full, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                start_new_session=True)
    return Launched(proc, log, http_port, grpc_port, metrics_port)


@contextmanager
def serving(log: Path, env: dict[str, str], models: Sequence[str], max_restarts: int = 0,
            launcher_args: Sequence[str] = (), no_traceback: bool = False) -> Iterator[Launched]:
    """A launcher serving ``models`` for the block (as ``launch``); then stopped with exit code 0
    and no process left in any of its servers' groups. ``no_traceback``: and no request printed one."""
    handle = launch(log, env, models, max_restarts, launcher_args)
    try:
        handle.wait_for(READY)
        yield handle
        assert not no_traceback or "Traceback" not in handle.text(), \
            "a request printed a traceback:\n" + handle.text()[-4000:]
    finally:
        assert handle.stop() == 0, handle.text()[-4000:]
        assert not handle.leftovers(), f"the launcher left processes behind: {handle.leftovers()}"
