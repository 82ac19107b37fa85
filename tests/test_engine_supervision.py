"""The engine's loop against failures it did not foresee, without a server: a request that fails
in any way ends alone and the loop serves the next; a failure of the loop itself ends what it held
with EngineDown and publishes it; error texts always fit the framing."""

from __future__ import annotations

import socket

import pytest

import neopp.engines.step_loop as step_loop
from neopp.contract.statuses import ENGINE_DOWN, status_of_message
from neopp.engine_beat import read_beat, write_beat
from neopp.engines.batch_engine import BatchingEngine
from neopp.engines.fault_point import FAULT_ENV
from neopp.errors import EngineDown
from neopp.serving.error_status import error_class
from neopp.serving.wire import MAX_ERROR_TEXT, MAX_HEADER, error_header, recv_message, send_message
from testing.stream_requests import Collector, make, tiny_setup

TIMEOUT_S = 60


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    _, pipe, kvs = tiny_setup(tmp_path_factory.mktemp("supervision"))
    return pipe, kvs


def run(engine: BatchingEngine, req) -> Collector:
    c = Collector()
    engine.submit(req, c.emit, lambda: False)
    assert c.done.wait(TIMEOUT_S), "the request was never answered"
    return c


def test_a_request_failing_to_start_in_an_unforeseen_way_ends_alone(setup, monkeypatch):
    pipe, kvs = setup
    real_start = step_loop.start

    def start(pipe, job, req, *args):
        if req.width == 96:  # this request's adapter, say, cannot be applied: not an error of ours
            raise ZeroDivisionError("float division by zero")
        return real_start(pipe, job, req, *args)

    monkeypatch.setattr(step_loop, "start", start)
    engine = BatchingEngine(pipe)
    try:
        bad = run(engine, make(kvs, 0, 64, 96, 2, 1))
        assert isinstance(bad.events[-1].error, ZeroDivisionError)
        good = run(engine, make(kvs, 1, 64, 64, 2, 2))
        assert good.events[-1].error is None and good.events[-1].final is not None
        assert engine.failure is None
    finally:
        engine.close()


def test_a_failed_loop_ends_what_it_held_and_refuses_the_rest(setup, monkeypatch, tmp_path):
    pipe, kvs = setup
    fault = tmp_path / "fault"
    monkeypatch.setenv(FAULT_ENV, str(fault))
    engine = BatchingEngine(pipe)
    try:
        assert run(engine, make(kvs, 1, 64, 64, 2, 2)).events[-1].final is not None
        fault.touch()
        held = run(engine, make(kvs, 1, 64, 64, 2, 2))
        assert isinstance(held.events[-1].error, EngineDown)
        assert "retry" in engine.failure
        fault.unlink()  # no second chance: the loop's state is not trusted again
        later = run(engine, make(kvs, 1, 64, 64, 2, 2))
        assert isinstance(later.events[-1].error, EngineDown)
        assert error_class(later.events[-1].error) is ENGINE_DOWN
        assert status_of_message(ENGINE_DOWN.message(str(later.events[-1].error))) == "UNAVAILABLE"
    finally:
        engine.close()


def test_an_error_text_of_any_size_fits_the_framing():
    listing = ", ".join(f"adapter_{i:06d}_{'x' * 100}" for i in range(12000))  # ~1.4 MB, as a large folder
    header = error_header(7, "INVALID_ARG", "invalid_input", f"LORA: unknown adapter; known: {listing}")
    assert len(header["message"]) < MAX_ERROR_TEXT + 64 and "more characters)" in header["message"]
    a, b = socket.socketpair()
    try:
        send_message(a, header)
        got, _, _ = recv_message(b)
        assert got["job"] == 7 and got["message"].startswith("LORA: unknown adapter")
        assert len(got["message"].encode()) < MAX_HEADER
    finally:
        a.close()
        b.close()


def test_a_beat_reads_back_and_junk_is_no_beat(tmp_path):
    path = tmp_path / "m.beat"
    write_beat(path, None)
    assert read_beat(path).alive
    write_beat(path, "the engine's loop stopped")
    beat = read_beat(path)
    assert not beat.alive and beat.why == "the engine's loop stopped"
    path.write_bytes(b"\x00" * 10000)
    assert read_beat(path) is None


def test_a_twin_s_engine_is_its_plain_model_s():
    from neopp.launcher.watchdog import engine_owner

    twin = {"name": "neopp_dense_stream", "parameters": {"engine_model": {"string_value": "neopp_dense"}}}
    assert engine_owner(twin) == "neopp_dense"
    assert engine_owner({"name": "neopp_dense", "parameters": {"engine_model": {"string_value": ""}}}) == "neopp_dense"
    assert engine_owner({"name": "neopp_moe"}) == "neopp_moe"


def test_a_rank_s_unforeseen_error_reaches_the_client_as_internal_not_retry():
    from neopp.contract.statuses import INTERNAL
    from neopp.engines.rank_loop import ERRORS, error_kind, error_text
    from neopp.errors import WorkerFailure

    exc = ZeroDivisionError("float division by zero")
    rebuilt = ERRORS.get(error_kind(exc), WorkerFailure)(error_text(exc))
    assert error_class(rebuilt) is INTERNAL and "ZeroDivisionError" in str(rebuilt)
    assert error_kind(WorkerFailure("rank 1 died")) == "failure"


def test_an_answer_that_cannot_be_built_is_replaced_by_an_error(tmp_path):
    """The writer of a connection: a last event whose message fails (an image failing to encode, a
    header over the framing) still ends its request, and the next request's answer follows."""
    import threading

    import numpy as np

    from neopp.sampling.sampler import StepEvent
    from neopp.serving.engine_connection import Connection

    class Host:  # what a connection calls of its engine's host
        stopping = threading.Event()

        def event_message(self, job, event, accepted):
            if job == 1:
                raise ValueError("cannot encode")
            if job == 2:
                return {"type": "final", "job": 2, "huge": "x" * (MAX_HEADER + 1)}, []
            return {"type": "final", "job": job}, []

        def forget(self, conn):
            pass

    ours, theirs = socket.socketpair()
    conn = Connection(Host(), ours)
    threading.Thread(target=conn._write, daemon=True).start()
    try:
        for job in (1, 2, 3):
            conn.event(job, StepEvent(2, 2, final=np.zeros((1, 1, 3), np.uint8)), None)
        theirs.settimeout(TIMEOUT_S)
        got = [recv_message(theirs)[0] for _ in range(3)]
        assert [(m["job"], m["type"]) for m in got] == [(1, "error"), (2, "error"), (3, "final")], got
        assert got[0]["status"] == "INTERNAL" and "could not be sent (ValueError)" in got[0]["message"]
        assert "could not be sent (WireError)" in got[1]["message"]
    finally:
        conn.close()
        theirs.close()
