"""The launcher's one way to kill a stub, on real processes holding a real process-shared robust
mutex (the kind tritonserver shares with its Python stubs): never while a lock is held, at once
when none is, never resuming a process someone else stopped, never a process that replaced it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from neopp.launcher.stub_kill import holds_robust_lock, kill_stub
from neopp.procs import is_stopped, start_ticks
from testing.faults import wait_for

# A process that makes a robust, process-shared mutex in shared memory and locks or unlocks it on
# each line it reads ("lock" / "unlock"), answering "ok" once done.
HOLDER = textwrap.dedent("""
    import ctypes, mmap, sys
    libc = ctypes.CDLL(None)
    region = mmap.mmap(-1, 4096)
    mutex = ctypes.addressof(ctypes.c_char.from_buffer(region))
    attr = ctypes.create_string_buffer(64)
    libc.pthread_mutexattr_init(attr)
    libc.pthread_mutexattr_setpshared(attr, 1)
    libc.pthread_mutexattr_setrobust(attr, 1)
    assert libc.pthread_mutex_init(ctypes.c_void_p(mutex), attr) == 0
    print("ok", flush=True)
    for line in sys.stdin:
        call = libc.pthread_mutex_lock if line.strip() == "lock" else libc.pthread_mutex_unlock
        assert call(ctypes.c_void_p(mutex)) == 0
        print("ok", flush=True)
""")


@pytest.fixture()
def holder():
    proc = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "ok"
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait(timeout=30)


def _tell(proc: subprocess.Popen, what: str) -> None:
    proc.stdin.write(what + "\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "ok"


def test_the_kernel_lists_a_robust_lock_while_it_is_held(holder):
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        assert holds_robust_lock(holder.pid) is False
    finally:
        os.kill(holder.pid, signal.SIGCONT)
    _tell(holder, "lock")
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        assert holds_robust_lock(holder.pid) is True
    finally:
        os.kill(holder.pid, signal.SIGCONT)


def test_a_process_holding_a_shared_lock_is_not_killed_until_it_lets_go(holder):
    notes: list[str] = []
    started = start_ticks(holder.pid)
    _tell(holder, "lock")
    t0 = time.monotonic()
    assert kill_stub(holder.pid, started, notes.append, bound_s=0.5) is False
    assert time.monotonic() - t0 < 5
    assert holder.poll() is None and not is_stopped(holder.pid), "left running, as it was"
    assert "held a lock it shares with tritonserver" in notes[-1]
    _tell(holder, "unlock")  # it still answers: it was resumed after every look
    assert kill_stub(holder.pid, started, notes.append, bound_s=5.0) is True
    assert holder.wait(timeout=30) == -signal.SIGKILL


def test_a_process_someone_else_stopped_is_never_resumed(holder):
    notes: list[str] = []
    _tell(holder, "lock")
    os.kill(holder.pid, signal.SIGSTOP)  # stopped at once or a moment later: never resumed either way
    assert kill_stub(holder.pid, start_ticks(holder.pid), notes.append, bound_s=0.5) is False
    assert wait_for(lambda: is_stopped(holder.pid), 30, poll=0.01)
    assert is_stopped(holder.pid), "a stub Triton gave up on must not run again"
    assert "stopped holding a lock" in notes[-1]


def test_a_stopped_process_holding_nothing_is_killed_at_once(holder):
    os.kill(holder.pid, signal.SIGSTOP)
    assert kill_stub(holder.pid, start_ticks(holder.pid), print, bound_s=5.0) is True
    assert holder.wait(timeout=30) == -signal.SIGKILL


def test_a_verdict_about_one_process_never_reaches_another_with_its_pid(holder):
    """The identity is the pid and its start time: a process that is not the one judged is not touched."""
    assert kill_stub(holder.pid, start_ticks(holder.pid) - 1, print, bound_s=1.0) is True
    assert holder.poll() is None and not is_stopped(holder.pid)
