"""Liveness of a NeoPP replica: the launcher marked itself alive recently.

The launcher (``--alive-file``) touches a file every 5 s while its HTTP door's event loop answers.
This probe reads the file's age and never connects to the door, so a door whose connections are
all taken (idle clients, a flood) does not get a healthy replica restarted; a launcher that is
gone or stuck does. Readiness is another question (docker/ready.py).
Exit 0 when alive, else 1 with one line saying why.
    python3 docker/live.py        (the Kubernetes startup and liveness probe)
"""

from __future__ import annotations

import os
import sys
import time


def main() -> int:
    path = os.environ.get("NEOPP_ALIVE_FILE") or os.path.join(os.environ.get("NEOPP_STATE_DIR", "/var/lib/neopp"),
                                                              "alive")
    limit = float(os.environ.get("NEOPP_ALIVE_MAX_AGE_S", "60"))
    try:
        age = time.time() - os.stat(path).st_mtime
    except OSError as exc:
        print(f"not alive: {path}: {exc.strerror}")
        return 1
    if age > limit:
        print(f"not alive: {path} last touched {age:.0f}s ago (limit {limit:.0f}s)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
