"""Reading a request body under the door's bounds.

* Content-Length is required (chunked uploads are refused) and at most ``max_body`` bytes.
* Every body reserves its declared size from one budget shared by all requests in flight
  before a byte is read: a full budget answers 503 with Retry-After at once.
* A sender that goes quiet for ``read_timeout_s`` between chunks is answered 408 and its
  bytes are dropped.
* ``Content-Encoding: gzip`` or ``deflate`` is inflated as it arrives, never past ``max_body``.
"""

from __future__ import annotations

import asyncio
import functools
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from .errors import DoorError

MiB = 1 << 20
DRAIN_LIMIT = 1 << 30  # a refused body up to this size is read and dropped; a larger one is cut off


@dataclass(frozen=True)
class DoorLimits:
    """The door's bounds; defaults fit one 8B request's two KV prefixes (~88 MB) with room."""

    max_body: int = 128 * MiB  # a body after decompression
    max_json_bytes: int = 16 * MiB  # the JSON header of an infer request
    max_json_values: int = 1_000_000  # values in a JSON body: ~50 MB once parsed
    bodies_in_flight: int = 384 * MiB  # all bodies being read or held at once
    read_timeout_s: float = 30.0  # the longest pause between two chunks of a body
    max_connections: int = 256  # beyond it uvicorn answers 503
    region_min_bytes: int = MiB  # binary parts this large go through the tensor region; 0: never


class ByteBudget:
    """Bytes reserved by bodies in flight; a reservation that does not fit is refused, not queued."""

    def __init__(self, total: int) -> None:
        self.total, self.used = total, 0

    def reserve(self, size: int) -> None:
        if self.used + size > self.total:
            raise DoorError(503, f"the server is holding {self.used} bytes of request bodies; a body of "
                            f"{size} bytes does not fit now (limit {self.total}); retry shortly",
                            reason="bodies_in_flight", headers={"Retry-After": "1"})
        self.used += size

    def release(self, size: int) -> None:
        self.used -= size


class _Inflater:
    """Incremental gzip/deflate decoding with a hard output bound."""

    def __init__(self, encoding: str, limit: int) -> None:
        wbits = 31 if encoding == "gzip" else 15  # deflate: the zlib format, as HTTP means it
        self.decoder, self.limit, self.size, self.encoding = zlib.decompressobj(wbits), limit, 0, encoding

    def feed(self, data: bytes) -> bytes:
        try:
            out = self.decoder.decompress(data, self.limit - self.size + 1)
            if self.decoder.unconsumed_tail:
                out = b""  # more output than the bound allows
                self.size = self.limit + 1
        except zlib.error as exc:
            raise DoorError(400, f"the body is not valid {self.encoding}: {exc}") from None
        self.size += len(out)
        if self.size > self.limit:
            raise DoorError(413, f"the body inflates to more than the {self.limit} byte limit", reason="too_large")
        return out

    def finish(self) -> None:
        if not self.decoder.eof:
            raise DoorError(400, f"the {self.encoding} body is truncated")


def declared_length(headers: Any, limits: DoorLimits) -> int:
    """The body's Content-Length, checked against the bounds before anything is read."""
    if "transfer-encoding" in headers:
        raise DoorError(411, "chunked bodies are not accepted; send Content-Length", reason="chunked")
    text = headers.get("content-length", "0")
    if not text.isdigit() or len(text) > 15:
        raise DoorError(400, "Content-Length must be a decimal byte count")
    length = int(text)
    if length > limits.max_body:
        raise DoorError(413, f"body of {length} bytes is over the {limits.max_body} byte limit", reason="too_large")
    return length


def content_coding(headers: Any) -> str | None:
    coding = headers.get("content-encoding", "identity").strip().lower()
    if coding in ("", "identity"):
        return None
    if coding not in ("gzip", "deflate"):
        raise DoorError(415, f"Content-Encoding '{coding[:32]}' is not supported; use gzip, deflate or none",
                        reason="encoding")
    return coding


