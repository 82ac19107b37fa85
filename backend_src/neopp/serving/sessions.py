"""Per-session noise streams of ``neopp_session``: the table, its bounds and expiry.

A session holds no tensors and no model: only the random stream where its last image left
it (the generation model's ``NEXT_RNG_STATE``), or the seed its next turn starts from. The
generation model receives that state as ``RNG_STATE``, so any instance of any generation
model can serve any turn.

A session belongs to whoever opened it: its first image comes with a token of 128 random bits,
and every later turn, the closing one included, must carry it (``authorize``). A sequence id is
a number anyone can guess; the token is not.

Bounds, so that clients that vanish without ``sequence_end`` cannot grow memory:

* ``idle_timeout_s``: a session unused for longer is dropped at the next request;
* ``max_sessions``: a new session is refused while that many are held (expired ones are dropped
  first), with the seconds until the least recently used one can expire (``SessionsFull``).
  A held session is never dropped to make room: a client that opens sessions without end
  cannot take another client's session away; it can only fill the table until its own
  sessions expire. A dropped session's later turn is refused with a message that says why (a
  bounded record of recently dropped ids is kept for that).

Pure Python (no Triton import), so the rules are testable without a server.
"""

from __future__ import annotations

import math
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Container, Hashable
from dataclasses import dataclass, field

from ..contract.statuses import NOT_FOUND, SESSIONS_FULL
from ..errors import ConfigError, InputError, NeoPPError

SessionId = Hashable
REMEMBERED_DROPPED = 4096  # ids of dropped sessions kept (id and reason only) to explain a refusal


# What a client whose session is gone can do: the stream it had is its last NEXT_RNG_STATE.
CONTINUE_ELSEWHERE = ("to continue the chat's stream exactly, send the last NEXT_RNG_STATE as RNG_STATE to a "
                      "generation model (stateless turns); or start a new session with sequence_start=True and "
                      "no SESSION_TOKEN")


class UnknownSession(InputError):
    """A turn of a session the table does not hold (never started, ended, expired)."""

    error_class = NOT_FOUND


class SessionsFull(NeoPPError):
    """Every session is held and none has been idle past the timeout: a new one must wait."""

    error_class = SESSIONS_FULL

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


TOKEN_INPUT = "SESSION_TOKEN"


def authorize(session: Session, token: str | None, internal: str | None = None) -> None:
    """Refuse a turn that does not carry the session's token (``internal``: the model's own)."""
    if token is None:
        raise InputError(f"{TOKEN_INPUT}: required for every turn after the first of session "
                         f"{session.session_id} (the first turn's {TOKEN_INPUT} output)")
    expected = [session.token] + ([internal] if internal else [])
    if not any(secrets.compare_digest(token.encode(), e.encode()) for e in expected):
        raise InputError(f"{TOKEN_INPUT}: does not match session {session.session_id}; the session is unchanged")


@dataclass
class Session:
    """What one chat session remembers between turns."""

    session_id: SessionId
    next_seed: int | None  # the next turn starts a stream from this seed (set at start / by SEED)
    rng_state: bytes | None = None  # else it continues this stream (the last NEXT_RNG_STATE)
    turn: int = 0  # TURN of the next delivered image
    model: str | None = None  # generation model of the last turn
    last_used: float = 0.0
    token: str = field(default_factory=lambda: secrets.token_hex(16))  # 128 bits, the owner's proof


@dataclass(frozen=True)
class TurnPlan:
    """How the generation model is asked to draw this turn's noise: exactly one is set."""

    seed: int | None
    rng_state: bytes | None


