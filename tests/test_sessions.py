"""The session table of neopp_session without a server: seeding, continuation, bounds, expiry."""

from __future__ import annotations

import pytest

from neopp.contract.statuses import SESSIONS_FULL, status_of_message
from neopp.errors import ConfigError
from neopp.serving.error_status import error_class, refusal
from neopp.serving.sessions import SessionsFull, SessionTable, UnknownSession


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now



def said(exc: BaseException) -> str:
    """The message a client reads for ``exc``."""
    return refusal(exc, lambda _: None, "m")[2]

def table(max_sessions: int = 4, idle: float = 10.0, clock: Clock | None = None) -> SessionTable:
    return SessionTable(max_sessions, idle, default_seed=7, clock=clock or Clock())


def test_first_turn_seeded_then_continues_then_restarts_on_seed() -> None:
    t = table()
    s = t.start(1, seed=200)
    assert t.next_turn(s, None).seed == 200
    assert t.commit(s, b"state-a", "neopp_dense") == 0
    p = t.next_turn(t.get(1), None)
    assert (p.seed, p.rng_state) == (None, b"state-a")
    assert t.commit(s, b"state-b", "neopp_dense") == 1
    assert t.next_turn(s, 201).seed == 201 and t.next_turn(s, 201).rng_state is None


def test_first_turn_without_seed_uses_default_and_failed_turn_changes_nothing() -> None:
    t = table()
    s = t.start(5)
    assert t.next_turn(s, None).seed == 7
    assert t.next_turn(t.get(5), None).seed == 7  # nothing committed: the retry draws the same noise
    assert s.turn == 0


def test_unknown_and_ended_sessions_are_refused_with_the_reason() -> None:
    t = table()
    with pytest.raises(UnknownSession, match="sequence_id 9: unknown session .*never started"):
        t.get(9)
    t.start(9)
    t.end(9)
    assert 9 not in t and len(t) == 0
    with pytest.raises(UnknownSession, match="ended with sequence_end"):
        t.get(9)


def test_idle_sessions_expire() -> None:
    clock = Clock()
    t = table(idle=10.0, clock=clock)
    t.start(1)
    clock.now = 5.0
    t.start(2)
    clock.now = 12.0
    t.get(2)  # 7 s idle: kept; session 1 (12 s idle) goes
    assert 1 not in t and 2 in t
    with pytest.raises(UnknownSession, match="expired after 10 s idle"):
        t.get(1)


def test_a_full_table_refuses_new_sessions_and_never_drops_a_held_one() -> None:
    clock = Clock()
    t = table(max_sessions=3, idle=10.0, clock=clock)
    for sid in range(3):
        clock.now += 1
        t.start(sid)  # last used at 1, 2, 3
    clock.now = 4.5
    for sid in range(3, 50):  # a flood of new sessions
        with pytest.raises(SessionsFull, match=r"^all max_sessions=3 .* retry after 7 s") as info:
            t.open(sid)
        assert info.value.retry_after_s == 7 and error_class(info.value) is SESSIONS_FULL
        assert said(info.value).startswith("session limit reached: all max_sessions=3 ")
    assert t.refused_total == 47 and len(t) == 3
    assert all(t.get(sid).session_id == sid for sid in range(3))  # every held session is still served


def test_a_session_idle_past_the_timeout_makes_room() -> None:
    clock = Clock()
    t = table(max_sessions=2, idle=10.0, clock=clock)
    t.start(1)
    clock.now = 5.0
    t.start(2)
    clock.now = 10.0
    with pytest.raises(SessionsFull, match="retry after 1 s"):
        t.open(3)  # session 1 is idle for exactly the timeout: not past it
    clock.now = 10.5
    assert t.commit(t.open(3, seed=4), b"s", "neopp_dense") == 0
    assert 1 not in t and {2, 3} <= set(t._sessions)
    with pytest.raises(UnknownSession, match="expired after 10 s idle"):
        t.get(1)
    t.start(2)  # a restarted id takes its own place, never a new one
    assert len(t) == 2


def test_the_door_answers_a_full_table_with_429_and_its_retry_after() -> None:
    import grpc

    from neopp.launcher.door.upstream import grpc_error

    t = table(max_sessions=1, idle=600.0)
    t.start(1)
    with pytest.raises(SessionsFull) as info:
        t.open(2)
    message = f"[request id: <id_unknown>] {said(info.value)}"  # as Triton sends it
    assert status_of_message(message) == "UNAVAILABLE"  # what gRPC clients see
    answer = grpc_error(grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                             details=message))
    assert answer.status == 429 and answer.headers == {"Retry-After": "601"}


