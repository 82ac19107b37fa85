"""What ``model_repository/neopp_session/1/model.py`` does: multi-turn sessions over BLS.

Each turn is forwarded, through Python-backend BLS, to a generation model (``MODEL`` input,
else the ``default_model`` parameter) with every generation input except ``SEED``, plus the
session's stream: ``SEED`` on a seeded turn, else ``RNG_STATE`` (the last turn's
``NEXT_RNG_STATE``). The generation model holds no session state, so any instance of any
generation model can serve any turn; the state table lives here (``sessions.py``).

Parameters (``config.pbtxt``):

* ``default_model``: generation model of a turn without ``MODEL`` (``neopp_dense``);
* ``allowed_models``: comma-separated models a turn may name (default: the contract's);
* ``default_seed``: seed of a first turn without ``SEED`` (``0``);
* ``max_sessions``: sessions held by one instance at most (``1024``); a new session beyond it is
  refused with UNAVAILABLE until one ends or has been idle past the timeout (no held session is
  ever dropped to make room);
* ``session_idle_timeout_s``: seconds a session may stay unused (``600``). Keep
  ``sequence_batching.max_sequence_idle_microseconds`` at least as long, so that Triton does
  not release the sequence first (its own refusal then says the START flag is missing).
* ``sequence_batching.oldest.max_candidate_sequences``: Triton's slots; at least
  ``max_sessions`` plus an eighth. Once fewer than that eighth are free, the model ends the
  dropped sessions that still hold one (``SequenceSlots``, ``SlotReleaser``).

A request with ``sequence_end`` and no ``COND_KV`` only closes the session: it answers an
empty ``IMAGE`` and ``TURN`` -1, so a chat can end without generating one more image.

Sessions have owners: every answer carries the session's ``SESSION_TOKEN`` (128 random bits),
and every turn of a live session after its first (a later turn, a close, a restart with
``sequence_start``) must send it back, else it is refused with INVALID_ARG and the session is
left exactly as it was. The model's own closes (released slots, a stop) carry a per-instance
secret instead. Triton's sequence batcher frees a sequence's slot at any ``sequence_end``, even
one this model refuses; so a ``sequence_start`` that carries the token of an open session
continues that session (its ``SEED``, if any, restarts the stream as on any turn), and an owner
whose next turn Triton refuses for a missing START flag sends it again with ``sequence_start``.

When the server stops, Triton waits for open sequences, up to its exit timeout. The model
watches the server's own gRPC port (``StopWatch``; the address is read from the server's
command line) and, once it says it is exiting, ends every sequence it holds at once, as a
client's ``sequence_end`` over that port (Triton 2.51 refuses BLS requests while it stops,
but takes those). A stop with sessions left open is thus quick and graceful.

Errors of the generation model are returned unchanged (same message, same status).
"""

from __future__ import annotations

import json
import queue
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import ConfigError, InputError, shown
from ..limits import text_value
from ..procs import own_server_grpc_url
from .error_status import error_response, forwarded_error
from .lanes import forwarded_lane
from .parameters import model_allowlist, read_parameters
from .sessions import (
    CONTINUE_ELSEWHERE,
    TOKEN_INPUT,
    SequenceSlots,
    SessionsFull,
    SessionTable,
    TurnPlan,
    UnknownSession,
    authorize,
)
from .stop_watch import StopWatch, server_exiting

SESSION_PARAMETERS = {
    "default_model": "neopp_dense",
    "allowed_models": "",
    "default_seed": "0",
    "max_sessions": "1024",
    "session_idle_timeout_s": "600",
}
CONTROL_INPUTS = ("START", "END", "CORRID")
NOT_FORWARDED = ("MODEL", "SEED", TOKEN_INPUT, *CONTROL_INPUTS)
RELEASE_REQUEST_ID = "neopp-session-release"  # the model's own sequence_end of a dropped session
STOP_REQUEST_ID = "neopp-session-stop"  # ... of a session still open when the server stops
CLOSED_WHY = {RELEASE_REQUEST_ID: "released its Triton slot (dropped earlier)",
              STOP_REQUEST_ID: "ended: the server is stopping"}


def session_parameters(model_config: dict[str, Any]) -> dict[str, str]:
    """``parameters`` of config.pbtxt as strings, the session model's defaults filled in."""
    return read_parameters(model_config, SESSION_PARAMETERS)


def build_table(params: dict[str, str]) -> SessionTable:
    try:
        return SessionTable(max_sessions=int(params["max_sessions"]),
                            idle_timeout_s=float(params["session_idle_timeout_s"]),
                            default_seed=int(params["default_seed"]))
    except ValueError as exc:
        raise ConfigError(f"neopp_session parameters: {exc}") from exc


