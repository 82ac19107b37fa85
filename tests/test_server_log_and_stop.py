"""The rules behind a clean log and a quick stop, without a server: which lines are relabelled
on a host without GPUs, which options are added, how a stub finds its server's gRPC port,
and when the stop watch fires (only on the server's own "exiting" answer)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
import time

from tritonclient.utils import InferenceServerException

from neopp.launcher.server_log import LogRelay, cpu_only_args, relabel
from neopp.procs import own_server_grpc_url, server_option
from neopp.serving.stop_watch import StopWatch, server_exiting

CUDA_HELPER = b'E1130 08:08:18.667909 18454 server.cc:241] "CudaDriverHelper has not been initialized."\n'
PINNED = (b'W1130 08:10:12.722649 18919 pinned_memory_manager.cc:170] "failed to allocate pinned system memory: '
          b'no pinned memory pool, falling back to non-pinned system memory"\n')


def test_only_the_expected_cpu_only_lines_are_relabelled() -> None:
    for line in (CUDA_HELPER, PINNED):
        out = relabel(line)
        assert out.startswith(b"I1130 ") and out[1:].startswith(line[1:-1]) and b"without an NVIDIA driver" in out
    other = b'E1130 08:08:18.667909 18454 model_lifecycle.cc:1] "failed to load model"\n'
    assert relabel(other) == other
    quoted = b"a model printed: CudaDriverHelper has not been initialized.\n"  # not Triton's own line
    assert relabel(quoted) == quoted


def test_relay_copies_every_line_in_order() -> None:
    read_fd, write_fd = os.pipe()
    sink = io.BytesIO()
    sink.close = lambda: None  # keep the buffer readable after the relay ends
    relay = LogRelay(open(read_fd, "rb"), sink, relabel_cpu_only=True)
    with open(write_fd, "wb") as w:
        w.write(b"first\n" + CUDA_HELPER + b"last line without newline")
    assert relay.join(timeout=10)
    lines = sink.getvalue().splitlines(keepends=True)
    assert lines[0] == b"first\n" and lines[1].startswith(b"I1130") and lines[2] == b"last line without newline"


def test_cpu_only_options_never_override_the_callers() -> None:
    assert cpu_only_args([]) == ["--allow-gpu-metrics=false", "--pinned-memory-pool-byte-size=0"]
    assert cpu_only_args(["--pinned-memory-pool-byte-size=1024"]) == ["--allow-gpu-metrics=false"]


def test_server_options_and_the_grpc_url_of_a_stubs_parent() -> None:
    argv = ["tritonserver", "--grpc-port=9001", "--grpc-address", "0.0.0.0", "--grpc-port", "9002"]
    assert server_option(argv, "grpc-port") == "9002" and server_option(argv, "http-port") is None
    # A child whose parent is a process with a tritonserver-like command line.
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.run([sys.executable, "
                               "'-c', 'import time; time.sleep(30)'])", "--grpc-address=10.1.2.3",
                               "--grpc-port=7001"])
    try:
        deadline = time.monotonic() + 30
        child = None
        while child is None and time.monotonic() < deadline:
            kids = open(f"/proc/{parent.pid}/task/{parent.pid}/children").read().split()
            child = int(kids[0]) if kids else None
            time.sleep(0.05)
        assert child is not None
        assert own_server_grpc_url(child) == "10.1.2.3:7001"
    finally:
        parent.kill()
        parent.wait()


class FakeServerClient:
    """Answers is_server_ready as a tritonclient.grpc client would; ``answer`` is set by the test."""

    def __init__(self) -> None:
        self.answer: Exception | None = None

    def is_server_ready(self, client_timeout: float | None = None) -> bool:
        if self.answer is not None:
            raise self.answer
        return True


def test_only_the_servers_exiting_answer_counts_as_a_stop() -> None:
    client = FakeServerClient()
    assert not server_exiting(client)
    client.answer = InferenceServerException("failed to connect to all addresses", status="StatusCode.UNAVAILABLE")
    assert not server_exiting(client)  # still loading, or restarting: not a stop
    client.answer = InferenceServerException("Deadline Exceeded", status="StatusCode.DEADLINE_EXCEEDED")
    assert not server_exiting(client)  # a busy machine: not a stop
    client.answer = InferenceServerException("Server exiting", status="StatusCode.UNAVAILABLE")
    assert server_exiting(client)


def test_stop_watch_fires_once_and_closes() -> None:
    stopping, calls = threading.Event(), []
    watch = StopWatch(stopping.is_set, lambda: calls.append(1), poll_s=0.01)
    time.sleep(0.05)
    assert calls == [] and not watch.stopped.is_set()
    stopping.set()
    assert watch.stopped.wait(10)
    time.sleep(0.05)
    watch.close()
    assert calls == [1]
    quiet = StopWatch(lambda: False, lambda: calls.append(2), poll_s=0.01)
    quiet.close()
    assert calls == [1]


def test_load_rescue_stops_only_the_stubs_of_a_load_triton_abandoned() -> None:
    from neopp.launcher.load_rescue import StuckLoadWatch

    sleepers = {m: [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) for _ in range(n)]
                for m, n in (("neopp_dense", 1), ("neopp_dense_cfg", 1), ("neopp_moe", 2), ("neopp_session", 1),
                             ("neopp_prompt_encoder", 2), ("neopp_t2i", 1))}
    now = [0.0]
    notes: list[str] = []
    watch = StuckLoadWatch(0, log=notes.append, stuck_s=30, clock=lambda: now[0],
                           stubs=lambda _server, model: [p.pid for p in sleepers[model] if p.poll() is None])

    def line(text: str) -> None:
        watch.feed(f'I1130 08:33:42.977839 5369 {text}\n'.encode())

    try:
        for model in sleepers:
            line(f'model_lifecycle.cc:472] "loading: {model}:1"')
        line('engine_start.py:60] "neopp_dense: loaded /ckpt mode=neopp_dense device=cpu"')  # abandoned by Triton
        line("model_lifecycle.cc:839] \"successfully loaded 'neopp_dense_cfg'\"")  # relayed before our line
        line('engine_start.py:60] "neopp_dense_cfg: loaded /ckpt mode=neopp_dense_parallel_cfg"')
        line('engine_start.py:60] "neopp_moe: loaded /ckpt mode=neopp_moe"')  # one of two instances
        line('session_model.py:174] "neopp_session: sessions max=1024 idle timeout=600s"')
        line("model_lifecycle.cc:839] \"successfully loaded 'neopp_session'\"")
        line('prompt_encoder_model.py:91] "neopp_prompt_encoder: loaded /ckpt device=cpu kv_dims=(3, 2, 48)"')
        line('prompt_encoder_model.py:96] "neopp_prompt_encoder (neopp_prompt_encoder_0_1): hands its requests to '
             'the tower of its first instance"')  # both instances done, abandoned
        line('t2i_model.py:87] "neopp_t2i: encoder neopp_prompt_encoder, default model neopp_dense"')  # abandoned
        now[0] = 29.0
        assert watch.check() == []  # not yet
        now[0] = 31.0
        assert sorted(watch.check()) == sorted(watch.rescued) == ["neopp_dense", "neopp_prompt_encoder", "neopp_t2i"]
        assert all(p.wait(timeout=30) == -9 for m in ("neopp_dense", "neopp_prompt_encoder", "neopp_t2i")
                   for p in sleepers[m])
        assert all(p.poll() is None for m in ("neopp_dense_cfg", "neopp_moe", "neopp_session") for p in sleepers[m])
        assert len(notes) == 3 and all(n.startswith("W ") for n in notes)
        now[0] = 100.0
        assert watch.check() == []  # handled once
    finally:
        for procs in sleepers.values():
            for p in procs:
                p.kill()
                p.wait()
