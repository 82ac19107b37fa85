"""Run a command as the container's security context would: read-only root, no capability.

No container engine runs on the development machines, so the test of the container's entry point
gets the same constraints from the kernel directly: a private mount namespace in which ``/`` is
read-only (``/tmp`` and ``/dev/shm`` stay writable, as the volumes of the Kubernetes pod are), every
capability dropped (bounding and inheritable sets, so nothing regains one at exec) and no new
privileges. This needs root to set up (``unshare --mount``); ``prefix`` says why when it cannot.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

SETUP = ("mount --bind /tmp /tmp && mount -o remount,bind,ro / && "
         'exec setpriv --no-new-privs --inh-caps=-all --bounding-set=-all -- "$@"')


def prefix() -> tuple[list[str] | None, str]:
    """The command prefix, or None and the reason it is not available here."""
    if os.geteuid() != 0:
        return None, "setting up a read-only root needs root (unshare --mount)"
    missing = [tool for tool in ("unshare", "setpriv", "mount") if shutil.which(tool) is None]
    if missing:
        return None, f"not installed: {missing}"
    cmd = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", SETUP, "sh"]
    probe = subprocess.run([*cmd, "sh", "-c", "touch /contained-probe"], capture_output=True, text=True, timeout=30)
    if probe.returncode == 0 or "Read-only file system" not in probe.stderr:
        Path("/contained-probe").unlink(missing_ok=True)
        return None, f"the kernel refused the setup: {probe.stderr.strip()[:200]}"
    return cmd, ""


def capabilities(pid: int) -> int:
    """The effective capability set of ``pid``."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^CapEff:\s*([0-9a-f]+)$", status, re.MULTILINE).group(1), 16)


def root_read_only(pid: int) -> bool:
    """Whether ``/`` is mounted read-only as ``pid`` sees it."""
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == "/":
            return "ro" in fields[5].split(",")
    return False
