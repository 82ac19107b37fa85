"""Run the real Triton Inference Server bundled in the ``nvidia-pytriton`` wheel.

The wheel ships tritonserver 2.51 plus the Python backend, but the backend only
starts cleanly with three fixes (see docs/local-triton.md): a backend directory that
holds the stub for this interpreter next to ``libtriton_python.so``, an
``LD_LIBRARY_PATH`` that puts the interpreter's own ``LIBDIR`` first, and the
virtual environment's ``bin`` first on ``PATH``. This module does all three,
starts the server on chosen (or free) ports, waits for readiness with a bound,
and stops exactly the processes it started. ``python -m neopp.launcher`` is its command line.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from ..ports import LOOPBACK, free_ports
from ..procs import process_group_members
from .admin import FRONT_HEADER, KEY_HEADER, restriction_args
from .inner_http import UNIX, call, clear_socket
from .key_shim import HiddenKeys, build, private_build_dir
from .load_rescue import StuckLoadWatch
from .model_deps import with_engine_models
from .server_log import LogRelay, cpu_only_args, nvidia_driver_present
from .shm_regions import PREFIX_HEAD, backend_args, new_prefix, private_regions, remove_orphans, remove_regions
from .triton_install import TritonLaunchError, find_install, prepare_backend_dir, server_env

# What a large gRPC request leaves behind, even one Triton refuses (docs/security.md has the
# figures). Triton keeps up to 8 request objects for reuse (--grpc-infer-allocation-pool-size),
# and a reused protobuf message keeps the capacity of its largest input: 8 x the largest request
# seen. With no pool, the buffers are freed, but glibc's defaults keep them in its arenas (its
# mmap threshold rises to 32 MiB after the first large free). A fixed 64 KiB threshold makes
# each larger buffer its own mapping, unmapped on free; one arena, no top pad and a 128 KiB trim
# threshold return the rest (MALLOC_ENV, in triton_install). Tritonserver gets both; a generation
# model's stub undoes the malloc part at load (procs.restore_malloc_defaults): there it cost 20-25%
# of a denoising step.
GRPC_POOL_ARG = "--grpc-infer-allocation-pool-size"


try:  # resolved here, not in the forked child, where dlopen's lock could be held by another thread
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: stop() remains the way out
    _PRCTL = None


def _console() -> IO[bytes]:
    """Our standard output as a binary file of its own (closing it leaves ours open)."""
    try:
        return open(os.dup(sys.stdout.fileno()), "wb", buffering=0)
    except (AttributeError, OSError, ValueError):  # a captured stdout without a descriptor
        return open(os.devnull, "wb")


def _terminate_with_parent() -> None:
    """In the child before exec: ask Linux for SIGTERM when the launching thread exits."""
    if _PRCTL is not None:
        _PRCTL(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG


def metrics_host(host: str) -> str:
    """Where Triton's metrics listen for a server bound to ``host``. They take IPv4 only (given an
    IPv6 address, Triton 2.51 listens on 255.255.255.255), so an IPv6 bind gets its IPv4 twin: every
    address for ``::``, loopback for any other."""
    if ":" not in host:
        return host
    return "0.0.0.0" if host == "::" else LOOPBACK


def metrics_client_host(host: str) -> str:
    """Where a local client reaches those metrics (a wildcard bind over loopback)."""
    bound = metrics_host(host)
    return LOOPBACK if bound in ("0.0.0.0", "") else bound


def grpc_socket_target(address: str) -> str:
    """Where Triton's gRPC on ``unix:<path>`` listens: it appends ``:<port>`` (0) to the name."""
    return f"{address}:0"


