"""Layouts on the real tritonserver: with ``--model-config-name=h200x8`` a model that has
``configs/h200x8.pbtxt`` loads that file and a model without one loads its config.pbtxt. Without
GPUs the layout's models are refused with the reason, while the file-less model serves as before."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from neopp.launcher.tritonserver import TritonServer
from neopp.procs import process_group_members
from testing import REPO as REPO_ROOT

LAYOUT = "h200x8"
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is what a machine without GPUs sees")


@pytest.fixture(scope="module")
def client(tiny_dense: Path, tmp_path_factory: pytest.TempPathFactory) -> grpcclient.InferenceServerClient:
    """A server of the shipped repository under the layout, with only the session model loaded."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEOPP_CHECKPOINT_")}
    env["NEOPP_CHECKPOINT"] = str(tiny_dense)
    server = TritonServer(REPO_ROOT / "model_repository", env=env,
                          log_path=tmp_path_factory.mktemp("layout") / "tritonserver.log",
                          extra_args=["--model-control-mode=explicit", "--exit-timeout-secs=15",
                                      f"--model-config-name={LAYOUT}", "--load-model=neopp_session"])
    server.start()
    pgid = server.process.pid
    try:
        server.wait_ready(timeout=300)
        grpc = grpcclient.InferenceServerClient(server.grpc_url)
        yield grpc
        grpc.close()
    finally:
        server.stop(timeout=30)
        assert not process_group_members(pgid), "tritonserver left processes behind"


def test_model_without_the_layout_file_falls_back_to_config_pbtxt(client):
    assert not (REPO_ROOT / "model_repository" / "neopp_session" / "configs" / f"{LAYOUT}.pbtxt").exists()
    assert client.is_model_ready("neopp_session")
    config = client.get_model_config("neopp_session", as_json=True)["config"]
    assert [g["kind"] for g in config["instance_group"]] == ["KIND_CPU"]


@no_gpu
def test_rank_pool_of_the_layout_is_refused_by_the_backend_without_gpus(client):
    with pytest.raises(InferenceServerException, match=r"GPUs \[2, 3\] but CUDA is not available"):
        client.load_model("neopp_dense_cfg")
    assert not client.is_model_ready("neopp_dense_cfg")
    assert client.is_model_ready("neopp_session")


@no_gpu
def test_kind_gpu_model_of_the_layout_is_refused_by_triton_without_gpus(client):
    with pytest.raises(InferenceServerException, match="unsupported gpu id 0"):
        client.load_model("neopp_dense")
    assert not client.is_model_ready("neopp_dense")
