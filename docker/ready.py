"""Readiness of a NeoPP replica: every model it must serve ($NEOPP_MODELS) answers ready.

Triton's own readiness says the server is up; a replica is ready for its clients only when each
model it was started with can serve now. The door answers from what the launcher knows: a model
whose stub is dead, stopped, hung or being reloaded, or a server restarting, is not ready.
Exit 0 when ready, else 1 with one line naming the first model that is not.
    python3 docker/ready.py        (the container's health check and Kubernetes readiness probe)
"""

from __future__ import annotations

import os
import urllib.request


def main() -> int:
    port = os.environ.get("NEOPP_HTTP_PORT", "8000")
    for model in os.environ.get("NEOPP_MODELS", "neopp_dense neopp_session").split():
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/{model}/ready", timeout=3):
                pass
        except OSError as exc:
            print(f"{model}: not ready ({exc})")
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