class TritonServer:
    """One tritonserver process: start, wait ready, stop. Usable as a context manager."""

    def __init__(self, model_repository: Path | str, http_port: int | None = None,
                 grpc_port: int | None = None, metrics_port: int | None = None, host: str = LOOPBACK,
                 backend_dir: Path | str | None = None, extra_args: Sequence[str] = (),
                 env: dict[str, str] | None = None, log_path: Path | str | None = None,
                 admin_key: str | None = None, front_key: str | None = None,
                 http_address: str | None = None, shm_sizes: tuple[int, int] | None = None,
                 malloc_env: dict[str, str] | None = None, api_key: str | None = None, nice: int = 0,
                 grpc_address: str | None = None) -> None:
        """Ports left as None are picked free; ``env`` is the base environment (default: ours).

        ``admin_key`` restricts the administrative APIs (neopp.launcher.admin); ``front_key`` makes
        Triton's own HTTP port answer only requests relayed by the HTTP front, which binds the
        public address while Triton's HTTP listens on ``http_address`` (``unix:<path>``: a socket,
        which the launcher keeps in a private directory instead of using a front key;
        neopp.launcher.inner_http). ``shm_sizes`` (first size,
        growth step) sizes the Python backend's regions; each server gets its own region prefix.
        ``malloc_env`` replaces MALLOC_ENV (``{}``: glibc's defaults, to compare). ``api_key`` (with
        ``admin_key``): gRPC inference needs it (neopp.launcher.admin). ``nice``: the server's (and
        so its stubs') niceness above ours, so that the launcher's door answers first on a busy CPU.
        ``grpc_address`` (``unix:<path>``): Triton's gRPC on a socket (Triton names it ``<path>:0``)
        instead of ``host:grpc_port``, for the launcher's gRPC front alone.
        """
        self.model_repository = Path(model_repository).resolve()
        self._given = (env, malloc_env)
        free = iter(free_ports(3))
        self.http_port = http_port or next(free)
        self.grpc_port = grpc_port or next(free)
        self.metrics_port = metrics_port or next(free)
        self.host = host
        self.install = find_install()
        self.backend_dir = prepare_backend_dir(backend_dir, self.install)
        self.extra_args = list(extra_args)
        self.env = server_env(self.install, env, malloc_env)
        self.log_path = Path(log_path) if log_path else None
        self.admin_key, self.front_key, self.api_key = admin_key, front_key, api_key
        self.http_address = http_address or host
        self.grpc_address = grpc_address
        self.shm_prefix = new_prefix()
        self._private_regions = private_regions()  # built here: the child only installs it
        self.shm_sizes = shm_sizes
        self.removed_regions: list[str] = []
        self.gpu_host = nvidia_driver_present()  # else: CPU-only options, and the log relabels one line
        self.nice = nice
        self.process: subprocess.Popen | None = None
        self._log_file: IO[bytes] | None = None
        self._relay: LogRelay | None = None
        self.load_watch: StuckLoadWatch | None = None
        self._shim_dir: Path | None = None

    def successor(self) -> TritonServer:
        """A server with the same settings on the same ports: this one started again, once stopped."""
        env, malloc_env = self._given
        return TritonServer(self.model_repository, self.http_port, self.grpc_port, self.metrics_port, self.host,
                            self.backend_dir, self.extra_args, env, self.log_path, self.admin_key, self.front_key,
                            self.http_address, self.shm_sizes, malloc_env, self.api_key, self.nice,
                            self.grpc_address)

    @property
    def client_host(self) -> str:
        """Address a local client dials (a wildcard bind is reached over loopback)."""
        return LOOPBACK if self.host in ("0.0.0.0", "") else self.host

    @property
    def http_target(self) -> str:
        """Where the launcher reaches Triton's own HTTP: ``host:port`` or ``unix:<path>``."""
        if self.http_address.startswith(UNIX):
            return self.http_address
        host = LOOPBACK if self.http_address in ("0.0.0.0", "", "::") else self.http_address
        return f"{host}:{self.http_port}"

    def http_headers(self) -> dict[str, str]:
        """What Triton's own HTTP wants of the launcher: the front key, the operator key."""
        headers = {FRONT_HEADER: self.front_key} if self.front_key else {}
        headers.update({KEY_HEADER: self.admin_key} if self.admin_key else {})
        return headers

    @property
    def http_url(self) -> str:
        return f"{self.client_host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        if self.grpc_address is not None:
            return grpc_socket_target(self.grpc_address)
        return f"{self.client_host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{metrics_client_host(self.host)}:{self.metrics_port}/metrics"

    def _grpc_args(self) -> list[str]:
        if self.grpc_address is not None:  # a socket: Triton appends ":<port>" to its name
            return [f"--grpc-address={self.grpc_address}", "--grpc-port=0"]
        return [f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}"]

    def command(self, hidden: HiddenKeys | None = None) -> list[str]:
        """The full tritonserver argv (no pool of gRPC request objects unless ``extra_args`` sets one);
        with ``hidden``, markers stand for the keys (neopp.launcher.key_shim)."""
        keys = (self.admin_key, self.front_key, self.api_key)
        if hidden is not None:
            keys = tuple(hidden.mark(key) for key in keys)
        return [str(self.install.server_bin), f"--model-repository={self.model_repository}",
                f"--backend-directory={self.backend_dir}",
                f"--http-address={self.http_address}", f"--http-port={self.http_port}",
                *self._grpc_args(),
                f"--metrics-address={metrics_host(self.host)}", f"--metrics-port={self.metrics_port}",
                *backend_args(self.shm_prefix, *(self.shm_sizes or ())),
                *(restriction_args(*keys) if self.admin_key else []),
                *([] if any(a.startswith(GRPC_POOL_ARG) for a in self.extra_args) else [f"{GRPC_POOL_ARG}=0"]),
                *([] if self.gpu_host else cpu_only_args(self.extra_args)),
                *with_engine_models(self.extra_args, self.model_repository)]

    def start(self) -> TritonServer:
        """Launch in its own process group so its stubs can be found and stopped with it.

        The server also gets SIGTERM if the thread that started it dies (Linux parent-death
        signal), so a launcher killed hard does not leave a server behind. Its output (and its
        stubs') goes through a ``LogRelay`` to the log file, else to our standard output.
        """
        if self.process is not None:
            raise TritonLaunchError("server already started")
        remove_orphans((PREFIX_HEAD,))  # regions of servers whose owner was killed, and only those
        clear_socket(self.http_address)  # the sockets of the server this one replaces
        clear_socket(self.grpc_url)
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = open(self.log_path, "ab")
        else:
            self._log_file = _console()
        hidden = self._hidden_keys()
        argv = self.command(hidden)  # the markers first, then the pipe that carries their keys
        env = self.env if hidden is None else hidden.env(self.env)
        try:
            self.process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True, preexec_fn=self._child_setup,
                                            pass_fds=() if hidden is None else hidden.pass_fds)
        finally:
            if hidden is not None:
                hidden.started()
        self.load_watch = StuckLoadWatch(self.process.pid, log=lambda text: self._relay.note(text))
        self._relay = LogRelay(self.process.stdout, self._log_file, relabel_cpu_only=not self.gpu_host,
                               on_line=self.load_watch.feed)
        self.load_watch.start()
        if self.admin_key and hidden is None:
            self._relay.note("W neopp: no C compiler, so tritonserver's command line holds the keys of its "
                             "restricted APIs (docs/security.md)")
        return self

    def _hidden_keys(self) -> HiddenKeys | None:
        """The keys' way past the command line, when there are keys and the library builds."""
        if not self.admin_key:
            return None
        self._shim_dir = private_build_dir()
        library = build(self._shim_dir)
        if library is None:
            shutil.rmtree(self._shim_dir, ignore_errors=True)
            self._shim_dir = None
            return None
        return HiddenKeys(library)

    def _child_setup(self) -> None:
        """In the child before exec: SIGTERM with the launching thread, regions that stay 0600, and
        its niceness (its stubs and ranks inherit it)."""
        _terminate_with_parent()
        self._private_regions()
        if self.nice > 0:
            os.nice(self.nice)

    def is_ready(self) -> bool:
        """True when GET /v2/health/ready answers 200."""
        try:
            return call(self.http_target, "GET", "/v2/health/ready", self.http_headers(), timeout=2)[0] == 200
        except OSError:
            return False

    def log_tail(self, chars: int = 6000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(server output not captured)"
        return self.log_path.read_bytes()[-chars:].decode("utf-8", "replace")

    def wait_ready(self, timeout: float = 300.0, poll: float = 0.25) -> None:
        """Block until ready; fail fast if the process exits, fail after ``timeout`` s."""
        if self.process is None:
            raise TritonLaunchError("server not started")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise TritonLaunchError(
                    f"tritonserver exited with code {self.process.returncode} before it was ready:\n"
                    + self.log_tail()
                )
            if self.is_ready():
                self.retry_rescued()
                return
            time.sleep(poll)
        raise TritonLaunchError(f"tritonserver not ready after {timeout:.0f}s:\n" + self.log_tail())

    def retry_rescued(self, timeout: float = 600.0) -> list[str]:
        """Load again every model whose abandoned load was rescued (neopp.launcher.load_rescue).

        Only a server that keeps going after a failed load (``--exit-on-error=false
        --strict-readiness=false``, as the launcher runs it) gets here with one.
        """
        if self.load_watch is None or self._relay is None:
            return []
        models, self.load_watch.rescued = list(self.load_watch.rescued), []
        for model in models:
            self._relay.note(f"I neopp load rescue: loading {model} again")
            try:
                status, body = call(self.http_target, "POST", f"/v2/repository/models/{model}/load",
                                    self.http_headers(), b"", timeout=timeout)
            except OSError as exc:
                status, body = 0, str(exc).encode()
            if status != 200:
                self._relay.note(f"W neopp load rescue: loading {model} again failed: "
                                 f"{status or ''} {body[:200].decode('utf-8', 'replace')}")
        return models

    def stop(self, timeout: float = 30.0, drain_s: float | None = None) -> int | None:
        """SIGTERM the server; after ``drain_s`` (default a third of ``timeout``) also its stubs,
        so generations still running stop between steps (Triton does not cancel them); SIGKILL
        after ``timeout``; then clear anything left in its group."""
        proc = self.process
        if proc is None:
            return None
        pgid = proc.pid  # start_new_session made the server its group leader
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            drain = timeout / 3 if drain_s is None else min(drain_s, timeout)
            try:
                proc.wait(timeout=drain)
            except subprocess.TimeoutExpired:
                for pid in process_group_members(pgid):
                    if pid != proc.pid:
                        try:
                            os.kill(pid, signal.SIGTERM)
                        except ProcessLookupError:
                            pass
                try:
                    proc.wait(timeout=timeout - drain)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        self._reap_group(pgid, timeout=10.0)
        self.removed_regions = remove_regions(self.shm_prefix)  # a stub killed hard leaves its region
        if self._shim_dir is not None:
            shutil.rmtree(self._shim_dir, ignore_errors=True)
            self._shim_dir = None
        if self.load_watch is not None:
            self.load_watch.close()
        if self._relay is not None:
            self._relay.join(timeout=10.0)  # every writer is gone: the rest of the output is copied
            self._relay = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return proc.returncode

    @staticmethod
    def _reap_group(pgid: int, timeout: float) -> None:
        """Stubs normally exit with the server; any that linger get SIGTERM, then SIGKILL."""
        deadline, sig = time.monotonic() + timeout, signal.SIGTERM
        while members := process_group_members(pgid):
            if time.monotonic() > deadline:
                if sig == signal.SIGKILL:
                    raise TritonLaunchError(f"processes {members} of tritonserver group survived SIGKILL")
                sig, deadline = signal.SIGKILL, time.monotonic() + 5.0
            for pid in members:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)

    def __enter__(self) -> TritonServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
