"""Client documents parsed away from the door's event loop.

Python's JSON reader holds the interpreter lock for the whole of a document (measured here: a
9 MB object of 450k keys, 0.3-0.9 s; a 128 MiB string, 0.6 s plus 0.2 s to decode the bytes), so a
thread alone would still stop every other connection while it runs. Small documents (at most
INLINE_BYTES, a few milliseconds) are parsed on a thread of the door; larger ones in worker
processes, where only the bytes in and the checked request out cross the door's interpreter.
A worker that dies is replaced; its request gets 503 with Retry-After. What crosses back is the
request the worker built from checked values (bytes and the door's own types), never a
client's bytes to be parsed again.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import signal
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from tritonclient.grpc import service_pb2 as pb

from . import generate_json, kserve_infer, openai_images, strict_json
from .bounds import KiB
from .door_error import DoorError
from .spliced_request import WireRequest

INLINE_BYTES = 64 * KiB
T = TypeVar("T")


def infer_header(header: bytes, model: str, version: str, max_values: int) -> kserve_infer.InferHeader:
    return kserve_infer.parse_header(header, model, version, max_values)


def generate_request(body: bytes, model: str, version: str, metadata: bytes, stream: bool,
                     max_values: int) -> WireRequest:
    return generate_json.parse_generate(body, model, version, pb.ModelMetadataResponse.FromString(metadata), stream,
                                   max_values)


def images_request(body: bytes, max_values: int) -> tuple[openai_images.ImagesRequest, bool]:
    return openai_images.parse_images_body(body, max_values)


def control_body(body: bytes, max_values: int) -> tuple[bytes, Any]:
    """A control route's body re-serialised from its parsed form, and its "key" field (what a
    shared-memory registration maps) when it has one."""
    if not body.strip():
        return b"", None
    strict_json.count_values(body, max_values, "request body")
    doc = strict_json.loads(body, "request body")
    return strict_json.dumps(doc), doc.get("key") if isinstance(doc, dict) else None


def _ready() -> bool:
    return True


def _worker_setup() -> None:
    """A worker leaves Ctrl-C to the launcher, which stops it (a terminal signals the whole group)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class Parser:
    """A thread for small documents, ``workers`` processes for large ones (0: threads only)."""

    def __init__(self, workers: int = 2) -> None:
        self.workers = workers
        self._threads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="neopp-door-parse")
        self._pool: ProcessPoolExecutor | None = None

    def start(self) -> None:
        """Start the workers now (a first large request would otherwise wait for them)."""
        if self.workers:
            pool = self._processes()
            for _ in range(self.workers):
                pool.submit(_ready)

    def _processes(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_worker_setup)
        return self._pool

    async def run(self, size: int, job: Callable[..., T], *args: Any) -> T:
        """``job(*args)`` on a thread (``size`` bytes at most INLINE_BYTES) or in a worker."""
        loop = asyncio.get_running_loop()
        if size <= INLINE_BYTES or not self.workers:
            return await loop.run_in_executor(self._threads, job, *args)
        pool = self._processes()
        try:
            return await loop.run_in_executor(pool, job, *args)
        except BrokenProcessPool:
            if self._pool is pool:
                self._pool = None
                pool.shutdown(wait=False, cancel_futures=True)
            raise DoorError(503, "the request parser stopped while reading this request; retry shortly",
                            reason="parser", headers={"Retry-After": "1"}) from None

    async def thread(self, job: Callable[..., T], *args: Any) -> T:
        """Python-level work on the door's checked values, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._threads, job, *args)

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
