"""The prompt encoder's owner: one language tower, fed the prompts of every instance together.

The encoder's first instance loads the tower and serves it on its socket (``socket_host``);
every instance, its own included, hands each request over (``engine_link``) and waits for the
answer. One loop takes what has arrived, up to ``max_batch`` requests, and prefills every plain
prompt among them in one forward (``prompt_encoding``): with a tower on a GPU, sixteen 300-token
prompts cost little more than one. Edits and think requests run one at a time after them. A
request is parsed and tokenized once, here; one that is refused, or whose client left, ends
alone, never its neighbours'.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..contract.inputs import MAX_EDIT_IMAGE_BYTES, MAX_EDIT_IMAGES, MAX_PROMPT_BYTES
from ..engines.fault_point import FaultPoint
from ..errors import EngineDown, GenerationCancelled, InputError
from ..text.language_tower import LanguageTower
from .engine_connection import Connection
from .error_status import refusal
from .prompt_encoding import Outputs, encode_prompts, encode_together, prefills_together, prompt_sequences
from .prompt_parsing import ENCODER_INPUTS, PromptRequest, parse_prompts
from .socket_host import SocketHost
from .wire import NUMPY_OF, bytes_blob, declared_sizes, error_header, unpack_tensors

# the most a request's tensors may hold: its prompts and its pictures (each file's 4-byte length too)
MAX_REQUEST_BYTES = 2 * (MAX_PROMPT_BYTES + 4) + MAX_EDIT_IMAGES * (MAX_EDIT_IMAGE_BYTES + 4) + 64


@dataclass
class _Job:
    conn: Connection
    job: int
    req: PromptRequest

    def cancelled(self) -> bool:
        return self.conn.cancelled(self.job)


class PrefillHost(SocketHost):
    """The tower behind the encoder's socket, and the loop that prefills what arrived together."""

    def __init__(self, owner: str, tower: LanguageTower, max_batch: int, stopping: threading.Event,
                 error_log: Any, on_batch: Callable[[int], None] | None = None,
                 on_held: Callable[[int], None] | None = None) -> None:
        super().__init__(owner, stopping, error_log)
        self.tower, self.max_batch = tower, max_batch
        self._on_batch, self._on_held = on_batch, on_held
        self._waiting: deque[_Job] = deque()
        self._current: list[_Job] = []
        self._wake = threading.Condition()
        self._failure: str | None = None
        self._faults = FaultPoint()
        self._loop = threading.Thread(target=self._run, name="neopp-prefill", daemon=True)
        self._loop.start()
        self.start()

    def held(self) -> int:
        """Requests the tower holds: waiting, or in the forward now."""
        with self._wake:
            return len(self._waiting) + len(self._current)

    def failure(self) -> str | None:
        if self._failure is None and not self._closed.is_set() and not self._loop.is_alive():
            return "its prefill loop is gone"
        return self._failure

    def close(self) -> None:
        super().close()
        with self._wake:
            self._wake.notify_all()

    # ---- arrivals ------------------------------------------------------------------------------
    def accept(self, conn: Connection, job: int, header: dict[str, Any], blobs: list[bytes], fds: list[int]) -> None:
        """Parse once and queue; a refusal is the request's answer at once."""
        req = self.admit(conn, job, lambda: parse_prompts(request_tensors(header, blobs, fds)),
                         "its prompt was encoded")
        if req is None:
            return
        with self._wake:  # checked again under the lock the loop drains under: no request is left behind
            gone = self._failure or ("the prompt encoder is unloading" if self._closed.is_set() else None)
            if gone is None:
                self._waiting.append(_Job(conn, job, req))
                self._wake.notify()
        if gone is not None:
            conn.send(error_header(job, *self.answer(EngineDown(gone))))
            return
        self._report()

    def answer(self, exc: BaseException) -> tuple[str, str, str]:
        return refusal(exc, self.error_log, self.owner, None, self.stopping.is_set())

    # ---- the loop --------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while (batch := self._take()) is not None:
                self._serve(batch)
                with self._wake:
                    self._current = []
                self._report()
        except BaseException as exc:  # noqa: BLE001 - the loop is gone: say so, answer all it held
            with self._wake:
                self._failure = f"its prefill loop stopped: {type(exc).__name__}: {exc}"
                held, self._current = [*self._current, *self._waiting], []
                self._waiting.clear()
            self.error_log(f"{self.owner}: {self._failure}")
            for job in held:
                self._refuse(job, EngineDown(self._failure))
            self._report()

    def _take(self) -> list[_Job] | None:
        """What has arrived, up to ``max_batch`` requests (waiting for the first); None once closed.
        A fault drill holds the loop between the first arrival and the take, so requests pile up
        (a test sees them prefilled together), or stops it there."""
        with self._wake:
            while not self._waiting and not self._closed.is_set():
                self._wake.wait()
            if self._closed.is_set() and not self._waiting:
                return None
        self._faults.check()
        with self._wake:
            count = min(self.max_batch, len(self._waiting))
            self._current = [self._waiting.popleft() for _ in range(count)]
            return list(self._current)

    def _report(self) -> None:
        if self._on_held is not None:
            self._on_held(self.held())

    def _serve(self, batch: list[_Job]) -> None:
        together: list[tuple[_Job, list[list[int]]]] = []
        alone: list[_Job] = []
        for job in batch:
            if job.cancelled():
                self._refuse(job, GenerationCancelled("request cancelled before its prompt was encoded"))
            elif not prefills_together(job.req):
                alone.append(job)
            else:
                try:
                    together.append((job, prompt_sequences(self.tower, job.req)))
                except Exception as exc:  # noqa: BLE001 - a prompt the tokenizer refuses ends its own request
                    self._refuse(job, exc)
        if together:
            self._prefill(together)
        for job in alone:
            try:
                self._send(job, encode_prompts(self.tower, job.req, job.cancelled))
            except Exception as exc:  # noqa: BLE001 - answered; the next request is served
                self._refuse(job, exc)

    def _prefill(self, together: list[tuple[_Job, list[list[int]]]]) -> None:
        try:
            outputs, sequences = encode_together(self.tower, [seqs for _, seqs in together])
        except Exception as exc:  # noqa: BLE001 - the forward failed (memory): each of its requests says why
            for job, _ in together:
                self._refuse(job, exc)
            return
        if self._on_batch is not None:
            self._on_batch(sequences)
        for (job, _), out in zip(together, outputs, strict=True):
            self._send(job, out)

    def _send(self, job: _Job, outputs: Outputs) -> None:
        specs, blobs = pack_outputs(outputs)
        job.conn.send({"type": "final", "job": job.job, "tensors": specs}, blobs)

    def _refuse(self, job: _Job, exc: BaseException) -> None:
        job.conn.send(error_header(job.job, *self.answer(exc)))


