"""The Python backend's shared-memory regions of one server, named so they can be found again.

Every model instance's stub shares a region in ``/dev/shm`` with tritonserver. A stub or server
killed hard leaves its region behind (1 MiB or as large as it grew). Each server we start gets
its own region prefix, so the launcher removes exactly that server's regions when it stops or
restarts it, and never another server's.
"""

from __future__ import annotations

import secrets
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PREFIX_HEAD = "neopp_shm_"
# The first size is allocated in /dev/shm for every instance at load, so it stays small (small
# inputs and one encoded image fit). A realistic request, two KV prefixes of 36 layers x 2 x 300
# tokens x 8 heads x 128 x 2 bytes (about 44 MB each), grows it in 6 steps of 16 MiB; the HTTP
# front's 128 MiB body limit bounds what one HTTP request can make it grow to.
DEFAULT_REGION_BYTES = 8 * 1024 * 1024
GROWTH_BYTES = 16 * 1024 * 1024


def new_prefix() -> str:
    """Fixed-length random prefix: two servers' prefixes never match each other's regions."""
    return f"{PREFIX_HEAD}{secrets.token_hex(8)}_"


def backend_args(prefix: str, default_bytes: int | None = None, growth_bytes: int | None = None) -> list[str]:
    """tritonserver flags for the Python backend: region prefix, and first size / growth step if given."""
    args = [f"--backend-config=python,shm-region-prefix-name={prefix}"]
    if default_bytes:
        args.append(f"--backend-config=python,shm-default-byte-size={default_bytes}")
    if growth_bytes:
        args.append(f"--backend-config=python,shm-growth-byte-size={growth_bytes}")
    return args


def regions(prefix: str, shm_dir: Path = SHM_DIR) -> list[Path]:
    """Region files of the server with ``prefix`` that exist now."""
    if not prefix.startswith(PREFIX_HEAD) or not shm_dir.is_dir():
        return []
    return sorted(p for p in shm_dir.iterdir() if p.name.startswith(prefix))


def remove_regions(prefix: str, shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink the server's regions (call only once its processes are gone); returns their names."""
    removed = []
    for path in regions(prefix, shm_dir):
        try:
            path.unlink()
            removed.append(path.name)
        except FileNotFoundError:
            continue
    return removed
