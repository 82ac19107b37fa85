"""A model that fails to load never takes the others down (``python -m neopp.serving.tritonserver
serve``, the launcher behind ``make serve``, with the real tritonserver).

One launcher loads ``neopp_dense`` (good), ``neopp_dense_fp8`` pointed at a checkpoint whose
config.json is broken, and ``neopp_dense_8steps`` with a LoRA made for another geometry. The
launcher keeps serving ``neopp_dense``, prints every model's state with the reason, and the
states are visible over HTTP. A launcher whose only model fails exits non-zero.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from neopp.kv_cache import load_kv_file
from neopp.ports import free_ports
from neopp.serving.admin import KEY_HEADER
from neopp.serving.procs import process_group_members
from testing import REPO as REPO_ROOT
from testing.tiny_checkpoint import tiny_config, tiny_tensors
from testing.tiny_lora import write_tiny_loras

KEY = "isolation-operator-key-0123456789"
LORA = "neopp_8steps_lora.safetensors"
LOAD_LIMIT_S = 300.0  # two tiny models load in 30-60 s here (2 busy cores)


@dataclass
class Launcher:
    """A launcher process, its output file and its ports."""

    proc: subprocess.Popen
    log: Path
    http_port: int
    grpc_port: int

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def server_pids(self) -> list[int]:
        """Every tritonserver this launcher started, from its own output."""
        return [int(pid) for pid in re.findall(r"tritonserver pid (\d+)", self.text())]

    def wait_for(self, pattern: str, timeout: float = LOAD_LIMIT_S) -> None:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.text()):
            assert self.proc.poll() is None, f"launcher exited {self.proc.returncode}:\n{self.text()[-4000:]}"
            assert time.monotonic() < deadline, f"no {pattern!r} after {timeout}s:\n{self.text()[-4000:]}"
            time.sleep(0.25)

    def stop(self) -> int:
        """SIGTERM, bounded wait; returns the exit code and checks no server process is left."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        for pid in self.server_pids():
            assert process_group_members(pid) == [], f"server {pid} left processes"
        return self.proc.returncode


def launch(tmp: Path, env_overrides: dict[str, str], models: tuple[str, ...]) -> Launcher:
    """The real launcher on free loopback ports, loading ``models`` (explicit model control)."""
    http_port, grpc_port, metrics_port = free_ports(3)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NEOPP_CHECKPOINT", "NEOPP_LORA_DIR"))}
    env.update(NEOPP_ADMIN_KEY=KEY, PYTHONUNBUFFERED="1", **env_overrides)
    cmd = [
        sys.executable,
        "-m",
        "neopp.serving.tritonserver",
        "serve",
        "--http-port",
        str(http_port),
        "--grpc-port",
        str(grpc_port),
        "--metrics-port",
        str(metrics_port),
        "--max-restarts",
        "0",
        "--",
        "--model-control-mode=explicit",
        "--exit-timeout-secs=5",
        *(f"--load-model={m}" for m in models),
    ]
    log = tmp / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT, start_new_session=True
        )
    return Launcher(proc, log, http_port, grpc_port)


@pytest.fixture(scope="module")
def broken_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint folder whose config.json is not JSON."""
    path = tmp_path_factory.mktemp("broken") / "ckpt"
    path.mkdir()
    (path / "config.json").write_text('{"llm_config": ')
    return path


@pytest.fixture(scope="module")
def wide_lora_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 8-step LoRA file made for hidden size 256 (the tiny checkpoint has 128)."""
    cfg = tiny_config("dense")
    cfg["llm_config"].update(hidden_size=256, num_attention_heads=8)
    out = tmp_path_factory.mktemp("wide_lora")
    write_tiny_loras(out, tiny_tensors(cfg, 0))
    return out


