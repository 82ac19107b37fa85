"""One real tritonserver for the whole e2e session, serving the tiny checkpoint.

The server runs from the nvidia-pytriton wheel (neopp.launcher.tritonserver) on free
loopback ports, loads only the models this suite needs (explicit model control), is started
again on the same ports if it dies (testing.kept_server: the test running then fails, the
ones after it do not), and is stopped at the end with a check that neither it nor a Python
stub is left behind.
"""

from __future__ import annotations

import io
import os
import re
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from PIL import Image

from neopp.launcher.door.bounds import DoorLimits
from neopp.launcher.door.server import DoorServer
from neopp.launcher.model_states import KEEP_GOING_ARGS
from neopp.launcher.tritonserver import TritonServer
from neopp.model.kv_cache import load_kv_file
from neopp.ports import LOOPBACK
from neopp.procs import process_group_members
from testing import REPO as REPO_ROOT
from testing.door_attacks import SMALL_DOOR
from testing.faults import wait_for
from testing.kept_server import KeptServer
from testing.launched import serving
from testing.loadgen import grpc_inputs, http_inputs
from testing.tiny_checkpoint import tiny_config, tiny_tensors, write_sample_kv, write_tiny_checkpoint
from testing.tiny_lora import write_tiny_loras

E2E_MODELS = ("neopp_dense", "neopp_session", "neopp_dense_fp8", "neopp_dense_8steps", "neopp_moe", "neopp_moe_cfg",
              "neopp_dense_cfg", "neopp_dense_cfg_seq", "neopp_dense_stream", "neopp_dense_cfg_stream")
MOE_MODELS = ("neopp_moe", "neopp_moe_cfg")  # served from the tiny MoE checkpoint
MODEL = "neopp_dense"
COND_TOKENS, UNCOND_TOKENS = 24, 7  # write_sample_kv defaults; also used as the offsets
DEFAULT_SIZE, DEFAULT_STEPS = (64, 64), 4


@dataclass
class TritonHandle:
    """The running server plus what tests need to build requests against it."""

    server: TritonServer
    checkpoint: Path
    cond: torch.Tensor  # online layout, bfloat16
    uncond: torch.Tensor
    log_path: Path
    grpc: grpcclient.InferenceServerClient = field(init=False)
    http: httpclient.InferenceServerClient = field(init=False)
    door: DoorServer = field(init=False)

    def __post_init__(self) -> None:
        """HTTP goes through the launcher's door (neopp.launcher.door), as in `make serve`."""
        self.grpc = grpcclient.InferenceServerClient(self.server.grpc_url)
        # every binary input through the door's shared-memory region (the launcher: from 1 MiB)
        self.door = DoorServer(LOOPBACK, 0, self.server.grpc_url, (LOOPBACK, self.server.http_port), "e2e",
                               DoorLimits(region_min_bytes=1),
                               metrics_address=(LOOPBACK, self.server.metrics_port)).start()
        self.http = httpclient.InferenceServerClient(self.door_url, network_timeout=120.0)

    def close(self) -> None:
        """Clients first (an open keep-alive connection would hold a graceful stop), then the door,
        which removes its shared-memory region."""
        self.grpc.close()
        self.http.close()
        self.door.stop()

    @property
    def door_url(self) -> str:
        return f"{LOOPBACK}:{self.door.server_address[1]}"

    def log_once(self, ready: Callable[[str], bool], timeout: float = 60.0) -> str:
        """The server log once ``ready(log)`` holds (or at the deadline): the stubs' log lines reach
        the file asynchronously, after the response."""
        wait_for(lambda: ready(self.log_path.read_text(errors="replace")), timeout, poll=0.1)
        return self.log_path.read_text(errors="replace")

    def inputs(self, **overrides: Any) -> dict[str, tuple[np.ndarray, str]]:
        """A valid guided request (64x64, 4 steps, PNG); ``NAME=None`` drops an input,
        ``NAME=(array, datatype)`` or ``NAME=array`` replaces one."""
        req: dict[str, Any] = {
            "COND_KV": (self.cond.float().numpy(), "BF16"),
            "UNCOND_KV": (self.uncond.float().numpy(), "BF16"),
            "INDEX_OFFSET_COND": np.array([COND_TOKENS], np.int64),
            "INDEX_OFFSET_UNCOND": np.array([UNCOND_TOKENS], np.int64),
            "SIZE": np.array(DEFAULT_SIZE, np.int64),
            "STEPS": np.array([DEFAULT_STEPS], np.int64),
            "OUTPUT_FORMAT": np.array([b"png"], np.object_),
        }
        req.update(overrides)
        out = {}
        for name, value in req.items():
            if value is None:
                continue
            arr, dtype = value if isinstance(value, tuple) else (value, _datatype(value))
            out[name] = (arr, dtype)
        return out

    def infer_grpc(self, timeout: float | None = 120.0, **overrides: Any) -> grpcclient.InferResult:
        return self.grpc.infer(MODEL, self.grpc_tensors(**overrides), client_timeout=timeout)

    def infer_http(self, **overrides: Any) -> httpclient.InferResult:
        return self.http.infer(MODEL, http_inputs(self.inputs(**overrides)))

    def grpc_tensors(self, **overrides: Any) -> list[grpcclient.InferInput]:
        return grpc_inputs(self.inputs(**overrides))

    @staticmethod
    def image(result: Any) -> Image.Image:
        """The IMAGE output of a gRPC or HTTP result, decoded."""
        return Image.open(io.BytesIO(result.as_numpy("IMAGE")[0]))

    def metric(self, name: str, **labels: str) -> float:
        """Current value of one series on the metrics port (0 when it does not exist yet)."""
        text = urllib.request.urlopen(self.server.metrics_url, timeout=10).read().decode()
        want = {"model": MODEL, **labels}
        for line in text.splitlines():
            m = re.match(r"^(\w+)\{(.*)\} (\S+)$", line)
            if m and m.group(1) == name and dict(re.findall(r'(\w+)="([^"]*)"', m.group(2))) == want:
                return float(m.group(3))
        return 0.0

    def wait_metric(self, name: str, at_least: float, timeout: float = 60.0, **labels: str) -> float:
        """Poll (bounded) until a counter reaches ``at_least``; returns its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.metric(name, **labels)
            if value >= at_least or time.monotonic() > deadline:
                return value
            time.sleep(0.05)


def _datatype(arr: np.ndarray) -> str:
    return {np.dtype(np.int64): "INT64", np.dtype(np.float32): "FP32", np.dtype(np.uint8): "UINT8",
            np.dtype(np.object_): "BYTES"}[arr.dtype]


@pytest.fixture(scope="session")
def tiny_dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny dense checkpoint and its sample KV, written once per session."""
    ckpt = write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "dense", "dense")
    write_sample_kv(ckpt / "sample_kv", "dense", cond_tokens=COND_TOKENS, uncond_tokens=UNCOND_TOKENS)
    return ckpt


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny MoE checkpoint (same KV geometry as the dense one)."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "moe", "moe")


