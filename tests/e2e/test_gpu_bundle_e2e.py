"""The GPU machine's bundle, built and unpacked here: tritonserver starts from the bundle's own
folder (its binary, its libraries, its Python backend), serves a generation request, and the
bundle's perf_analyzer measures it with only the bundle's libraries on its search path."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient

from client_examples.make_perf_data import perf_input_data
from deploy import gpu_bundle
from neopp.launcher.triton_install import python_tag
from neopp.launcher.tritonserver import TritonServer
from neopp.model.checkpoint_config import CheckpointConfig
from neopp.model.kv_cache import load_kv_file
from neopp.procs import process_group_members
from testing import REPO
from testing.loadgen import image_bytes, infer, valid_inputs

COND_TOKENS, UNCOND_TOKENS = 24, 7  # the fixture's sample KV


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    """Built for this interpreter (the GPU machine's is 3.12), without the pip packages (this
    machine has them; fetching them would make the test depend on the package index)."""
    work = tmp_path_factory.mktemp("bundle")
    archive = gpu_bundle.build(work / "bundle.tar.gz", python_tag(), with_site=False, compression="gz")
    return gpu_bundle.unpack(archive, work / "unpacked")


def test_the_manifest_lists_every_file_with_its_digest(bundle):
    top = bundle.parent
    manifest = json.loads((top / "MANIFEST.json").read_text())
    on_disk = {str(p.relative_to(top)) for p in top.rglob("*") if p.is_file()} - {"MANIFEST.json"}
    assert set(manifest["files"]) == on_disk
    for rel in ("tritonserver/bin/tritonserver", "tritonserver/backends/python/triton_python_backend_stub"):
        assert manifest["files"][rel]["sha256"] == gpu_bundle.sha256(top / rel)
    assert "libtritonserver" in " ".join(manifest["files"])
    assert not any(name.startswith(("libc.so", "libstdc++", "libpython")) for name in
                   (Path(f).name for f in manifest["files"]))  # the machine's own, never carried
    assert manifest["python"] == python_tag()


def test_tritonserver_runs_from_the_bundle_and_serves(bundle, tiny_dense, tmp_path, monkeypatch):
    monkeypatch.setenv("NEOPP_TRITONSERVER_ROOT", str(bundle))
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEOPP_CHECKPOINT_")}
    env["NEOPP_CHECKPOINT"] = str(tiny_dense)
    server = TritonServer(REPO / "model_repository", env=env, log_path=tmp_path / "tritonserver.log",
                          backend_dir=tmp_path / "backends",
                          extra_args=["--model-control-mode=explicit", "--exit-timeout-secs=15",
                                      "--load-model=neopp_dense"])
    assert server.install.server_bin == bundle / "bin" / "tritonserver"
    server.start()
    pgid = server.process.pid
    try:
        server.wait_ready(timeout=300)
        maps = Path(f"/proc/{server.process.pid}/maps").read_text()
        assert str(bundle / "lib" / "libtritonserver") in maps  # the bundle's library, not the wheel's
        cond = load_kv_file(tiny_dense / "sample_kv" / "cond_kv.pt").float().numpy()
        uncond = load_kv_file(tiny_dense / "sample_kv" / "uncond_kv.pt").float().numpy()
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            result = infer(client, "neopp_dense", valid_inputs(cond, uncond, (COND_TOKENS, UNCOND_TOKENS), seed=3))
        assert image_bytes(result).startswith(b"\x89PNG")
        perf = run_bundled_perf_analyzer(bundle, server.grpc_url, tiny_dense, tmp_path)
        assert perf.returncode == 0, perf.stdout[-2000:] + perf.stderr[-2000:]
        assert "Throughput:" in perf.stdout
    finally:
        server.stop(timeout=30)
        assert not process_group_members(pgid), "tritonserver left processes behind"


def run_bundled_perf_analyzer(bundle: Path, grpc_url: str, ckpt: Path, work: Path) -> subprocess.CompletedProcess:
    dims = CheckpointConfig.from_checkpoint(ckpt).kv_dims
    data = work / "input.json"
    data.write_text(json.dumps(perf_input_data(dims, COND_TOKENS, size=(64, 64), steps=2)))
    env = {"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": str(bundle / "lib")}
    cmd = [str(bundle / "bin" / "perf_analyzer"), "-m", "neopp_dense", "-u", grpc_url, "-i", "grpc",
           "--input-data", str(data), "--concurrency-range", "1", "--request-count", "4"]  # no stability wait
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