@pytest.fixture(scope="module")
def mixed(tiny_dense: Path, broken_checkpoint: Path, wide_lora_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    launcher = launch(
        tmp_path_factory.mktemp("mixed"),
        {
            "NEOPP_CHECKPOINT": str(tiny_dense),
            "NEOPP_CHECKPOINT_NEOPP_DENSE_FP8": str(broken_checkpoint),
            "NEOPP_LORA_DIR_NEOPP_DENSE_8STEPS": str(wide_lora_dir),
        },
        ("neopp_dense", "neopp_dense_fp8", "neopp_dense_8steps"),
    )
    try:
        launcher.wait_for("NeoPP Triton server ready")
        yield launcher
    finally:
        assert launcher.stop() == 0, launcher.text()[-4000:]


def table_row(text: str, model: str) -> str:
    match = re.search(rf"^  {model} +(.*)$", text, re.MULTILINE)
    assert match, f"no row for {model}:\n{text[-4000:]}"
    return match.group(1)


def test_table_names_every_model_and_why(mixed: Launcher, broken_checkpoint: Path, wide_lora_dir: Path) -> None:
    text = mixed.text()
    assert table_row(text, "neopp_dense") == "READY"
    fp8 = table_row(text, "neopp_dense_fp8")
    assert fp8.startswith("UNAVAILABLE") and "config.json" in fp8 and str(broken_checkpoint) in fp8
    lora = table_row(text, "neopp_dense_8steps")
    assert lora.startswith("UNAVAILABLE") and "model neopp_dense_8steps" in lora
    assert str(wide_lora_dir / LORA) in lora and re.search(r"key '[^']+\.lora_(up|down)\.weight'", lora)
    assert "not loaded" in table_row(text, "neopp_moe")  # in the repository, not requested


def test_the_model_that_loaded_serves(mixed: Launcher, tiny_dense: Path) -> None:
    kv = tiny_dense / "sample_kv"
    arrays = {
        "COND_KV": (load_kv_file(kv / "cond_kv.pt").float().numpy(), "BF16"),
        "UNCOND_KV": (load_kv_file(kv / "uncond_kv.pt").float().numpy(), "BF16"),
        "INDEX_OFFSET_COND": (np.array([24], np.int64), "INT64"),
        "INDEX_OFFSET_UNCOND": (np.array([7], np.int64), "INT64"),
        "SIZE": (np.array([32, 32], np.int64), "INT64"),
        "STEPS": (np.array([2], np.int64), "INT64"),
        "SEED": (np.array([1], np.int64), "INT64"),
        "OUTPUT_FORMAT": (np.array([b"png"], object), "BYTES"),
    }
    tensors = []
    for name, (array, dtype) in arrays.items():
        tensors.append(grpcclient.InferInput(name, list(array.shape), dtype))
        tensors[-1].set_data_from_numpy(array)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{mixed.grpc_port}")
    try:
        image = client.infer("neopp_dense", tensors, client_timeout=120).as_numpy("IMAGE")[0]
    finally:
        client.close()
    assert bytes(image).startswith(b"\x89PNG")


def http_status(port: int, path: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=body, headers=headers or {}, method="POST" if body is not None else "GET"
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_states_over_http_as_the_readme_says(mixed: Launcher) -> None:
    assert http_status(mixed.http_port, "/v2/models/neopp_dense/ready")[0] == 200
    assert http_status(mixed.http_port, "/v2/models/neopp_dense_fp8/ready")[0] == 400
    assert http_status(mixed.http_port, "/v2/health/ready")[0] == 200  # the server serves what loaded
    assert http_status(mixed.http_port, "/v2/repository/index", b"{}")[0] == 403  # the operator key is needed
    status, body = http_status(mixed.http_port, "/v2/repository/index", b"{}", {KEY_HEADER: KEY})
    states = {row["name"]: row.get("state") for row in json.loads(body)}
    assert status == 200 and states["neopp_dense"] == "READY" and states["neopp_dense_fp8"] == "UNAVAILABLE"


def test_nothing_loaded_exits_non_zero(broken_checkpoint: Path, tmp_path: Path) -> None:
    launcher = launch(tmp_path, {"NEOPP_CHECKPOINT": str(broken_checkpoint)}, ("neopp_dense",))
    try:
        launcher.proc.wait(timeout=LOAD_LIMIT_S)
    finally:
        code = launcher.stop()
    text = launcher.text()
    assert code == 1, text[-4000:]
    assert table_row(text, "neopp_dense").startswith("UNAVAILABLE") and "no model is ready" in text
