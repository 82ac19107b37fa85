"""A model that fails to load never takes the others down (``python -m neopp.launcher
serve``, the launcher behind ``make serve``, with the real tritonserver).

One launcher loads ``neopp_dense`` (good), ``neopp_dense_fp8`` pointed at a checkpoint whose
config.json is broken, and ``neopp_dense_8steps`` with a LoRA made for another geometry. The
launcher keeps serving ``neopp_dense``, prints every model's state with the reason, and the
states are visible over HTTP. A launcher whose only model fails exits non-zero.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from neopp.launcher.admin import KEY_HEADER
from neopp.model.kv_cache import load_kv_file
from testing.launched import Launched, launch
from testing.tiny_checkpoint import write_mismatched_loras

KEY = "isolation-operator-key-0123456789"
LORA = "neopp_8steps_lora.safetensors"
LOAD_LIMIT_S = 300.0  # two tiny models load in 30-60 s here (2 busy cores)


@pytest.fixture(scope="module")
def broken_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint folder whose config.json is not JSON."""
    path = tmp_path_factory.mktemp("broken") / "ckpt"
    path.mkdir()
    (path / "config.json").write_text('{"llm_config": ')
    return path


@pytest.fixture(scope="module")
def wide_lora_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_mismatched_loras(tmp_path_factory.mktemp("wide_lora"))


@pytest.fixture(scope="module")
def mixed(tiny_dense: Path, broken_checkpoint: Path, wide_lora_dir: Path,
          tmp_path_factory: pytest.TempPathFactory):
    launcher = launch(tmp_path_factory.mktemp("mixed") / "serve.log",
                      {"NEOPP_ADMIN_KEY": KEY, "NEOPP_CHECKPOINT": str(tiny_dense),
                       "NEOPP_CHECKPOINT_NEOPP_DENSE_FP8": str(broken_checkpoint),
                       "NEOPP_LORA_DIR_NEOPP_DENSE_8STEPS": str(wide_lora_dir)},
                      ("neopp_dense", "neopp_dense_fp8", "neopp_dense_8steps"))
    try:
        launcher.wait_for("NeoPP Triton server ready", timeout=LOAD_LIMIT_S)
        yield launcher
    finally:
        assert launcher.stop() == 0, launcher.text()[-4000:]
        assert launcher.leftovers() == {}, "servers left processes"


def table_row(text: str, model: str) -> str:
    match = re.search(rf"^  {model} +(.*)$", text, re.MULTILINE)
    assert match, f"no row for {model}:\n{text[-4000:]}"
    return match.group(1)


def test_table_names_every_model_and_why(mixed: Launched, broken_checkpoint: Path, wide_lora_dir: Path) -> None:
    text = mixed.text()
    assert table_row(text, "neopp_dense") == "READY"
    fp8 = table_row(text, "neopp_dense_fp8")
    assert fp8.startswith("UNAVAILABLE") and "config.json" in fp8 and str(broken_checkpoint) in fp8
    lora = table_row(text, "neopp_dense_8steps")
    assert lora.startswith("UNAVAILABLE") and "model neopp_dense_8steps" in lora
    assert str(wide_lora_dir / LORA) in lora and re.search(r"key '[^']+\.lora_(up|down)\.weight'", lora)
    assert "not loaded" in table_row(text, "neopp_moe")  # in the repository, not requested


def test_the_model_that_loaded_serves(mixed: Launched, tiny_dense: Path) -> None:
    kv = tiny_dense / "sample_kv"
    arrays = {"COND_KV": (load_kv_file(kv / "cond_kv.pt").float().numpy(), "BF16"),
              "UNCOND_KV": (load_kv_file(kv / "uncond_kv.pt").float().numpy(), "BF16"),
              "INDEX_OFFSET_COND": (np.array([24], np.int64), "INT64"),
              "INDEX_OFFSET_UNCOND": (np.array([7], np.int64), "INT64"),
              "SIZE": (np.array([32, 32], np.int64), "INT64"), "STEPS": (np.array([2], np.int64), "INT64"),
              "SEED": (np.array([1], np.int64), "INT64"), "OUTPUT_FORMAT": (np.array([b"png"], object), "BYTES")}
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
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, headers=headers or {},
                                 method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_states_over_http_as_the_readme_says(mixed: Launched) -> None:
    assert http_status(mixed.http_port, "/v2/models/neopp_dense/ready")[0] == 200
    assert http_status(mixed.http_port, "/v2/models/neopp_dense_fp8/ready")[0] == 400
    assert http_status(mixed.http_port, "/v2/health/ready")[0] == 200  # the server serves what loaded
    assert http_status(mixed.http_port, "/v2/repository/index", b"{}")[0] == 403  # the operator key is needed
    status, body = http_status(mixed.http_port, "/v2/repository/index", b"{}", {KEY_HEADER: KEY})
    states = {row["name"]: row.get("state") for row in json.loads(body)}
    assert status == 200 and states["neopp_dense"] == "READY" and states["neopp_dense_fp8"] == "UNAVAILABLE"


def test_nothing_loaded_exits_non_zero(broken_checkpoint: Path, tmp_path: Path) -> None:
    launcher = launch(tmp_path / "serve.log", {"NEOPP_ADMIN_KEY": KEY, "NEOPP_CHECKPOINT": str(broken_checkpoint)},
                      ("neopp_dense",))
    try:
        launcher.proc.wait(timeout=LOAD_LIMIT_S)
    finally:
        code = launcher.stop()
    assert launcher.leftovers() == {}, "servers left processes"
    text = launcher.text()
    assert code == 1, text[-4000:]
    assert table_row(text, "neopp_dense").startswith("UNAVAILABLE") and "no model is ready" in text
