"""One system shared-memory region through which the door hands large tensors to Triton.

Over gRPC a 44 MB KV is copied into the message, sent, and parsed again by Triton; through a
region registered with Triton it is written once, as it arrives from the client, and Triton
reads it in place. The region is the door's own: 0600, its file named after its owner (so that
the next door removes it if the owner was killed), removed at stop. Triton knows it by another
name, 128 random bits that appear nowhere a client can read (not in /dev/shm, not in an error
the door passes on), so no request can name it, over gRPC either. Slices are lent to one request
each and given back when Triton has answered.
"""

from __future__ import annotations

import mmap
import os
import secrets
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..shm_regions import SHM_DIR, owner_tag, remove_orphans
from .bounds import BYTE_COUNT
from .door_error import DoorError

PREFIX = "neopp_door_"  # then the owner and 64 random bits
ALIGN = 64


@dataclass(frozen=True)
class Slice:
    """``size`` bytes at ``offset`` of the region, and a writable view of them."""

    offset: int
    size: int
    view: memoryview


class ShmArena:
    """A region of ``size`` bytes with a first-fit allocator; ``None`` when a slice does not fit."""

    def __init__(self, size: int, directory: Path = SHM_DIR) -> None:
        remove_orphans((PREFIX,), directory)
        self.name = f"{PREFIX}{owner_tag()}_{secrets.token_hex(8)}"
        self.path = directory / self.name
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.size = size
        self._view = memoryview(self._map)
        self._free: list[tuple[int, int]] = [(0, size)]  # (offset, size), sorted, never adjacent
        self._lock = threading.Lock()

    @property
    def key(self) -> str:
        """The name Triton opens it by (shm_open)."""
        return "/" + self.name

    def _take(self, size: int) -> int | None:
        size = -(-size // ALIGN) * ALIGN
        with self._lock:
            for i, (offset, free) in enumerate(self._free):
                if free >= size:
                    self._free[i:i + 1] = [(offset + size, free - size)] if free > size else []
                    return offset
        return None

    def _give(self, offset: int, size: int) -> None:
        size = -(-size // ALIGN) * ALIGN
        with self._lock:
            spans = sorted([*self._free, (offset, size)])
            merged: list[tuple[int, int]] = []
            for start, length in spans:
                if merged and merged[-1][0] + merged[-1][1] == start:
                    merged[-1] = (merged[-1][0], merged[-1][1] + length)
                else:
                    merged.append((start, length))
            self._free = merged

    @contextmanager
    def lend(self, size: int) -> Iterator[Slice | None]:
        """A slice for the duration of a request (None: the region is full right now)."""
        offset = self._take(size) if 0 < size <= self.size else None
        if offset is None:
            yield None
            return
        try:
            yield Slice(offset, size, self._view[offset:offset + size])
        finally:
            self._give(offset, size)

    def free_bytes(self) -> int:
        with self._lock:
            return sum(size for _, size in self._free)

    def close(self) -> None:
        try:
            self._view.release()
            self._map.close()
        except BufferError:  # a slice still lent out: the mapping goes with the process
            pass
        self.path.unlink(missing_ok=True)


class TensorRegion:
    """The arena as Triton knows it: registered at first use, and again after a server restart.

    Registration needs the operator key where the server restricts its shared-memory API. Where
    it fails, the door says so once and sends tensors inside the gRPC request instead.
    """

    def __init__(self, arena: ShmArena | None, register: Callable[[str, str, int], Awaitable[None]],
                 min_bytes: int, max_header: int, log: Callable[[str], None]) -> None:
        self.arena, self.register, self.log = arena, register, log
        self.min_bytes, self.max_header = min_bytes, max_header
        self.registered = False
        self.name = f"door-{secrets.token_hex(16)}" if arena else ""  # what Triton knows it by: secret

    def scrubbed(self, error: DoorError) -> DoorError:
        """``error`` without the region's name, before a client reads it."""
        if self.name and self.name in error.message:
            error.message = error.message.replace(self.name, "<the door's tensor region>")
        return error

    def wants(self, headers: Any) -> int:
        """Bytes a plain binary request would put in the region (0: it goes in the message)."""
        if self.arena is None or "content-encoding" in headers or "transfer-encoding" in headers:
            return 0
        length, header = headers.get("content-length", ""), headers.get("inference-header-content-length", "")
        if not (BYTE_COUNT.match(length) and BYTE_COUNT.match(header)
                and 0 < int(header) <= min(int(length), self.max_header)):
            return 0
        tail = int(length) - int(header)
        return tail if tail >= self.min_bytes else 0

    async def ensure(self) -> bool:
        if self.arena is not None and not self.registered:
            try:
                await self.register(self.name, self.arena.key, self.arena.size)
                self.registered = True
            except Exception as exc:  # noqa: BLE001 - the region is an optimisation; say why it is off
                if "already in manager" in str(exc):  # another request registered it first
                    self.registered = True
                    return True
                self.log(f"neopp front: shared-memory region for tensors not registered "
                         f"({str(exc).replace(self.name, '<region>')}); tensors travel inside gRPC requests")
                self.arena.close()
                self.arena = None
        return self.arena is not None

    def lost(self, message: str) -> bool:
        """True when Triton no longer knows the region (it restarted): register it again."""
        if self.arena is not None and "Unable to find" in message and f"'{self.name}'" in message:
            self.registered = False
            return True
        return False

    @asynccontextmanager
    async def slot(self, headers: Any) -> AsyncIterator[Slice | None]:
        size = self.wants(headers)
        if not size or not await self.ensure():
            yield None
            return
        with self.arena.lend(size) as piece:
            yield piece

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()