class SessionTable:
    """Sessions by id with an idle timeout and a maximum count; not thread-safe by design
    (a Python-backend instance runs one ``execute`` at a time)."""

    def __init__(self, max_sessions: int, idle_timeout_s: float, default_seed: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_sessions < 1:
            raise ConfigError(f"parameter max_sessions: must be >= 1, got {max_sessions}")
        if not idle_timeout_s > 0:
            raise ConfigError(f"parameter session_idle_timeout_s: must be > 0, got {idle_timeout_s}")
        self.max_sessions = int(max_sessions)
        self.idle_timeout_s = float(idle_timeout_s)
        self.default_seed = int(default_seed)
        self._clock = clock
        self._sessions: OrderedDict[SessionId, Session] = OrderedDict()  # least recently used first
        self._dropped: OrderedDict[SessionId, str] = OrderedDict()  # id -> why, bounded
        self.refused_total = 0
        self.expired_total = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: SessionId) -> bool:
        return session_id in self._sessions

    # ------------------------------------------------------------------ lifecycle

    def start(self, session_id: SessionId, seed: int | None = None) -> Session:
        """A fresh session (a restarted id starts over), seeded by ``seed`` or the default, held now."""
        session = self.open(session_id, seed)
        self._admit(session)
        return session

    def open(self, session_id: SessionId, seed: int | None = None) -> Session:
        """A fresh session for a first turn, held (and counted) only once ``commit`` records an image.

        A first turn that fails thus leaves nothing open and takes no place. A restarted id
        loses its old stream either way.
        """
        now = self._clock()
        self.expire(now)
        if session_id not in self._sessions:  # a restarted id gives up its own place
            self._check_room(now)
        self._sessions.pop(session_id, None)
        self._dropped.pop(session_id, None)
        return Session(session_id, next_seed=self.default_seed if seed is None else int(seed), last_used=now)

    def _check_room(self, now: float) -> None:
        """Refuse a new session while the table is full; expired sessions were dropped before."""
        if len(self._sessions) < self.max_sessions:
            return
        oldest = next(iter(self._sessions.values()))
        retry = max(1, math.floor(oldest.last_used + self.idle_timeout_s - now) + 1)  # strictly past the timeout
        self.refused_total += 1
        raise SessionsFull(  # the client reads it after SESSIONS_FULL's prefix (error_status.refusal)
            f"all max_sessions={self.max_sessions} sessions of this server are in use and none has been idle for "
            f"session_idle_timeout_s={self.idle_timeout_s:g} s; retry after {retry} s, or keep the chat's stream "
            "yourself (stateless turns: SEED, then NEXT_RNG_STATE as RNG_STATE, to a generation model)", retry)

    def _admit(self, session: Session) -> None:
        """Hold a session; a full table refuses it (no held session is ever dropped to make room)."""
        self._sessions.pop(session.session_id, None)
        now = self._clock()
        self.expire(now)
        self._check_room(now)
        self._sessions[session.session_id] = session

    def held(self, session_id: SessionId) -> Session | None:
        """The live session of this id, if any (expired ones are dropped first); no side effect else."""
        self.expire()
        return self._sessions.get(session_id)

    def why_gone(self, session_id: SessionId) -> str:
        return self._dropped.get(session_id, "never started here, already ended, or held by another replica")

    def get(self, session_id: SessionId) -> Session:
        """The session of a later turn, or UnknownSession saying why it is not there."""
        now = self._clock()
        self.expire(now)
        session = self._sessions.get(session_id)
        if session is None:
            raise UnknownSession(f"sequence_id {session_id}: unknown session ({self.why_gone(session_id)}); "
                                 f"{CONTINUE_ELSEWHERE}")
        self._sessions.move_to_end(session_id)
        session.last_used = now
        return session

    def end(self, session_id: SessionId) -> None:
        """Free a session's state (``sequence_end``); ending an absent id is not an error."""
        if self._sessions.pop(session_id, None) is not None:
            self._remember(session_id, "ended with sequence_end")

    def expire(self, now: float | None = None) -> list[SessionId]:
        """Drop every session idle for longer than the timeout; returns their ids."""
        now = self._clock() if now is None else now
        gone = []
        for sid, session in list(self._sessions.items()):  # LRU order: stop at the first fresh one
            if now - session.last_used <= self.idle_timeout_s:
                break
            del self._sessions[sid]
            gone.append(sid)
            self.expired_total += 1
            self._remember(sid, f"expired after {self.idle_timeout_s:g} s idle")
        return gone

    def _remember(self, session_id: SessionId, why: str) -> None:
        self._dropped[session_id] = why
        self._dropped.move_to_end(session_id)
        while len(self._dropped) > max(REMEMBERED_DROPPED, self.max_sessions):
            self._dropped.popitem(last=False)

    # ------------------------------------------------------------------ turns

    @staticmethod
    def next_turn(session: Session, seed: int | None) -> TurnPlan:
        """A turn's SEED restarts the stream; without one the session's stream continues."""
        if seed is not None:
            return TurnPlan(seed=int(seed), rng_state=None)
        if session.rng_state is not None:
            return TurnPlan(seed=None, rng_state=session.rng_state)
        return TurnPlan(seed=session.next_seed, rng_state=None)

    def commit(self, session: Session, next_rng_state: bytes, model: str) -> int:
        """Record a delivered image: the stream moves on, the turn counter too.

        Returns the TURN of that image. A failed turn is never committed, so it leaves the
        session exactly as it was (the next attempt draws the same noise).
        """
        turn = session.turn
        session.rng_state = bytes(next_rng_state)
        session.next_seed = None
        session.turn += 1
        session.model = model
        session.last_used = self._clock()
        if self._sessions.get(session.session_id) is not session:
            self._admit(session)  # a first turn: the session is held from its first image on
        return turn


class SequenceSlots:
    """Sequences Triton's sequence batcher holds a slot for, as this instance saw them.

    Triton frees a slot only at ``sequence_end`` or after ``max_sequence_idle_microseconds``;
    the table's expiry frees nothing there. So clients that start sessions and never end
    them would fill every slot and park each new start in Triton's backlog. ``to_release``
    names the least recently used sequences the table no longer holds once more than
    ``threshold`` are held; the model then ends them in Triton itself. A dropped session is
    kept in its slot until then, so its next turn still hears why it was dropped.
    """

    def __init__(self, capacity: int, reserve: int, idle_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if reserve < 1 or capacity <= reserve:
            raise ConfigError(f"max_candidate_sequences ({capacity}) must exceed its reserve of {reserve}")
        self.threshold = capacity - reserve
        self.idle_s = float(idle_s)
        self._clock = clock
        self._held: OrderedDict[SessionId, float] = OrderedDict()  # id -> last request, LRU first
        self._lock = threading.Lock()  # execute and the model's stop watch both read it
        self.released_total = 0

    def __len__(self) -> int:
        return len(self._held)

    def seen(self, session_id: SessionId, end: bool) -> None:
        """A request of this sequence reached the model (Triton holds its slot unless it ended)."""
        with self._lock:
            if end:
                self._held.pop(session_id, None)
                return
            self._held[session_id] = self._clock()
            self._held.move_to_end(session_id)

    def held(self) -> list[SessionId]:
        """Every sequence Triton holds a slot for, as far as this instance knows (oldest first)."""
        with self._lock:
            return list(self._held)

    def to_release(self, live: Container[SessionId]) -> list[SessionId]:
        """Ids to end now, oldest first; forgets those Triton's own idle bound has freed."""
        now = self._clock()
        with self._lock:
            for sid, last in list(self._held.items()):
                if now - last <= self.idle_s:
                    break
                del self._held[sid]
            out: list[SessionId] = []
            for sid in list(self._held):
                if len(self._held) <= self.threshold:
                    break
                if sid not in live:
                    del self._held[sid]
                    out.append(sid)
        self.released_total += len(out)
        return out
