"""A reload that never finishes is bounded: against the real launcher serving one small Python
model whose ``initialize`` waits while a file exists (a load stuck inside Triton, on purpose).

Its stub is killed, the watchdog reloads the model, the reload hangs; after ``--reload-timeout-s``
the launcher restarts tritonserver (counted in its restart rate and on ``/metrics``), and the
replica says it is not ready until it serves again.
"""

from __future__ import annotations

import re
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from neopp.ports import LOOPBACK
from neopp.procs import model_stubs
from testing.faults import kill_own_stub, wait_for
from testing.launched import serving

MODEL = "neopp_hold"
RELOAD_TIMEOUT_S = 8
MODEL_PY = '''
import json, os, time
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        hold = json.loads(args["model_config"])["parameters"]["hold_file"]["string_value"]
        while os.path.exists(hold):  # a load that does not finish while the file is there
            time.sleep(0.05)

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN")
                                                            .as_numpy())]) for r in requests]
'''
CONFIG = '''name: "{name}"
backend: "python"
max_batch_size: 0
input [{{ name: "IN" data_type: TYPE_INT64 dims: [ 1 ] }}]
output [{{ name: "OUT" data_type: TYPE_INT64 dims: [ 1 ] }}]
instance_group [{{ kind: KIND_CPU count: 1 }}]
parameters {{ key: "hold_file" value: {{ string_value: "{hold}" }} }}
'''


@pytest.fixture(scope="module")
def held(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("hold")
    hold = root / "hold"
    (root / "repo" / MODEL / "1").mkdir(parents=True)
    (root / "repo" / MODEL / "1" / "model.py").write_text(MODEL_PY)
    (root / "repo" / MODEL / "config.pbtxt").write_text(CONFIG.format(name=MODEL, hold=hold))
    with serving(root / "serve.log", {}, (MODEL,), max_restarts=2,
                 launcher_args=["--model-repository", str(root / "repo"),
                                "--reload-timeout-s", str(RELOAD_TIMEOUT_S)]) as handle:
        try:
            yield handle, hold
        finally:
            hold.unlink(missing_ok=True)


def _echo(port: int) -> int:
    client = grpcclient.InferenceServerClient(f"{LOOPBACK}:{port}")
    try:
        tensor = grpcclient.InferInput("IN", [1], "INT64")
        tensor.set_data_from_numpy(np.array([7], np.int64))
        return int(client.infer(MODEL, [tensor], client_timeout=30).as_numpy("OUT")[0])
    finally:
        client.close()


def _status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://{LOOPBACK}:{port}{path}", timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def test_a_reload_that_never_finishes_restarts_tritonserver(held):
    launched, hold = held
    pid = launched.server_pid
    assert _echo(launched.grpc_port) == 7 and _status(launched.http_port, "/v2/health/ready") == 200
    hold.touch()  # from now on a load of the model waits
    killed_at = time.monotonic()
    kill_own_stub(pid, model_stubs(pid, MODEL)[0])
    launched.wait_for(rf"neopp watchdog: {MODEL}: no live stub .*; reloading the model", timeout=60)
    assert wait_for(lambda: _status(launched.http_port, f"/v2/models/{MODEL}/ready") == 503, 30, poll=0.1)
    assert _status(launched.http_port, "/v2/health/ready") == 503
    launched.wait_for(rf"restarting tritonserver: the reload of {MODEL} did not finish within {RELOAD_TIMEOUT_S}s",
                      timeout=RELOAD_TIMEOUT_S + 60)
    waited = time.monotonic() - killed_at
    hold.unlink()  # the next server loads the model
    assert wait_for(lambda: launched.server_pid != pid and _status(launched.http_port, "/v2/health/ready") == 200,
                    300, poll=0.2)
    assert _echo(launched.grpc_port) == 7
    metrics = urllib.request.urlopen(f"http://{LOOPBACK}:{launched.http_port}/metrics", timeout=10).read().decode()
    assert re.search(r'neopp_server_restarts_total\{reason="watchdog"\} 1', metrics), metrics
    assert "poll failed" not in launched.text()  # the watchdog stopped before its server did
    print(f"stub killed, reload stuck: tritonserver restarted {waited:.1f}s after the kill, serving again "
          f"{time.monotonic() - killed_at:.1f}s after it")