def build_slots(config: dict[str, Any], table: SessionTable) -> SequenceSlots:
    """Triton's slot bound from ``sequence_batching``; it must leave room above ``max_sessions``."""
    batching = config.get("sequence_batching") or {}
    capacity = int((batching.get("oldest") or {}).get("max_candidate_sequences") or 0)
    if not capacity:
        raise ConfigError("neopp_session: sequence_batching must use the oldest strategy with "
                          "max_candidate_sequences set")
    reserve = max(1, capacity // 8)
    if table.max_sessions > capacity - reserve:
        raise ConfigError(f"neopp_session: max_candidate_sequences ({capacity}) must be at least "
                          f"max_sessions ({table.max_sessions}) + {reserve} (an eighth, at least 1), so that "
                          "Triton never runs out of sequence slots before the model drops a session")
    idle_us = int(batching.get("max_sequence_idle_microseconds") or 1_000_000)
    return SequenceSlots(capacity, reserve, idle_us / 1e6)


class SlotReleaser:
    """Ends dropped sessions in Triton from a thread of its own.

    The sequence_end travels as a BLS request to this very model, which the instance can
    only serve after the current ``execute`` returns: sent from ``execute`` it would wait
    on itself.
    """

    def __init__(self, send: Callable[[int, str], None], logger: Any) -> None:
        self._send, self._logger = send, logger
        self._queue: queue.Queue[tuple[int, str] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="neopp-session-release", daemon=True)
        self._thread.start()

    def release(self, session_ids: list[int], request_id: str = RELEASE_REQUEST_ID) -> None:
        for sid in session_ids:
            self._queue.put((sid, request_id))

    def close(self, timeout: float = 5.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            sid, request_id = item
            try:
                self._send(sid, request_id)
            except Exception as exc:  # noqa: BLE001 - a failed release only waits for Triton's idle bound
                self._logger.log_warn(f"neopp_session: releasing sequence {sid} failed: {exc}")


def _scalar(tensor: Any) -> Any:
    return np.asarray(tensor.as_numpy()).reshape(-1)[0]


def _text(name: str, tensor: Any) -> str:
    return text_value(name, _scalar(tensor))


class SessionTritonModel:
    """Triton Python-backend model ``neopp_session`` (sequence batching + BLS)."""

    def initialize(self, args: dict[str, str]) -> None:
        import triton_python_backend_utils as pb_utils

        self.pb = pb_utils
        self.logger = pb_utils.Logger
        config = json.loads(args["model_config"])
        self.model_name = args.get("model_name", config.get("name", "neopp_session"))
        params = session_parameters(config)
        self.table = build_table(params)
        self.slots = build_slots(config, self.table)
        self.releaser = SlotReleaser(self._send_release, self.logger)
        self._ended_at_stop: set[int] = set()
        self._internal_token = secrets.token_hex(16)  # the model's own closes carry it
        self._stop_client: Any = None
        self.stop_watch = self._watch_for_stop()
        self.allowed, self.default_model = model_allowlist(params, args["model_repository"])
        idle_us = int((config.get("sequence_batching") or {}).get("max_sequence_idle_microseconds") or 1_000_000)
        if idle_us < self.table.idle_timeout_s * 1e6:
            self.logger.log_warn(
                f"{self.model_name}: sequence_batching.max_sequence_idle_microseconds ({idle_us}) is shorter than "
                f"session_idle_timeout_s ({self.table.idle_timeout_s:g} s): Triton releases idle sequences first")
        gauge = pb_utils.MetricFamily(name="neopp_sessions_active", kind=pb_utils.MetricFamily.GAUGE,
                                      description="Sessions held by neopp_session (per instance, summed)")
        turns = pb_utils.MetricFamily(name="neopp_session_turns_total", kind=pb_utils.MetricFamily.COUNTER,
                                      description="Images delivered by neopp_session")
        refused = pb_utils.MetricFamily(name="neopp_session_starts_refused_total", kind=pb_utils.MetricFamily.COUNTER,
                                        description="New sessions refused by neopp_session: max_sessions in use")
        self._families = (gauge, turns, refused)  # a family that is garbage-collected unregisters
        labels = {"model": self.model_name, "instance": args.get("model_instance_name", "")}
        self.active_metric, self.turns_metric = gauge.Metric(labels=labels), turns.Metric(labels=labels)
        self.refused_metric = refused.Metric(labels=labels)
        self.logger.log_info(f"{self.model_name}: sessions max={self.table.max_sessions} idle timeout="
                             f"{self.table.idle_timeout_s:g}s default model={self.default_model} "
                             f"default seed={self.table.default_seed}")

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = [self._turn(request) for request in requests]
        self.active_metric.set(float(len(self.table)))
        self.releaser.release(self.slots.to_release(self.table))
        if self.stop_watch is not None and self.stop_watch.stopped.is_set():
            self._end_open_sequences()  # a sequence that began after the stop was noticed
        return responses

    def finalize(self) -> None:
        if self.stop_watch is not None:
            self.stop_watch.close()
        self.releaser.close()
        if self._stop_client is not None:
            self._stop_client.close()
        self.table = None

    def _end_open_sequences(self) -> None:
        """The server is stopping: end every sequence still open (each one holds the stop up)."""
        ids = [sid for sid in self.slots.held() if sid not in self._ended_at_stop]
        if ids:
            self._ended_at_stop.update(ids)
            self.logger.log_info(f"{self.model_name}: stopping: ending {len(ids)} open session(s)")
            self.releaser.release(ids, STOP_REQUEST_ID)

    def _send_release(self, session_id: int, request_id: str) -> None:
        """End one session's Triton sequence (dropped, or open at stop), so that its slot frees."""
        if request_id == STOP_REQUEST_ID:
            self._send_stop_end(session_id)
            return
        pb = self.pb
        token = pb.Tensor(TOKEN_INPUT, np.array([self._internal_token.encode()], dtype=np.object_))
        result = pb.InferenceRequest(model_name=self.model_name, inputs=[token], requested_output_names=["TURN"],
                                     request_id=RELEASE_REQUEST_ID, correlation_id=session_id,
                                     flags=pb.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END).exec()
        if result.has_error():  # e.g. Triton's idle bound ended it first
            self.logger.log_verbose(f"{self.model_name}: release of {session_id}: {result.error().message()}")

    def _watch_for_stop(self) -> StopWatch | None:
        """Watch the server's gRPC port for a stop; without one, open sessions hold a stop up."""
        url = own_server_grpc_url()
        try:
            import tritonclient.grpc as grpcclient
        except ImportError:
            url = None
        if url is None:
            self.logger.log_warn(f"{self.model_name}: no gRPC port or no tritonclient[grpc]: a stop waits for "
                                 "sessions left open, up to the server's exit timeout")
            return None
        # The port opens only once every model has loaded: without a cap, gRPC's reconnect backoff
        # grows through a long load and the first check after it could come after the stop.
        backoff = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                   ("grpc.max_reconnect_backoff_ms", 1000)]
        self._stop_client = grpcclient.InferenceServerClient(url, channel_args=backoff)
        return StopWatch(lambda: server_exiting(self._stop_client), self._end_open_sequences)

    def _send_stop_end(self, session_id: int) -> None:
        """A client's sequence_end over the server's own gRPC port (BLS is refused while it stops)."""
        import tritonclient.grpc as grpcclient

        token = grpcclient.InferInput(TOKEN_INPUT, [1], "BYTES")
        token.set_data_from_numpy(np.array([self._internal_token.encode()], dtype=np.object_))
        self._stop_client.infer(self.model_name, [token], sequence_id=session_id, sequence_end=True,
                                request_id=STOP_REQUEST_ID, client_timeout=10.0)

    # ------------------------------------------------------------------ one turn

    def _turn(self, request: Any) -> Any:
        pb = self.pb
        inputs = {tensor.name(): tensor for tensor in request.inputs()}
        session_id: Any = request.correlation_id()
        end = False
        try:
            missing = [name for name in CONTROL_INPUTS if name not in inputs]
            if missing:
                raise ConfigError(f"control inputs {missing} missing: config.pbtxt must declare START, END, CORRID")
            start, asked_end = bool(_scalar(inputs["START"])), bool(_scalar(inputs["END"]))
            session_id = int(_scalar(inputs["CORRID"]))
            self.slots.seen(session_id, asked_end)  # Triton holds (or, at an end, frees) its slot whatever we answer
            try:
                self._authorize(session_id, inputs, generates="COND_KV" in inputs)  # a refused turn changes nothing
                end = asked_end
                seed = int(_scalar(inputs["SEED"])) if "SEED" in inputs else None
                if "COND_KV" not in inputs:
                    if not end:
                        raise InputError("COND_KV: required input is missing (only a sequence_end request may leave "
                                         "it out, to close the session without an image)")
                    return self._closed(session_id, CLOSED_WHY.get(request.request_id(), "closed without an image"))
                held = start and session_id in self.table  # a START with the owner's token continues it
                session = self.table.open(session_id, seed) if start and not held else self.table.get(session_id)
            except (UnknownSession, SessionsFull) as exc:
                if start and not asked_end:  # the slot Triton gave this start serves nothing: free it now
                    self.releaser.release([session_id])
                if isinstance(exc, SessionsFull):
                    self.refused_metric.increment(1)
                raise
            model = session.model or self.default_model
            model = _text("MODEL", inputs["MODEL"]) if "MODEL" in inputs else model
            if model not in self.allowed:
                raise InputError(f"MODEL: {shown(model)} is not a generation model this server offers; "
                                 f"expected one of {list(self.allowed)}")
            lane = forwarded_lane(request)  # refused before the turn is counted
            plan = self.table.next_turn(session, seed)
            result = self._generate(model, inputs, plan, lane)
            if result.has_error():
                self.logger.log_warn(f"{self.model_name}: session {session_id}: {model} refused the turn: "
                                     f"{shown(result.error().message(), 300)}")
                return forwarded_error(pb, result.error().message())
            image = pb.get_output_tensor_by_name(result, "IMAGE").as_numpy()
            state = pb.get_output_tensor_by_name(result, "NEXT_RNG_STATE").as_numpy()
            turn = self.table.commit(session, state.tobytes(), model)
        except Exception as exc:  # noqa: BLE001 - every failure is answered; the model stays usable
            return error_response(pb, exc, self.logger, self.model_name)
        finally:
            if end:
                self.table.end(session_id)  # freed whether or not the last turn succeeded
        self.turns_metric.increment(1)
        self.logger.log_info(f"{self.model_name}: session {session_id} turn {turn} by {model} "
                             f"({'seed ' + str(plan.seed) if plan.seed is not None else 'continued'})"
                             f"{' end' if end else ''}")
        return pb.InferenceResponse(output_tensors=[
            pb.Tensor("IMAGE", image),
            pb.Tensor("TURN", np.array([turn], dtype=np.int64)),
            pb.Tensor("NEXT_RNG_STATE", state),
            pb.Tensor(TOKEN_INPUT, np.array([session.token.encode()], dtype=np.object_)),
        ])

    def _authorize(self, session_id: int, inputs: dict[str, Any], generates: bool) -> None:
        """A live session's turns (later, closing, restarting) need its token; a new id needs none.

        A turn that carries a token but finds no session here (it ended, expired, or lives on a
        replica that is gone) is refused rather than started afresh: a new stream would give other
        images without a word. Closing one is harmless and answered as a close."""
        session = self.table.held(session_id)
        token = _text(TOKEN_INPUT, inputs[TOKEN_INPUT]) if TOKEN_INPUT in inputs else None
        if session is not None:
            authorize(session, token, self._internal_token)
        elif token is not None and generates and not secrets.compare_digest(token.encode(),
                                                                            self._internal_token.encode()):
            raise UnknownSession(f"sequence_id {session_id}: unknown session ({self.table.why_gone(session_id)}): "
                                 f"its SESSION_TOKEN names a session this server does not hold; {CONTINUE_ELSEWHERE}")

    def _closed(self, session_id: Any, how: str) -> Any:
        """Answer of a request that only closes a session: no image (empty IMAGE, TURN -1)."""
        pb = self.pb
        self.logger.log_info(f"{self.model_name}: session {session_id} {how}")
        return pb.InferenceResponse(output_tensors=[
            pb.Tensor("IMAGE", np.array([b""], dtype=np.object_)),
            pb.Tensor("TURN", np.array([-1], dtype=np.int64)),
            pb.Tensor("NEXT_RNG_STATE", np.zeros(0, dtype=np.uint8)),
            pb.Tensor(TOKEN_INPUT, np.array([b""], dtype=np.object_)),
        ])

    def _generate(self, model: str, inputs: dict[str, Any], plan: TurnPlan, parameters: dict[str, str]) -> Any:
        """One BLS call; the request's tensors are passed through without a copy here."""
        pb = self.pb
        forward = [tensor for name, tensor in inputs.items() if name not in NOT_FORWARDED]
        if plan.seed is not None:
            forward.append(pb.Tensor("SEED", np.array([plan.seed], dtype=np.int64)))
        else:
            forward.append(pb.Tensor("RNG_STATE", np.frombuffer(plan.rng_state, dtype=np.uint8).copy()))
        started = time.perf_counter()
        result = pb.InferenceRequest(model_name=model, inputs=forward,
                                     requested_output_names=["IMAGE", "NEXT_RNG_STATE"], parameters=parameters).exec()
        self.logger.log_verbose(f"{self.model_name}: {model} answered in {time.perf_counter() - started:.2f}s")
        return result
