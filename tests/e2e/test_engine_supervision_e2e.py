"""The engine's loop under failures no rule foresaw, against the real launcher and tritonserver
(``neopp_dense`` and its streamed twin, one engine): an adapter torch cannot apply ends its own
request and the next is served; a refusal of any size is answered; a loop that dies anyway (the
fault drill, ``neopp.engines.fault_point``) makes the model unready within 2 s, ends what it held
with 503 / UNAVAILABLE (a gRPC stream and the door's ``/v1`` stream with an error event) and the
model is replaced."""

from __future__ import annotations

import http.client
import json
import queue
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from safetensors.torch import load_file, save_file
from tritonclient.utils import InferenceServerException

from neopp.engines.fault_point import FAULT_ENV
from neopp.ports import LOOPBACK
from testing.door_attacks import request
from testing.door_requests import MODEL, grpc_image, http_infer, ready, tensors
from testing.faults import kill_own_stub, stub_pid
from testing.launched import serving
from testing.tiny_checkpoint import tiny_config, tiny_tensors
from testing.tiny_lora import write_tiny_loras

STREAM = "neopp_dense_stream"
PARALLEL = "neopp_dense_cfg"  # its engine on two rank processes
DEMO_DENSE = Path(__file__).resolve().parents[2] / "demo" / "checkpoints" / "dense"
TIMEOUT_S = 120
RELOADED = rf"neopp watchdog: {MODEL}: reload done"


def _text(value: str) -> np.ndarray:
    return np.array([value.encode()], dtype=object)


def write_attack_adapters(folder: Path) -> None:
    """Adapters that pass the file format but fail inside torch: float8 factors (``isfinite``
    cannot take them) and rank-0 pairs with an ``alpha`` (a division by zero); and a large folder."""
    files = write_tiny_loras(folder, tiny_tensors(tiny_config("dense"), 0))  # the tiny checkpoint's shapes
    base = load_file(str(files["lora_up_down"]))
    save_file({k: v if k.endswith(".alpha") else v.to(torch.float8_e4m3fn) for k, v in base.items()},
              str(folder / "lora_fp8.safetensors"))
    rank0 = {k: (v if k.endswith(".alpha") else v[:0] if "lora_down" in k else v[:, :0]) for k, v in base.items()}
    save_file({k: v.contiguous() for k, v in rank0.items()}, str(folder / "lora_rank0.safetensors"))
    for i in range(12000):  # names alone over the framing's 1 MiB
        (folder / f"adapter_{i:05d}_{'x' * 90}.safetensors").touch()


