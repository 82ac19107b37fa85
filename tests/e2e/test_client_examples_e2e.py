"""The client examples as a user runs them: a good request writes the image; a request the
server refuses, or no server at all, is one line on stderr and exit code 1, no traceback;
``--help`` shows a command that runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from neopp.ports import free_ports
from testing import REPO

CLIENTS = {"grpc_t2i.py": "grpc_url", "http_t2i.py": "http_url"}
STREAM_CLIENTS = {"stream_grpc.py": "grpc_url", "stream_http.py": "http_url"}


def _url(triton, which: str) -> str:
    """gRPC straight to Triton; HTTP through the door, as `make serve` serves it."""
    return triton.door_url if which == "http_url" else triton.server.grpc_url


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "client_examples" / script), *args], capture_output=True,
                          text=True, timeout=300, cwd=REPO)


def kv_args(triton) -> list[str]:
    kv = triton.checkpoint / "sample_kv"
    return ["--cond", str(kv / "cond_kv.pt"), "--offset-cond", "24", "--cfg-scale", "1", "--steps", "1"]


@pytest.mark.parametrize("script", sorted(CLIENTS))
def test_a_good_request_writes_the_image(triton, script: str, tmp_path: Path) -> None:
    url = _url(triton, CLIENTS[script])
    done = run(script, "--url", url, *kv_args(triton), "--size", "64", "64", "--out", str(tmp_path / "a.png"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("script", sorted(CLIENTS))
def test_a_refused_request_is_one_line_and_exit_code_1(triton, script: str, tmp_path: Path) -> None:
    url = _url(triton, CLIENTS[script])
    done = run(script, "--url", url, *kv_args(triton), "--size", "250", "256", "--out", str(tmp_path / "b.png"))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert "INVALID_ARGUMENT" in done.stderr or "HTTP 400" in done.stderr
    assert "SIZE: height and width must each be a positive multiple of 32, got [250, 256] (height 250 is not)" \
        in done.stderr
    assert not (tmp_path / "b.png").exists()


@pytest.mark.parametrize("script", sorted(CLIENTS))
def test_no_server_is_one_line_and_exit_code_1(triton, script: str) -> None:
    (port,) = free_ports(1)
    done = run(script, "--url", f"127.0.0.1:{port}", *kv_args(triton))
    assert done.returncode == 1 and "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("script", [*sorted(CLIENTS), *sorted(STREAM_CLIENTS), "lightllm_client.py"])
def test_help_shows_a_command_that_runs_and_not_itself(script: str) -> None:
    done = run(script, "--help")
    assert done.returncode == 0
    assert f"python client_examples/{script} --url localhost:800" in done.stdout
    assert f"{script} --help" not in done.stdout


@pytest.mark.parametrize("script", sorted(STREAM_CLIENTS))
def test_a_streamed_request_shows_progress_and_writes_previews_and_the_image(triton, script: str,
                                                                             tmp_path: Path) -> None:
    url = _url(triton, STREAM_CLIENTS[script])
    kv = triton.checkpoint / "sample_kv"
    done = run(script, "--url", url, "--cond", str(kv / "cond_kv.pt"), "--uncond", str(kv / "uncond_kv.pt"),
               "--offset-cond", "24", "--offset-uncond", "7", "--steps", "4", "--seed", "5", "--size", "64", "64",
               "--preview-every", "2", "--preview-size", "32", "48", "--preview-dir", str(tmp_path / "p"),
               "--out", str(tmp_path / "s.png"))
    assert done.returncode == 0, done.stderr
    assert "4/4" in done.stderr and (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"
    previews = sorted(p.name for p in (tmp_path / "p").iterdir())
    assert previews == ["step_002.jpg"]  # step 4 is the last: it carries the image
    assert Image.open(tmp_path / "p" / "step_002.jpg").size == (48, 32)
    # the same image as the plain model's for the same inputs
    plain = run(script.replace("stream_", "").replace(".py", "_t2i.py"), "--url", url, "--cond",
                str(kv / "cond_kv.pt"), "--uncond", str(kv / "uncond_kv.pt"), "--offset-cond", "24",
                "--offset-uncond", "7", "--steps", "4", "--seed", "5", "--size", "64", "64",
                "--out", str(tmp_path / "plain.png"))
    assert plain.returncode == 0, plain.stderr
    assert (tmp_path / "plain.png").read_bytes() == (tmp_path / "s.png").read_bytes()


@pytest.mark.parametrize("script", sorted(STREAM_CLIENTS))
def test_a_refused_stream_is_one_line_and_exit_code_1(triton, script: str, tmp_path: Path) -> None:
    url = _url(triton, STREAM_CLIENTS[script])
    done = run(script, "--url", url, *kv_args(triton), "--preview-every", "-1", "--out", str(tmp_path / "b.png"))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert "PREVIEW_EVERY: must be 0 (no previews)" in done.stderr
    assert not (tmp_path / "b.png").exists()


def test_neopp_url_alone_finds_the_grpc_address_too(triton, tmp_path: Path) -> None:
    """One address: with NEOPP_URL set and no --url, a gRPC example asks the door for Triton's gRPC
    address; a NEOPP_URL where nothing answers is one line naming it."""
    import json
    import os
    import urllib.request

    with urllib.request.urlopen(f"http://{triton.door_url}/neopp/addresses", timeout=30) as answer:
        addresses = json.loads(answer.read())
    assert addresses == {"http": f"http://{triton.door_url}", "grpc": triton.server.grpc_url}
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEOPP_")}
    for script in sorted(CLIENTS):
        done = subprocess.run([sys.executable, str(REPO / "client_examples" / script), *kv_args(triton), "--size",
                               "64", "64", "--out", str(tmp_path / f"{script}.png")], capture_output=True, text=True,
                              timeout=300, cwd=REPO, env={**env, "NEOPP_URL": f"http://{triton.door_url}"})
        assert done.returncode == 0, done.stderr
    (closed,) = free_ports(1)
    done = subprocess.run([sys.executable, str(REPO / "client_examples" / "grpc_t2i.py"), *kv_args(triton)],
                          capture_output=True, text=True, timeout=60, cwd=REPO,
                          env={**env, "NEOPP_URL": f"http://127.0.0.1:{closed}"})
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert f"127.0.0.1:{closed} did not say its gRPC address" in done.stderr and "(NEOPP_URL)" in done.stderr
