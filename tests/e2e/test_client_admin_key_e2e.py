"""The LightLLM client against a server that restricts shared memory to the operator key (what
``make serve`` runs): with the key its KV goes through a registered region, without it the
registration is refused and the same request still succeeds with the KV over the wire."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient

from neopp.launcher.admin import KEY_ENV, grpc_headers
from neopp.launcher.tritonserver import TritonServer
from neopp.model.kv_cache import load_kv_file
from testing import REPO as REPO_ROOT
from testing import lightllm_client_module

MODEL = "neopp_dense"
KEY = "client-test-operator-key-0123456789"
COND_TOKENS, UNCOND_TOKENS = 24, 7


@pytest.fixture(scope="module")
def restricted(tiny_dense: Path, tmp_path_factory: pytest.TempPathFactory):
    """Only ``neopp_dense``, the administrative APIs (shared memory included) behind KEY."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEOPP_CHECKPOINT") and k != KEY_ENV}
    env["NEOPP_CHECKPOINT"] = str(tiny_dense)
    server = TritonServer(REPO_ROOT / "model_repository", env=env, admin_key=KEY,
                          log_path=tmp_path_factory.mktemp("restricted") / "server.log",
                          extra_args=["--model-control-mode=explicit", f"--load-model={MODEL}"])
    with server:
        yield server


def _regions(server: TritonServer) -> dict:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        return client.get_system_shared_memory_status(headers=grpc_headers(KEY), as_json=True).get("regions", {})
    finally:
        client.close()


def _image(server: TritonServer, tiny_dense: Path, capsys, **client_args) -> tuple[bytes, bool, dict, str]:
    """One stateless 64x64 image; returns it, whether shm was used, the regions while set, the notice."""
    lightllm = lightllm_client_module()
    kv = tiny_dense / "sample_kv"
    with lightllm.NeoPPTritonClient(server.grpc_url, stateless=True, model=MODEL, **client_args) as client:
        assert client.use_shm  # loopback: shared memory is the client's first choice
        client.set_kvcache(load_kv_file(kv / "cond_kv.pt"), load_kv_file(kv / "uncond_kv.pt"))
        regions = _regions(server)
        client.set_inference_params(COND_TOKENS, UNCOND_TOKENS, infer_steps=2, output_format="png")
        image = base64.b64decode(client.generate(seed=11, target_shape=[64, 64]))
        used = client._shm is not None
    return image, used, regions, capsys.readouterr().err


def test_with_the_key_the_kv_goes_through_shared_memory(restricted, tiny_dense, capsys, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    with_key, used, regions, notice = _image(restricted, tiny_dense, capsys, admin_key=KEY)
    assert used and len(regions) == 1 and notice == ""
    assert _regions(restricted) == {}, "the client must unregister its region (with the key)"
    monkeypatch.setenv(KEY_ENV, KEY)  # the environment works as well as the argument
    from_env, used, regions, _ = _image(restricted, tiny_dense, capsys)
    assert used and len(regions) == 1 and from_env == with_key


def test_without_the_key_the_request_still_succeeds_over_the_wire(restricted, tiny_dense, capsys, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    with_key, _, _, _ = _image(restricted, tiny_dense, capsys, admin_key=KEY)
    without, used, regions, notice = _image(restricted, tiny_dense, capsys)
    assert not used and regions == {}
    assert "refused without the operator key" in notice and "over the wire" in notice
    assert len(notice.strip().splitlines()) == 1
    assert without == with_key
    wrong, used, _, notice = _image(restricted, tiny_dense, capsys, admin_key="not-the-key-0123456789")
    assert not used and "refused with this key" in notice and wrong == with_key
