"""The launcher's allocator: a large buffer goes back to the system as soon as it is freed.

Why: the gRPC front and the door hold a request's bytes several times over (received, parsed,
sent on). glibc raises its threshold for mapping a buffer of its own after the first large one is
freed, then serves such buffers from its per-thread arenas, which a run of large requests
fragments for good: an attack pass saw the launcher grow to 11 GB over 670 requests of 16 MiB
that were all refused. A fixed threshold keeps each large buffer mapped on its own, so freeing it
returns it.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
LARGE = 1 << 20  # bytes from which a buffer is mapped on its own


def return_large_buffers(threshold: int = LARGE) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` in this process; False where the C library has
    no ``mallopt`` (not glibc) or refuses."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, threshold) == 1
