"""Launcher defaults without a server: the operator key file, Triton's restriction flags, the
per-server shared-memory region names and the private socket of Triton's own HTTP. The HTTP
door's parsing: tests/test_front_parsing.py."""

from __future__ import annotations

import http.server
import os
import shutil
import socketserver
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from neopp.launcher.admin import FRONT_HEADER, KEY_ENV, KEY_HEADER, AdminKeyError, load_or_create_key, restriction_args
from neopp.launcher.inner_http import call, clear_socket, private_address, remove_private, socket_path
from neopp.launcher.key_shim import HiddenKeys, build, compiler, private_build_dir
from neopp.launcher.serve_options import API_KEY_ENV
from neopp.launcher.shm_regions import backend_args, new_prefix, regions, remove_regions
from neopp.launcher.supervisor import without_keys


def test_key_file_is_created_private_once(tmp_path: Path) -> None:
    path = tmp_path / "build" / "admin.key"
    key, where = load_or_create_key(path, env={})
    assert where == str(path) and len(key) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create_key(path, env={})[0] == key  # kept across starts


def test_key_from_env_wins_and_bad_files_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "admin.key"
    assert load_or_create_key(path, env={KEY_ENV: "x" * 20}) == ("x" * 20, f"${KEY_ENV}")
    assert not path.exists()
    path.write_text("y" * 20)
    os.chmod(path, 0o644)
    with pytest.raises(AdminKeyError, match="readable"):
        load_or_create_key(path, env={})
    os.chmod(path, 0o600)
    path.write_text("short")
    with pytest.raises(AdminKeyError):
        load_or_create_key(path, env={})


def test_restriction_flags_cover_admin_apis_on_both_protocols() -> None:
    args = restriction_args("k" * 20, "f" * 20)
    http = [a for a in args if a.startswith("--http-restricted-api=")]
    grpc = [a for a in args if a.startswith("--grpc-restricted-protocol=")]
    assert len(grpc) == 1 and grpc[0].endswith(f":{KEY_HEADER}={'k' * 20}")
    for api in ("model-repository", "shared-memory", "model-config"):
        assert api in grpc[0] and api in http[0]
    assert "inference" not in grpc[0] and "inference" not in http[0]
    assert http[1].endswith(f":{FRONT_HEADER}={'f' * 20}") and "inference" in http[1]


def test_regions_are_found_by_their_own_prefix_only(tmp_path: Path) -> None:
    mine, other = new_prefix(), new_prefix()
    assert mine != other and len(mine) == len(other)
    for name in (f"{mine}a", f"{mine}b", f"{other}a", "triton_python_backend_shm_region_x"):
        (tmp_path / name).write_bytes(b"x")
    assert [p.name for p in regions(mine, tmp_path)] == [f"{mine}a", f"{mine}b"]
    assert remove_regions(mine, tmp_path) == [f"{mine}a", f"{mine}b"]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([f"{other}a", "triton_python_backend_shm_region_x"])
    assert regions("triton_python_backend_shm_region_", tmp_path) == []  # never a foreign prefix
    assert backend_args(mine)[0] == f"--backend-config=python,shm-region-prefix-name={mine}"


class _Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        self.send_response(200 if self.path == "/v2/health/ready" else 404)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: object) -> None:
        pass


class _UnixHTTPServer(socketserver.UnixStreamServer):
    def get_request(self):  # BaseHTTPRequestHandler wants a client address it can print
        sock, _ = super().get_request()
        return sock, ("local", 0)


def test_inner_http_is_a_socket_in_a_private_directory() -> None:
    address = private_address()
    path = socket_path(address)
    try:
        assert address.startswith("unix:") and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        with _UnixHTTPServer(str(path), _Ready) as server:
            thread = threading.Thread(target=server.serve_forever, daemon=True)
            thread.start()
            try:
                assert call(address, "GET", "/v2/health/ready", timeout=5) == (200, b"ok")
                assert call(address, "GET", "/elsewhere", timeout=5)[0] == 404
            finally:
                server.shutdown()
                thread.join(timeout=5)
        clear_socket(address)  # what a restart does before it binds again
        assert not path.exists() and path.parent.exists()
        with pytest.raises(OSError):
            call(address, "GET", "/v2/health/ready", timeout=5)  # no server: an OSError, never a hang
    finally:
        remove_private(address)
    assert not path.parent.exists()