def request_tensors(header: dict[str, Any], blobs: list[bytes], fds: list[int]) -> dict[str, Any]:
    """The request's tensors, within what an encoder request may hold (one over it is refused
    naming its largest input, before anything is mapped)."""
    specs = header.get("tensors")
    sizes = declared_sizes(specs, blobs)
    if sum(sizes.values()) > MAX_REQUEST_BYTES:
        largest = max(sizes, key=lambda name: sizes[name])
        if largest not in ENCODER_INPUTS:
            largest = "the request"
        raise InputError(f"{largest}: the request's inputs are over {MAX_REQUEST_BYTES} bytes (at most "
                         f"{MAX_EDIT_IMAGES} pictures of {MAX_EDIT_IMAGE_BYTES} bytes and two prompts)")
    return unpack_tensors(specs, blobs, fds, MAX_REQUEST_BYTES)


def pack_outputs(outputs: Outputs) -> tuple[list[dict[str, Any]], list[bytes]]:
    """The outputs as the wire carries them back: descriptions and one blob each."""
    specs, blobs = [], []
    for name, value in outputs.items():
        if isinstance(value, torch.Tensor):  # a BF16 prefix
            datatype, data = "BF16", value.contiguous().view(torch.uint8).numpy().tobytes()
        elif value.dtype == np.object_:
            datatype, data = "BYTES", bytes_blob(value)
        else:
            datatype = next(k for k, v in NUMPY_OF.items() if value.dtype == v)
            data = np.ascontiguousarray(value).tobytes()
        specs.append({"name": name, "datatype": datatype, "shape": list(value.shape), "blob": len(blobs)})
        blobs.append(data)
    return specs, blobs