def ensure_8steps_lora() -> Path:
    """The LoRA file configs/neopp/neopp_dense_8steps.json names (what `make tiny` writes, seed 0);
    servers find it through NEOPP_LORA_DIR set to its folder."""
    path = REPO_ROOT / "build" / "tiny" / "lora" / "neopp_8steps_lora.safetensors"
    if not path.is_file():
        write_tiny_loras(path.parent, tiny_tensors(tiny_config("dense"), 0))
    return path


@pytest.fixture(scope="session")
def triton(tiny_dense: Path, tiny_moe: Path, tmp_path_factory: pytest.TempPathFactory) -> TritonHandle:
    """The real server; models point to the tiny checkpoint through NEOPP_CHECKPOINT."""
    log_path = tmp_path_factory.mktemp("triton") / "tritonserver.log"
    env = dict(os.environ, NEOPP_CHECKPOINT=str(tiny_dense))
    for key in [k for k in env if k.startswith(("NEOPP_CHECKPOINT_", "NEOPP_LORA_DIR_"))]:
        env.pop(key)  # a developer's per-model override must not leak into the suite
    env.update({"NEOPP_CHECKPOINT_" + m.upper(): str(tiny_moe) for m in MOE_MODELS})
    env["NEOPP_LORA_DIR"] = str(ensure_8steps_lora().parent)
    server = TritonServer(REPO_ROOT / "model_repository", env=env, log_path=log_path,
                          extra_args=["--model-control-mode=explicit", "--exit-timeout-secs=15",
                                      *KEEP_GOING_ARGS,  # a rescued load is retried, not fatal
                                      *(f"--load-model={m}" for m in E2E_MODELS)])
    server.start()
    servers = [server]
    try:
        server.wait_ready(timeout=600)  # ten models, rank workers included, on a busy host
        check = grpcclient.InferenceServerClient(server.grpc_url)
        down = [m for m in E2E_MODELS if not check.is_model_ready(m)]
        check.close()
        assert not down, f"models not ready: {down}\n{server.log_tail()}"
        kv = tiny_dense / "sample_kv"
        handle = TritonHandle(server, tiny_dense, load_kv_file(kv / "cond_kv.pt"),
                              load_kv_file(kv / "uncond_kv.pt"), log_path)
        kept = KeptServer(handle, note=lambda text: print(f"e2e server: {text}", flush=True)).start()
        servers = kept.servers
        yield handle
        kept.close()
        handle.close()
        if kept.restarts:
            print(f"e2e server: restarted after exits {kept.restarts}")
    finally:
        for each in servers:
            each.stop(timeout=30)
        left = [pid for each in servers for pid in process_group_members(each.process.pid)]
        assert not left, f"tritonserver left processes behind: {left}"


HUNG_S = 3  # the launcher's hung rule, short: a long request outlasts it many times
STOPPED_S = 5  # a stub stopped this long is replaced: the lock drill's stops of a few ms never add up to it


@pytest.fixture(scope="session")
def door(tiny_dense: Path, tmp_path_factory: pytest.TempPathFactory):
    """``python -m neopp.launcher serve`` with ``neopp_dense`` and the door's bounds made small
    (testing.door_attacks.SMALL_DOOR), shared by the door's e2e modules; no request may print a
    traceback, and the stop leaves no process."""
    log = tmp_path_factory.mktemp("door") / "serve.log"
    with serving(log, {"NEOPP_CHECKPOINT": str(tiny_dense), "NEOPP_ADMIN_KEY": SMALL_DOOR.key}, (MODEL,),
                 max_restarts=4, no_traceback=True,
                 launcher_args=[*SMALL_DOOR.args(), "--hung-s", str(HUNG_S), "--stopped-s", str(STOPPED_S),
                                "--alive-file", str(log.parent / "alive")]) as handle:
        yield handle


@pytest.fixture(scope="session")
def kv(tiny_dense: Path) -> tuple[np.ndarray, np.ndarray]:
    """The tiny checkpoint's sample prefixes (cond, uncond) as float32 arrays."""
    sample = tiny_dense / "sample_kv"
    return tuple(load_kv_file(sample / f"{which}_kv.pt").float().numpy() for which in ("cond", "uncond"))