def test_remove_private_touches_only_its_own_directories(tmp_path: Path) -> None:
    other = tmp_path / "http"
    other.write_text("")
    remove_private(f"unix:{other}")
    remove_private("127.0.0.1:8000")
    assert other.exists()


def test_server_environment_drops_the_keys() -> None:
    env = without_keys({KEY_ENV: "a" * 20, API_KEY_ENV: "b" * 20, "PATH": "/bin"})
    assert env == {"PATH": "/bin"}


ARGV_PROBE = "import os, sys; print(repr(sys.argv[1:])); print(open(f'/proc/{os.getpid()}/cmdline').read())"


def _probe(hidden: HiddenKeys, args: list[str], keep_pipe: bool = True) -> subprocess.CompletedProcess:
    env = hidden.env({k: v for k, v in os.environ.items() if k != "LD_PRELOAD"})
    try:
        return subprocess.run([sys.executable, "-c", ARGV_PROBE, *args], env=env, capture_output=True, text=True,
                              pass_fds=hidden.pass_fds if keep_pipe else (), timeout=60)
    finally:
        hidden.started()


@pytest.mark.skipif(compiler() is None, reason="no C compiler: the keys go on the command line (documented)")
def test_keys_reach_argv_but_not_the_command_line() -> None:
    directory = private_build_dir()
    try:
        hidden = HiddenKeys(build(directory))
        admin, api = hidden.mark("k" * 20), hidden.mark("a" * 20)
        done = _probe(hidden, [f"--x=apis:neopp-admin-key={admin}", f"--y=inference:authorization=Bearer {api}",
                               f"--z={admin}"])
        argv, shown = done.stdout.splitlines()[:2]
        want = [f"--x=apis:neopp-admin-key={'k' * 20}", f"--y=inference:authorization=Bearer {'a' * 20}",
                f"--z={'k' * 20}"]
        assert done.returncode == 0 and argv == repr(want), done.stderr
        assert "k" * 20 not in shown and "a" * 20 not in shown and admin in shown
        lost = HiddenKeys(hidden.library)
        assert _probe(lost, [f"--x={lost.mark('k' * 20)}"], keep_pipe=False).returncode == 70  # fails closed
        stray = HiddenKeys(hidden.library)
        stray.mark("k" * 20)
        assert _probe(stray, ["--x=@NEOPP_KEY_0000000000000000@"]).returncode == 70  # a marker left: no start
    finally:
        shutil.rmtree(directory)


def test_metrics_listen_on_ipv4_beside_an_ipv6_bind() -> None:
    """Triton's metrics take IPv4 only; given ``::1`` they listened on 255.255.255.255, so the
    watchdog's traffic poll and the door's /metrics were refused."""
    from neopp.launcher.tritonserver import metrics_client_host, metrics_host

    assert [metrics_host(host) for host in ("127.0.0.1", "0.0.0.0", "::1", "::", "fd00::5")] == \
        ["127.0.0.1", "0.0.0.0", "127.0.0.1", "0.0.0.0", "127.0.0.1"]
    assert [metrics_client_host(host) for host in ("0.0.0.0", "::", "::1", "10.1.2.3")] == \
        ["127.0.0.1", "127.0.0.1", "127.0.0.1", "10.1.2.3"]


def test_the_launcher_maps_large_buffers_on_their_own() -> None:
    """glibc otherwise serves them from arenas that a run of large requests fragments for good."""
    code = "from neopp.launcher.allocator import return_large_buffers as r; import sys; sys.exit(0 if r() else 1)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0, "mallopt refused"
