"""One relayed ``ModelStreamInfer`` of the gRPC front (neopp.launcher.door.grpc_front).

Why its own queues: a stream's requests and answers flow independently, and a client may send
and never read. Each way is bounded, so such a client stops the relay rather than filling the
launcher's memory (or Triton's, which would keep the answers of every request sent on).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
from tritonclient.grpc import service_pb2 as pb

from ...contract.statuses import RETRY_LATER, status_of_message
from .message_fields import MAX_NAME_BYTES, BadMessage, inference_problem, parse_request

STREAM_BACKLOG = 16  # a stream's answers waiting for its client to read them
STREAM_BACKLOG_BYTES = 64 << 20  # and their bytes (one answer is always let through)
STREAM_IN_FLIGHT = 64  # a stream's requests sent on and not answered in full; the next one waits
_END = object()


class RelayedStream:
    """One relayed ``ModelStreamInfer``: the client's requests admitted one by one and sent on,
    Triton's answers and the front's refusals back in order. Both ways are bounded: a client that
    does not read its answers stops Triton's being read, then new requests being sent on (Triton
    would keep their answers), then its own requests being read. A request's bytes stay counted in
    the body budget until it is answered in full: Triton holds it (and the answers that echo its
    id) until then."""

    def __init__(self, relay: Any, client: str, call: Any = None) -> None:
        """``relay``: the front's Relay (``refusal``, ``admit``, ``done``, ``status_of``); ``call``:
        its open call (``busy``, ``idle``: idle while no request is in flight), or None."""
        self.relay, self.client, self.open_call = relay, client, call
        self.out: asyncio.Queue = asyncio.Queue(STREAM_BACKLOG)  # answers and refusals, in order
        self.admitted: asyncio.Queue = asyncio.Queue(1)  # requests Triton is to get, with their sizes
        self.running = 0  # the client's requests not yet answered in full
        self.slots = asyncio.Semaphore(STREAM_IN_FLIGHT)  # one held by each of them
        self.unanswered: deque[int] = deque()  # the bytes of each of them, oldest first
        self.queued = 0  # bytes of Triton's answers in ``out``
        self.drained = asyncio.Event()  # set as the client takes answers
        self.failed: tuple[grpc.StatusCode, str] | None = None
        self.since = time.monotonic()
        self.closed = False
        self.tasks: list[asyncio.Future] = []
        self.call: Any = None

    async def read(self, messages: AsyncIterator[bytes]) -> None:
        try:
            async for data in messages:
                try:
                    request = parse_request(data, pb.ModelInferRequest)
                except BadMessage as bad:
                    self.failed = (grpc.StatusCode.INVALID_ARGUMENT, f"a request of this stream: {bad}")
                    await self.out.put(_END)
                    return
                await self.admit(request)
        except Exception:  # noqa: BLE001 - the client's stream broke: the relayed one ends
            pass
        await self.admitted.put((_END, 0))

    async def admit(self, request: Any) -> None:
        """Send ``request`` on, or answer its refusal in the stream (counted nowhere)."""
        size = request.ByteSize()
        await self.slots.acquire()
        fault = inference_problem(request)  # the client's fault; the rest are to retry
        why = fault or self.relay.refusal(request.model_name) or self.relay.admit(request, self.client, size)
        if why is not None:
            self.slots.release()
            await self.out.put(_Refused(stream_error(request, why, retry=fault is None)))
            return
        self.running += 1
        if self.open_call is not None:
            self.open_call.busy()
        self.unanswered.append(size)
        await self.admitted.put((request, size))

    async def sent(self) -> AsyncIterator[Any]:
        while (item := await self.admitted.get())[0] is not _END:
            yield item[0]

    async def pump(self, call: Any) -> None:  # the call ends after the client's last request: refusals come first
        try:
            async for answer in call:
                while self.queued >= STREAM_BACKLOG_BYTES:
                    self.drained.clear()
                    await self.drained.wait()
                self.queued += len(answer)
                await self.out.put(answer)
        except grpc.aio.AioRpcError as exc:
            self.failed = (self.relay.status_of(exc, "", self.since), exc.details() or exc.code().name)
        await self.out.put(_END)

    async def answers(self, messages: AsyncIterator[bytes], call: Any) -> AsyncIterator[bytes]:
        self.call = call
        self.tasks = [asyncio.ensure_future(self.read(messages)), asyncio.ensure_future(self.pump(call))]
        while (answer := await self.out.get()) is not _END:
            if isinstance(answer, _Refused):
                yield answer.answer
                continue
            self.queued -= len(answer)
            self.drained.set()
            if self.running and ends_a_request(answer):
                self.running -= 1
                self.slots.release()
                self.relay.done(self.client, 1, self.unanswered.popleft())
                if not self.running and self.open_call is not None:
                    self.open_call.idle()
            yield answer

    def close(self) -> None:
        """Stop both ways and give back what the stream still counts (once)."""
        if self.closed:
            return
        self.closed = True
        for task in self.tasks:
            task.cancel()
        if self.call is not None:
            self.call.cancel()
        self.relay.done(self.client, self.running, sum(self.unanswered))
        self.running = 0
        self.unanswered.clear()
        while True:  # the request iterator Triton's call reads ends, rather than being closed while it waits
            try:
                self.admitted.put_nowait((_END, 0))
                break
            except asyncio.QueueFull:
                self.admitted.get_nowait()


@dataclass(frozen=True)
class _Refused:
    """The front's own answer to a request of a stream it did not send on."""

    answer: bytes


def ends_a_request(answer: bytes) -> bool:
    """A stream answer that is its request's last: Triton's final flag, or an error."""
    parsed = pb.ModelStreamInferResponse.FromString(answer)
    if parsed.error_message:
        return True
    final = parsed.infer_response.parameters.get("triton_final_response")
    return final is None or final.bool_param


def stream_error(request: Any, why: str, retry: bool = True) -> bytes:
    """A stream's in-band refusal, as Triton answers a request of a stream it cannot serve. It has
    no status, so the text of one to retry starts with the words that say so."""
    text = why if not retry or status_of_message(why) == RETRY_LATER.status else RETRY_LATER.message(why)
    answer = pb.ModelStreamInferResponse(error_message=text)
    if len(request.id) <= MAX_NAME_BYTES and len(request.model_name) <= MAX_NAME_BYTES:  # else not echoed
        answer.infer_response.id = request.id
        answer.infer_response.model_name = request.model_name
    return answer.SerializeToString()
