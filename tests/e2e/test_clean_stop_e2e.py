"""Normal operation logs no error, and a stop with sessions left open is graceful.

The launcher behind ``make serve`` runs a generation model, its streamed twin, a 2-rank model
and the session model. The test serves a request on each (the twin's through the door's
``generate_stream``, several: a stream the door cancelled just after its final response could
leave the twin unable to unload, one stop in eight), opens a session and leaves it open, has a
first turn fail (its Triton sequence stays open too), refuses one bad request, then stops the
launcher with SIGTERM. Triton counts every open sequence as an inference in flight and
would wait its whole exit timeout, then kill the stubs ("Non-graceful termination"); the
session model ends them once the server says it is exiting. Expected refusals log at
warning level; nothing in the whole log is at error level.
"""

from __future__ import annotations

import base64
import http.client
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from neopp.model.kv_cache import load_kv_file
from neopp.ports import LOOPBACK
from testing.launched import launch
from testing.loadgen import grpc_inputs

MODELS = ("neopp_dense", "neopp_dense_stream", "neopp_dense_cfg", "neopp_session")
STREAMS = 6
ERROR_LINE = re.compile(r"^E\d{4} |^Error|Traceback|leaked semaphore|Non-graceful|Exit timeout expired|"
                        r"failed to stop server", re.MULTILINE)


def tensors(kv: Path, size: tuple[int, int] = (64, 64)) -> list[grpcclient.InferInput]:
    values = {"COND_KV": (load_kv_file(kv / "cond_kv.pt").float().numpy(), "BF16"),
              "UNCOND_KV": (load_kv_file(kv / "uncond_kv.pt").float().numpy(), "BF16"),
              "INDEX_OFFSET_COND": (np.array([24], np.int64), "INT64"),
              "INDEX_OFFSET_UNCOND": (np.array([7], np.int64), "INT64"),
              "SIZE": (np.array(size, np.int64), "INT64"), "STEPS": (np.array([1], np.int64), "INT64")}
    return grpc_inputs(values)


def streamed(port: int, kv: Path) -> list[dict]:
    """One generate_stream through the door, read to its end: its events."""
    def b64(name: str) -> str:
        prefix = load_kv_file(kv / name).to(torch.bfloat16).contiguous()
        return base64.b64encode(prefix.view(torch.uint8).numpy().tobytes()).decode()

    body = {"COND_KV_B64": b64("cond_kv.pt"), "UNCOND_KV_B64": b64("uncond_kv.pt"), "INDEX_OFFSET_COND": 24,
            "INDEX_OFFSET_UNCOND": 7, "SIZE": [64, 64], "STEPS": 2, "BASE64_OUTPUT": 1}
    conn = http.client.HTTPConnection(LOOPBACK, port, timeout=120)
    try:
        conn.request("POST", "/v2/models/neopp_dense_stream/generate_stream", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        return [json.loads(line[6:]) for line in iter(resp.readline, b"") if line.startswith(b"data: ")]
    finally:
        conn.close()


def test_served_and_stopped_with_open_sessions_logs_no_error(tiny_dense: Path, tmp_path: Path) -> None:
    launcher = launch(tmp_path / "serve.log", {"NEOPP_CHECKPOINT": str(tiny_dense)}, MODELS)
    try:
        launcher.wait_for("NeoPP Triton server ready", timeout=300)
        kv = tiny_dense / "sample_kv"
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{launcher.grpc_port}")
        for model in ("neopp_dense", "neopp_dense_cfg"):
            assert client.infer(model, tensors(kv), client_timeout=120).as_numpy("IMAGE")[0]
        for _ in range(STREAMS):
            assert "IMAGE" in streamed(launcher.http_port, kv)[-1]
        turn = client.infer("neopp_session", tensors(kv), sequence_id=4242, sequence_start=True, client_timeout=120)
        assert int(turn.as_numpy("TURN")[0]) == 0  # left open
        with pytest.raises(InferenceServerException, match="SIZE"):  # a first turn that fails: left open too
            client.infer("neopp_session", tensors(kv, (250, 64)), sequence_id=4243, sequence_start=True)
        with pytest.raises(InferenceServerException, match="INVALID_ARGUMENT"):
            client.infer("neopp_dense", tensors(kv, (64, 250)))
        client.close()
    finally:
        code = launcher.stop()
    text = launcher.text()
    assert code == 0, text[-4000:]
    assert launcher.leftovers() == {}
    assert "ending 2 open session(s)" in text, text[-4000:]
    assert "session 4242 ended: the server is stopping" in text
    errors = [line for line in text.splitlines() if ERROR_LINE.search(line)]
    assert errors == [], "\n".join(errors)