def test_restarting_an_id_starts_over() -> None:
    t = table()
    s = t.start(3, seed=1)
    t.commit(s, b"x", "m")
    s2 = t.start(3, seed=2)
    assert s2.turn == 0 and t.next_turn(s2, None).seed == 2 and len(t) == 1


def test_bad_bounds_are_configuration_errors() -> None:
    with pytest.raises(ConfigError, match="max_sessions"):
        SessionTable(0, 1.0, 0)
    with pytest.raises(ConfigError, match="session_idle_timeout_s"):
        SessionTable(1, 0.0, 0)


@pytest.mark.parametrize("message,status", [
    ("INDEX_OFFSET_COND: -1 is out of range 0..1000000", "INVALID_ARG"),
    ("SEED/RNG_STATE: must have shape", "INVALID_ARG"),
    ("[request id: <id_unknown>] unexpected shape for input 'COND_KV' for model 'neopp_dense'", "INVALID_ARG"),
    ("request cancelled: cancelled before step 2 of 3", "CANCELLED"),
    ("internal error: RuntimeError: boom", "INTERNAL"),
    ("model configuration error: mode x", "INTERNAL"),
    ("Request for unknown model: 'nope' is not found", "NOT_FOUND"),
    ("Stub process 'neopp_dense_0_0' is not healthy.", "UNAVAILABLE"),  # retried once the model is back
    ("the engine of neopp_dense went away (the other end closed the connection); retry the request", "UNAVAILABLE"),
    ("neopp_dense: its requests run on the engine of neopp_dense, which does not answer (refused); load it",
     "UNAVAILABLE"),
    ("unexpected shape for input 'the engine of x went away' for model 'neopp_dense'", "INVALID_ARG"),
])
def test_bls_error_status_recovers_the_generation_models_status(message: str, status: str) -> None:
    assert status_of_message(message) == status


def test_a_first_turn_is_held_only_once_it_delivers() -> None:
    t = table(max_sessions=2)
    t.start(1)
    fresh = t.open(2, seed=5)  # its first turn is running: nothing counted yet
    assert len(t) == 1 and 2 not in t
    assert t.commit(fresh, b"s", "neopp_dense") == 0  # delivered: held
    assert 2 in t and 1 in t and len(t) == 2


def test_error_classes_give_each_refusal_its_status_and_prefix() -> None:
    from neopp.contract.statuses import CANCELLED, INTERNAL, INVALID_INPUT, MISCONFIGURED, NOT_FOUND
    from neopp.errors import ConfigError, GenerationCancelled, InputError

    cases = [(InputError("PROMPT: too long"), INVALID_INPUT, "PROMPT: too long"),
             (UnknownSession("sequence_id 3: unknown session"), NOT_FOUND, "sequence_id 3: unknown session"),
             (GenerationCancelled("before step 2"), CANCELLED, "request cancelled: before step 2"),
             (ConfigError("mode x"), MISCONFIGURED, "model configuration error: mode x"),
             (RuntimeError("boom"), INTERNAL, "internal error: RuntimeError: boom")]
    for exc, cls, text in cases:
        logged: list[str] = []
        assert error_class(exc) is cls and refusal(exc, logged.append, "m") == (cls.status, cls.reason, text)
        assert status_of_message(text) == cls.status
        assert (logged != []) == (cls is INTERNAL)  # an internal error's traceback goes to the log


def test_slots_release_dropped_sequences_only_under_pressure() -> None:
    from neopp.serving.sessions import SequenceSlots

    clock = Clock()
    slots = SequenceSlots(capacity=4, reserve=1, idle_s=100.0, clock=clock)
    for sid in (1, 2, 3):
        slots.seen(sid, end=False)
    assert slots.to_release(live={3}) == []  # 3 held, threshold 3: a dropped session keeps its slot
    slots.seen(4, end=False)
    assert slots.to_release(live={3, 4}) == [1]  # the least recently used dropped one
    slots.seen(2, end=True)  # ended by its client: Triton freed it
    assert len(slots) == 2 and slots.to_release(live=set()) == []
    clock.now += 101  # Triton's idle bound freed the rest
    assert slots.to_release(live=set()) == [] and len(slots) == 0
    with pytest.raises(ConfigError, match="max_candidate_sequences"):
        SequenceSlots(capacity=1, reserve=1, idle_s=1.0)
