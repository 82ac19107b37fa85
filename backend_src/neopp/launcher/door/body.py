"""Reading a request body under the door's bounds.

* Content-Length is required (chunked uploads are refused) and at most the route's cap.
* Bodies are held against one budget shared by all requests in flight, and against their
  client's share of it: a body whose declared size does not fit now is answered 503 with
  Retry-After before a byte is read; a body holds what has arrived of it (inflated), so an
  upload that has sent little holds little, and one that outgrows the room left is a 503 then.
* An upload must keep up a minimum average rate; one that falls more than ``read_timeout_s``
  behind it (a pause, or a trickle) is answered 408 and its bytes are dropped.
* ``Content-Encoding: gzip`` or ``deflate`` is inflated as it arrives, a bounded piece at a time
  (the event loop is never held by one large inflation), never past the cap; one stream, nothing after it.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

from .bounds import BYTE_COUNT, DoorLimits, KiB, MiB, RouteCap
from .door_error import DoorError
from .strict_json import ValueCounter

DRAIN_LIMIT = 1 << 30  # a refused body up to this size is read and dropped; a larger one is cut off
INFLATE_STEP = MiB  # inflated bytes per step between two turns of the event loop


class ByteBudget:
    """Bytes reserved by bodies in flight, all clients and each; a reservation that does not fit
    is refused, not queued. The HTTP door and the gRPC front reserve in one budget, each from its
    own thread."""

    def __init__(self, total: int, per_client: int | None = None) -> None:
        self.total, self.per_client, self.used = total, per_client or total, 0
        self.held: dict[str, int] = {}
        self._lock = threading.Lock()

    def check_size(self, size: int) -> None:
        """A 413 for a body that could never fit, however long its client waited."""
        bound, whose = min((self.total, "all requests at once"), (self.per_client, "one client"))
        if size > bound:
            raise DoorError(413, f"a body of {size} bytes is over the {bound} bytes the server holds for {whose}",
                            reason="too_large")

    def room(self, size: int, client: str = "") -> None:
        """A 503 unless ``size`` more bytes of ``client`` fit now."""
        held = self.held.get(client, 0)
        if self.used + size > self.total:
            raise DoorError(503, f"the server is holding {self.used} bytes of request bodies; a body of "
                            f"{size} bytes does not fit now (limit {self.total}); retry shortly",
                            reason="bodies_in_flight", headers={"Retry-After": "1"})
        if held + size > self.per_client:
            raise DoorError(503, f"this client already sends {held} bytes of request bodies; a body of {size} bytes "
                            f"does not fit in its share ({self.per_client}); retry when one is done",
                            reason="client_bodies", headers={"Retry-After": "1"})

    def reserve(self, size: int, client: str = "") -> None:
        with self._lock:
            self.room(size, client)
            self.used += size
            self.held[client] = self.held.get(client, 0) + size

    def release(self, size: int, client: str = "") -> None:
        with self._lock:
            self.used -= size
            left = self.held.get(client, 0) - size
            if left > 0:
                self.held[client] = left
            else:
                self.held.pop(client, None)


class _Inflater:
    """Incremental gzip/deflate decoding with a hard output bound, a bounded step at a time."""

    def __init__(self, encoding: str, limit: int) -> None:
        wbits = 31 if encoding == "gzip" else 15  # deflate: the zlib format, as HTTP means it
        self.decoder, self.limit, self.size, self.encoding = zlib.decompressobj(wbits), limit, 0, encoding

    @property
    def pending(self) -> bool:
        """Input is left that the last step did not inflate."""
        return bool(self.decoder.unconsumed_tail)

    def feed(self, data: bytes) -> bytes:
        """At most INFLATE_STEP bytes of output; call again with b"" while ``pending``."""
        try:
            out = self.decoder.decompress(self.decoder.unconsumed_tail + data,
                                          min(INFLATE_STEP, self.limit - self.size + 1))
        except zlib.error as exc:
            raise DoorError(400, f"the body is not valid {self.encoding}: {exc}") from None
        self.size += len(out)
        if self.size > self.limit:
            raise DoorError(413, f"the body inflates to more than the {self.limit} byte limit", reason="too_large")
        if self.decoder.unused_data:
            raise DoorError(400, f"the body has bytes after the end of its {self.encoding} stream")
        return out

    def finish(self) -> None:
        if not self.decoder.eof:
            raise DoorError(400, f"the {self.encoding} body is truncated")


def declared_length(headers: Any, cap: RouteCap) -> int:
    """The body's Content-Length, checked against the route's cap before anything is read."""
    if "transfer-encoding" in headers:
        raise DoorError(411, "chunked bodies are not accepted; send Content-Length", reason="chunked")
    text = headers.get("content-length", "0")
    if not BYTE_COUNT.match(text):
        raise DoorError(400, "Content-Length must be a decimal byte count")
    length = int(text)
    if length > cap.body:
        raise DoorError(413, f"a body of {length} bytes is over the {cap.body} byte limit of {cap.name} requests",
                        reason="too_large")
    return length


def content_coding(headers: Any) -> str | None:
    coding = headers.get("content-encoding", "identity").strip().lower()
    if coding in ("", "identity"):
        return None
    if coding not in ("gzip", "deflate"):
        raise DoorError(415, f"Content-Encoding '{coding[:32]}' is not supported; use gzip, deflate or none",
                        reason="encoding")
    return coding


def _place(chunk: bytes, at: int, head: bytearray, head_size: int, tail: memoryview | None) -> None:
    """Append ``chunk`` (body bytes from ``at``) to ``head`` up to ``head_size``, the rest into ``tail``."""
    cut = max(0, min(len(chunk), head_size - at))
    if cut:
        head += chunk[:cut]
    if cut < len(chunk):
        start = at + cut - head_size
        tail[start:start + len(chunk) - cut] = chunk[cut:]


def drainer(receive: Callable[[], Awaitable[dict]], headers: Any,
            limits: DoorLimits) -> Callable[[], Awaitable[None]] | None:
    """For a request refused before its body was read: what reads the body to its end once the
    answer is out (as ``BodyReader`` does for its refusals); None when it has none."""
    text = headers.get("content-length", "0")
    if "transfer-encoding" in headers or not BYTE_COUNT.match(text) or int(text) == 0:
        return None
    return functools.partial(BodyReader(ByteBudget(0), limits)._drain, receive, headers)


class BodyReader:
    """Reads one body of ``client``; holds its share of the budget until the request is done
    (``async with``)."""

    def __init__(self, budget: ByteBudget, limits: DoorLimits, client: str = "",
                 cap: RouteCap | None = None) -> None:
        self.budget, self.limits, self.client, self.reserved = budget, limits, client, 0
        self.cap = cap or limits.cap("inference")
        self.start, self.got, self.more = time.monotonic(), 0, True
        self.values: ValueCounter | None = None

    def _hold(self, size: int) -> None:
        self.budget.check_size(size)
        if size > self.reserved:
            self.budget.reserve(size - self.reserved, self.client)
            self.reserved = size

    async def read(self, receive: Callable[[], Awaitable[dict]], headers: Any, tail: memoryview | None = None,
                   values: ValueCounter | None = None) -> bytes | bytearray:
        """The whole body (inflated), read chunk by chunk at the minimum rate; ``values`` counts
        the JSON values of its JSON part as it arrives.

        A body refused for its size is, once the answer is out, read to its end and dropped (up to
        DRAIN_LIMIT bytes, none of them held: ``DoorError.after``), so that a client still sending
        it reads the answer instead of a connection reset.
        ``tail`` (a plain body only): where the body's last ``len(tail)`` bytes go; the rest is returned.
        """
        self.values = values
        try:
            return await self._read(receive, headers, tail)
        except DoorError as exc:
            if exc.status in (413, 503) and self.more:
                exc.after = functools.partial(self._drain, receive, headers)
            raise

    async def _read(self, receive: Callable[[], Awaitable[dict]], headers: Any,
                    tail: memoryview | None) -> bytes | bytearray:
        length, coding = declared_length(headers, self.cap), content_coding(headers)
        self.budget.check_size(length)
        self.budget.room(length, self.client)
        inflater = _Inflater(coding, self.cap.body) if coding else None
        if tail is not None and (inflater or len(tail) > length):
            raise ValueError("a tail is for a plain body that holds it")
        head = length - (len(tail) if tail is not None else 0)
        # a plain body lands where it belongs as it arrives (the tail straight into its region)
        whole, parts = (None, []) if inflater else (bytearray(), None)
        while self.more:
            message = await self._next(receive)
            chunk = message.get("body", b"")
            self.more = message.get("more_body", False)
            if self.got + len(chunk) > length:
                raise DoorError(400, "the body is longer than its Content-Length")
            if inflater and chunk:
                await self._inflate(inflater, chunk, parts)
            elif chunk:
                self._hold(self.got + len(chunk))
                if self.values is not None:
                    self.values.feed(chunk, self.got)
                _place(chunk, self.got, whole, head, tail)
            self.got += len(chunk)
        if self.got != length:
            raise DoorError(400, f"the body ended after {self.got} of {length} bytes")
        if inflater:
            inflater.finish()
            return b"".join(parts)
        return whole

    async def _inflate(self, inflater: _Inflater, chunk: bytes, parts: list[bytes]) -> None:
        self._inflated(inflater.feed(chunk), inflater, parts)
        while inflater.pending:
            await asyncio.sleep(0)  # others' turn between two steps
            self._inflated(inflater.feed(b""), inflater, parts)

    def _inflated(self, data: bytes, inflater: _Inflater, parts: list[bytes]) -> None:
        self._hold(inflater.size)
        if self.values is not None:
            self.values.feed(data, inflater.size - len(data))
        parts.append(data)

    async def _drain(self, receive: Callable[[], Awaitable[dict]], headers: Any) -> None:
        text = headers.get("content-length", "0")
        if "transfer-encoding" in headers or not BYTE_COUNT.match(text) or int(text) > DRAIN_LIMIT:
            return  # the connection is closed after the answer
        try:
            while self.more:
                message = await self._next(receive)
                self.more = message.get("more_body", False)
                self.got += len(message.get("body", b""))
        except DoorError:
            pass

    async def _next(self, receive: Callable[[], Awaitable[dict]]) -> dict:
        """The next piece of the body, if it comes before the upload falls behind the minimum rate."""
        rate, grace = self.limits.min_upload_rate, self.limits.read_timeout_s
        wait = self.start + grace + self.got / rate - time.monotonic()
        try:
            if wait <= 0:
                raise asyncio.TimeoutError
            message = await asyncio.wait_for(receive(), wait)
        except asyncio.TimeoutError:
            elapsed = time.monotonic() - self.start
            raise DoorError(408, f"the upload fell {grace:g}s behind the minimum rate of {rate / KiB:g} KiB/s "
                            f"({self.got} bytes in {elapsed:.1f}s); the request is dropped",
                            reason="read_timeout", headers={"Connection": "close"}) from None
        if message["type"] == "http.disconnect":
            raise DoorError(499, "the client closed the connection", reason="client_gone")
        return message

    async def __aenter__(self) -> BodyReader:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.budget.release(self.reserved, self.client)
        self.reserved = 0
