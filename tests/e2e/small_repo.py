"""A private model repository (neopp_dense + neopp_session with small session bounds) and a real
tritonserver on it, for tests that must not share the suite's server or its limits."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from neopp.launcher.tritonserver import TritonServer
from neopp.model.kv_cache import load_kv_file
from neopp.procs import process_group_members
from testing import REPO as REPO_ROOT
from testing.loadgen import grpc_inputs

COND_TOKENS, UNCOND_TOKENS = 24, 7  # the fixture's sample KV lengths, used as offsets


def write_repo(root: Path, session_params: dict[str, str], candidates: int) -> Path:
    """Copies of the two models; mode_file made absolute (relative ones resolve against ``root``)."""
    repo = root / "model_repository"
    for name in ("neopp_dense", "neopp_session"):
        shutil.copytree(REPO_ROOT / "model_repository" / name, repo / name)
    dense = repo / "neopp_dense" / "config.pbtxt"
    mode = REPO_ROOT / "configs" / "neopp" / "neopp_dense.json"
    dense.write_text(dense.read_text().replace('"configs/neopp/neopp_dense.json"', f'"{mode}"'))
    session = repo / "neopp_session" / "config.pbtxt"
    text = re.sub(r"max_candidate_sequences: \d+", f"max_candidate_sequences: {candidates}",
                  session.read_text())
    for key, value in session_params.items():
        text = re.sub(rf'(key: "{key}" value: {{ string_value: )"[^"]*"', rf'\1"{value}"', text)
    session.write_text(text)
    return repo


class SmallServer:
    """The running server, a gRPC client, and a valid request of the tiny checkpoint."""

    def __init__(self, repo: Path, checkpoint: Path, log_path: Path, extra_env: dict[str, str] | None = None) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("NEOPP_CHECKPOINT_", "NEOPP_LORA_DIR_"))}
        env["NEOPP_CHECKPOINT"] = str(checkpoint)
        env.update(extra_env or {})
        self.server = TritonServer(repo, env=env, log_path=log_path,
                                   extra_args=["--model-control-mode=explicit", "--exit-timeout-secs=15",
                                               "--load-model=neopp_dense", "--load-model=neopp_session"])
        kv = checkpoint / "sample_kv"
        self.cond, self.uncond = load_kv_file(kv / "cond_kv.pt"), load_kv_file(kv / "uncond_kv.pt")
        self.pgid = 0
        self.grpc: grpcclient.InferenceServerClient | None = None

    def start(self) -> SmallServer:
        self.server.start()
        self.pgid = self.server.process.pid
        self.server.wait_ready(timeout=300)
        self.grpc = grpcclient.InferenceServerClient(self.server.grpc_url)
        return self

    def stop(self) -> list:
        """Stops the server; returns what is left of its process group (nothing, normally)."""
        if self.grpc is not None:
            self.grpc.close()
        self.server.stop(timeout=30)
        return process_group_members(self.pgid)

    def inputs(self, **overrides) -> dict[str, tuple[np.ndarray, str]]:
        """A valid 64x64, 1-step guided request, name -> (array, datatype); ``NAME=None`` drops an input."""
        req = {"COND_KV": (self.cond.float().numpy(), "BF16"),
               "UNCOND_KV": (self.uncond.float().numpy(), "BF16"),
               "INDEX_OFFSET_COND": (np.array([COND_TOKENS], np.int64), "INT64"),
               "INDEX_OFFSET_UNCOND": (np.array([UNCOND_TOKENS], np.int64), "INT64"),
               "SIZE": (np.array([64, 64], np.int64), "INT64"), "STEPS": (np.array([1], np.int64), "INT64"),
               "OUTPUT_FORMAT": (np.array([b"png"], np.object_), "BYTES")}
        req.update(overrides)
        return {name: value for name, value in req.items() if value is not None}

    def tensors(self, **overrides) -> list[grpcclient.InferInput]:
        """``inputs`` as gRPC tensors."""
        return grpc_inputs(self.inputs(**overrides))
