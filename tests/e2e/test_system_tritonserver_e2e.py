"""The container's entry point (docker/entrypoint.sh) on a tritonserver laid out as in NVIDIA's
image (``bin/``, ``lib/``, ``backends/python/``, found through ``$NEOPP_TRITONSERVER_ROOT``).
No container engine runs here, so the layout is assembled from the wheel's own files and the
script runs on this machine with its paths and ports pointed at test places, under the pod's
security context where the machine allows it (``testing.contained``: a read-only root, no
capability, no new privileges): it serves, writing only its state directory, /tmp and /dev/shm."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from neopp.launcher.triton_install import find_install, prepare_backend_dir
from neopp.model.kv_cache import load_kv_file
from neopp.ports import free_ports
from testing import REPO, contained
from testing.launched import run_launcher
from testing.loadgen import grpc_inputs


def container_layout(root: Path) -> Path:
    wheel = find_install()
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "tritonserver").symlink_to(wheel.server_bin)
    (root / "lib").symlink_to(wheel.libs)
    prepared = prepare_backend_dir(root / "wheel_backends", wheel)  # libtriton_python.so, utils, our stub
    shutil.copytree(prepared / "python", root / "backends" / "python")
    return root


def test_entrypoint_serves_from_a_container_layout(tiny_dense: Path, tmp_path: Path) -> None:
    root = container_layout(tmp_path / "opt_tritonserver")
    http_port, grpc_port, metrics_port = free_ports(3)
    env = {"NEOPP_CHECKPOINT": str(tiny_dense), "NEOPP_TRITONSERVER_ROOT": str(root), "NEOPP_HOME": str(REPO),
           "NEOPP_STATE_DIR": str(tmp_path / "state"), "NEOPP_HOST": "127.0.0.1", "NEOPP_PYTHON": sys.executable,
           "NEOPP_HTTP_PORT": str(http_port), "NEOPP_GRPC_PORT": str(grpc_port),
           "NEOPP_METRICS_PORT": str(metrics_port), "NEOPP_MODELS": "neopp_dense", "NEOPP_ADMIN_KEY": ""}
    contain, why_not = contained.prefix()
    launcher = run_launcher([*(contain or []), str(REPO / "docker" / "entrypoint.sh"), "--exit-timeout-secs=5"],
                            tmp_path / "serve.log", env, http_port, grpc_port)
    try:
        launcher.wait_for("NeoPP Triton server ready", timeout=300)
        if contain is None:
            print(f"not contained: {why_not}")
        else:  # the launcher and the server really ran that way
            for pid in (launcher.proc.pid, launcher.server_pid):
                assert contained.capabilities(pid) == 0 and contained.root_read_only(pid), pid
        assert f"tritonserver {root}/bin/tritonserver\n" in launcher.text()
        assert launcher.servers()[0][2].startswith("neopp_shm_")  # the launcher's server line still parses
        key_file = tmp_path / "state" / "admin.key"
        assert key_file.is_file() and os.stat(key_file).st_mode & 0o077 == 0  # created 0600 at first start
        kv = tiny_dense / "sample_kv"
        values = {"COND_KV": (load_kv_file(kv / "cond_kv.pt").float().numpy(), "BF16"),
                  "INDEX_OFFSET_COND": (np.array([24], np.int64), "INT64"),
                  "CFG_SCALE": (np.array([1.0], np.float32), "FP32"),
                  "SIZE": (np.array([64, 64], np.int64), "INT64"), "STEPS": (np.array([1], np.int64), "INT64")}
        inputs = grpc_inputs(values)
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        assert client.infer("neopp_dense", inputs, client_timeout=120).as_numpy("IMAGE")[0][:3] == b"\xff\xd8\xff"
        with_key = client.get_model_config("neopp_dense", headers={
            "triton-grpc-protocol-neopp-admin-key": key_file.read_text().strip()})
        assert with_key.config.name == "neopp_dense"  # the admin APIs are restricted to that key
        client.close()
    finally:
        assert launcher.stop() == 0, launcher.text()[-4000:]
    assert launcher.leftovers() == {}