def _place(chunk: bytes, at: int, head: bytearray, tail: memoryview | None) -> None:
    """Copy ``chunk`` (body bytes from ``at``) into ``head``, and past its end into ``tail``."""
    cut = max(0, min(len(chunk), len(head) - at))
    if cut:
        head[at:at + cut] = chunk[:cut]
    if cut < len(chunk):
        start = at + cut - len(head)
        tail[start:start + len(chunk) - cut] = chunk[cut:]


class BodyReader:
    """Reads one body; holds its share of the budget until the request is done (``async with``)."""

    def __init__(self, budget: ByteBudget, limits: DoorLimits) -> None:
        self.budget, self.limits, self.reserved = budget, limits, 0

    def _hold(self, size: int) -> None:
        if size > self.budget.total:  # could never fit: not worth a retry
            raise DoorError(413, f"a body of {size} bytes is over the {self.budget.total} bytes the server holds "
                            "for all requests at once", reason="too_large")
        if size > self.reserved:
            self.budget.reserve(size - self.reserved)
            self.reserved = size

    async def read(self, receive: Callable[[], Awaitable[dict]], headers: Any,
                   tail: memoryview | None = None) -> bytes | bytearray:
        """The whole body (inflated), read chunk by chunk with a timeout on each.

        A body refused for its size is, once the answer is out, read to its end and dropped (up to
        DRAIN_LIMIT bytes, none of them held: ``DoorError.after``), so that a client still sending
        it reads the answer instead of a connection reset.
        ``tail`` (a plain body only): where the body's last ``len(tail)`` bytes go; the rest is returned.
        """
        self.got, self.more = 0, True
        try:
            return await self._read(receive, headers, tail)
        except DoorError as exc:
            if exc.status in (413, 503) and self.more:
                exc.after = functools.partial(self._drain, receive, headers)
            raise

    async def _read(self, receive: Callable[[], Awaitable[dict]], headers: Any,
                    tail: memoryview | None) -> bytes | bytearray:
        length, coding = declared_length(headers, self.limits), content_coding(headers)
        self._hold(length)
        inflater = _Inflater(coding, self.limits.max_body) if coding else None
        if tail is not None and (inflater or len(tail) > length):
            raise ValueError("a tail is for a plain body that holds it")
        head = length - (len(tail) if tail is not None else 0)
        # a plain body lands where it belongs as it arrives (no second copy to join the chunks)
        whole, parts, size = (None, [], 0) if inflater else (bytearray(head), None, 0)
        while self.more:
            message = await self._next(receive)
            chunk = message.get("body", b"")
            self.more = message.get("more_body", False)
            if self.got + len(chunk) > length:
                raise DoorError(400, "the body is longer than its Content-Length")
            if inflater and chunk:
                data = inflater.feed(chunk)
                size += len(data)
                self._hold(size)
                parts.append(data)
            elif chunk:
                _place(chunk, self.got, whole, tail)
            self.got += len(chunk)
        if self.got != length:
            raise DoorError(400, f"the body ended after {self.got} of {length} bytes")
        if inflater:
            inflater.finish()
            return b"".join(parts)
        return whole

    async def _drain(self, receive: Callable[[], Awaitable[dict]], headers: Any) -> None:
        text = headers.get("content-length", "0")
        if "transfer-encoding" in headers or not text.isdigit() or int(text) > DRAIN_LIMIT:
            return  # the connection is closed after the answer
        try:
            while self.more:
                message = await self._next(receive)
                self.more = message.get("more_body", False)
        except DoorError:
            pass

    async def _next(self, receive: Callable[[], Awaitable[dict]]) -> dict:
        try:
            message = await asyncio.wait_for(receive(), self.limits.read_timeout_s)
        except asyncio.TimeoutError:
            raise DoorError(408, f"no body bytes for {self.limits.read_timeout_s:.0f}s; the request is dropped",
                            reason="read_timeout", headers={"Connection": "close"}) from None
        if message["type"] == "http.disconnect":
            raise DoorError(499, "the client closed the connection", reason="client_gone")
        return message

    async def __aenter__(self) -> BodyReader:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.budget.release(self.reserved)
        self.reserved = 0