@pytest.fixture(scope="module")
def served(tiny_dense: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("supervised")
    (root / "lora").mkdir()
    write_attack_adapters(root / "lora")
    yield from _launched_with_fault(root, {"NEOPP_CHECKPOINT": str(tiny_dense), "NEOPP_LORA_DIR": str(root / "lora")},
                                    (MODEL, STREAM, PARALLEL))


def _launched_with_fault(root: Path, env: dict[str, str], models: tuple[str, ...]):
    """The launcher serving ``models`` with the loop's fault drill armed by the file ``root/fault``."""
    fault = root / "fault"
    with serving(root / "serve.log", {**env, FAULT_ENV: str(fault)}, models) as handle:
        try:
            yield handle, fault
        finally:
            fault.unlink(missing_ok=True)


def grpc_infer(door, kv, model: str = MODEL, **extra) -> grpcclient.InferResult:
    client = grpcclient.InferenceServerClient(f"{LOOPBACK}:{door.grpc_port}")
    try:
        inputs = tensors(grpcclient, kv)
        for name, value in extra.items():
            tensor = grpcclient.InferInput(name, list(value.shape), "BYTES")
            tensor.set_data_from_numpy(value)
            inputs.append(tensor)
        return client.infer(model, inputs, client_timeout=TIMEOUT_S)
    finally:
        client.close()


@pytest.mark.parametrize("model", [MODEL, PARALLEL])
@pytest.mark.parametrize("adapter", ["lora_fp8", "lora_rank0"])
def test_an_adapter_torch_cannot_apply_ends_its_request_and_the_next_is_served(served, kv, adapter, model):
    door, _ = served
    if adapter == "lora_fp8":  # FP8 factors are upcast exactly when read: the request draws
        assert grpc_infer(door, kv, model, LORA=_text(adapter)).as_numpy("IMAGE") is not None
    else:
        with pytest.raises(InferenceServerException) as refused:
            grpc_infer(door, kv, model, LORA=_text(adapter))
        assert refused.value.status() in ("StatusCode.INTERNAL", "StatusCode.INVALID_ARGUMENT"), refused.value
    assert grpc_infer(door, kv, model).as_numpy("IMAGE") is not None  # the loop lives: the next one is served
    assert ready(door) and model_ready(door, model)


def test_an_unknown_adapter_in_a_large_folder_is_refused_not_left(served, kv):
    door, _ = served
    with pytest.raises(InferenceServerException) as refused:
        grpc_infer(door, kv, LORA=_text("no_such_adapter"))
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT" and "LORA" in refused.value.message()
    assert len(refused.value.message()) < 10_000
    assert grpc_image(door, kv, seed=4)


def model_ready(door, model: str) -> bool:
    status, _, _ = request(door.http_port, f"GET /v2/models/{model}/ready HTTP/1.1\r\nHost: localhost\r\n"
                           "Connection: close\r\n\r\n".encode(), timeout=5)
    return status == 200


def _running_stream(door, kv) -> tuple[grpcclient.InferenceServerClient, queue.Queue]:
    """A long stream whose first step came. Just after a replacement the twin may still reach the
    old engine, which answers UNAVAILABLE or goes away as it is unloaded (both say retry): it is
    started again then, for at most a minute."""
    deadline = time.monotonic() + 60
    while True:
        answers: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(f"{LOOPBACK}:{door.grpc_port}")
        client.start_stream(callback=lambda result, error, into=answers: into.put((result, error)))
        client.async_stream_infer(STREAM, tensors(grpcclient, kv, size=(256, 256), steps=200, seed=8))
        _, error = answers.get(timeout=TIMEOUT_S)
        if error is None:
            return client, answers
        client.stop_stream()
        client.close()
        assert "retry" in error.message() and time.monotonic() < deadline, error.message()
        time.sleep(0.2)


def test_a_dead_loop_is_unready_within_2s_ends_what_it_held_and_is_replaced(served, kv):
    door, fault = served
    held: list = []
    http = threading.Thread(target=lambda: held.append(http_infer(door, kv, 9, size=(256, 256), steps=200)),
                            daemon=True)
    client, answers = _running_stream(door, kv)
    try:
        http.start()
        time.sleep(1.0)  # the plain request joins the running batch
        fault.touch()
        killed = time.monotonic()
        while ready(door) or model_ready(door, STREAM):
            assert time.monotonic() - killed < 2.0, "the model or its twin stayed ready with their loop dead"
            time.sleep(0.05)
        unready_s = time.monotonic() - killed
        fault.unlink()  # the replacement's loop runs
        while True:  # the stream ends with an error event, never silence
            result, error = answers.get(timeout=TIMEOUT_S)
            if error is not None:
                break
        assert error.message().startswith("engine unavailable") and "retry" in error.message(), error.message()
        http.join(TIMEOUT_S)
        status, headers, _ = held[0]
        assert status == 503 and "retry-after" in headers, (status, headers)
    finally:
        client.stop_stream()
        client.close()
    while True:  # over gRPC while the engine is replaced: UNAVAILABLE, never INTERNAL
        try:
            image = grpc_image(door, kv, seed=6)
            break
        except InferenceServerException as exc:
            assert exc.status() == "StatusCode.UNAVAILABLE", exc
            assert time.monotonic() - killed < 180, "never replaced"
            time.sleep(0.2)
    assert image and ready(door)
    deadline = time.monotonic() + 60
    while not model_ready(door, STREAM):  # the twin is ready again once its engine beats alive
        assert time.monotonic() < deadline, "the twin stayed unready"
        time.sleep(0.1)
    door.wait_for(RELOADED)
    print(f"unready {unready_s:.2f}s after the loop died; serving again after {time.monotonic() - killed:.1f}s")



def test_a_stream_whose_engine_stub_is_killed_ends_with_an_error_event(served, kv):
    """The engine's process dies (its stub, SIGKILLed the launcher's safe way): the streamed twin,
    another process, ends the stream with an error event at once; the model is then reloaded."""
    door, _ = served
    reloads = len(re.findall(RELOADED, door.text()))
    client, answers = _running_stream(door, kv)
    try:
        kill_own_stub(door.server_pid, stub_pid(door.server_pid, MODEL))
        killed = time.monotonic()
        while True:
            result, error = answers.get(timeout=30)
            if error is not None:
                break
        assert "went away" in error.message() and "retry" in error.message(), error.message()
        print(f"the stream's error event came {time.monotonic() - killed:.2f}s after the kill")
    finally:
        client.stop_stream()
        client.close()
    door.wait_for(RELOADED, count=reloads + 1)
    deadline = time.monotonic() + 180
    while True:
        try:
            assert grpc_image(door, kv, seed=7)
            break
        except InferenceServerException:
            assert time.monotonic() < deadline, "never served again"
            time.sleep(0.5)


@pytest.fixture(scope="module")
def served_v1(tmp_path_factory: pytest.TempPathFactory):
    """The launcher on the demo checkpoint (a prompt needs its language tower) with the encoder,
    ``neopp_dense`` and its streamed twin: the door's ``/v1`` stream with previews."""
    root = tmp_path_factory.mktemp("supervised_v1")
    yield from _launched_with_fault(root, {"NEOPP_CHECKPOINT": str(DEMO_DENSE)},
                                    ("neopp_prompt_encoder", MODEL, STREAM))


def test_a_v1_stream_cut_by_a_dead_loop_ends_with_an_error_event(served_v1):
    door, fault = served_v1
    doc = {"model": MODEL, "prompt": "a red circle on a blue background", "size": "256x256", "stream": True,
           "partial_images": 3, "num_inference_steps": 200, "seed": 5}
    conn = http.client.HTTPConnection(LOOPBACK, door.http_port, timeout=TIMEOUT_S)
    try:
        conn.request("POST", "/v1/images/generations", body=json.dumps(doc),
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200
        assert response.readline().startswith(b"event: ")  # the stream runs: its first preview came
        fault.touch()
        events = [line.split(b":", 1)[1].strip() for line in response.read().splitlines()
                  if line.startswith(b"event:")]
    finally:
        conn.close()
        fault.unlink(missing_ok=True)
    assert events and events[-1] == b"error", events
    door.wait_for(RELOADED)
