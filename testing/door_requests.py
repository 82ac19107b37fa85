"""Requests the door's e2e tests send to the suite's launcher (``door`` fixture): the tiny
checkpoint's sample prefix as tensors, one image over gRPC or raw binary HTTP, and the checks that
the server and its model still serve."""

from __future__ import annotations

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from neopp.ports import LOOPBACK
from neopp.procs import process_group_members
from testing.door_attacks import request

MODEL = "neopp_dense"


def arrays(kv, size=(32, 32), steps=2, seed=5) -> dict[str, tuple[np.ndarray, str]]:
    return {"COND_KV": (kv[0], "BF16"), "UNCOND_KV": (kv[1], "BF16"),
            "INDEX_OFFSET_COND": (np.array([24], np.int64), "INT64"),
            "INDEX_OFFSET_UNCOND": (np.array([7], np.int64), "INT64"),
            "SIZE": (np.array(size, np.int64), "INT64"), "STEPS": (np.array([steps], np.int64), "INT64"),
            "SEED": (np.array([seed], np.int64), "INT64"), "OUTPUT_FORMAT": (np.array([b"png"], object), "BYTES")}


def tensors(module, kv, **kwargs) -> list:
    out = []
    for name, (array, dtype) in arrays(kv, **kwargs).items():
        tensor = module.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        out.append(tensor)
    return out


def grpc_image(door, kv, **kwargs) -> bytes:
    client = grpcclient.InferenceServerClient(f"{LOOPBACK}:{door.grpc_port}")
    try:
        return bytes(client.infer(MODEL, tensors(grpcclient, kv, **kwargs), client_timeout=120).as_numpy("IMAGE")[0])
    finally:
        client.close()


def alive(door, pid: int) -> None:
    assert door.server_pid == pid and process_group_members(pid), "tritonserver died"
    status, _, _ = request(door.http_port, b"GET /v2/health/ready HTTP/1.1\r\nHost: localhost\r\n"
                                           b"Connection: close\r\n\r\n")
    assert status == 200


def ready(door) -> bool:
    try:
        status, _, _ = request(door.http_port, f"GET /v2/models/{MODEL}/ready HTTP/1.1\r\nHost: localhost\r\n"
                               "Connection: close\r\n\r\n".encode(), timeout=5)
        return status == 200
    except OSError:
        return False


def http_infer(door, kv, seed: int, **kwargs) -> tuple[int, dict[str, str], bytes | None]:
    """One binary HTTP infer through the door on a fresh connection: (status, headers, image or None)."""
    body, json_size = httpclient.InferenceServerClient.generate_request_body(
        tensors(httpclient, kv, seed=seed, **kwargs))
    head = (f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: localhost\r\nContent-Length: {len(body)}\r\n"
            + (f"Inference-Header-Content-Length: {json_size}\r\n" if json_size else "") + "Connection: close\r\n\r\n")
    status, headers, answer = request(door.http_port, head.encode() + body)
    if status != 200:
        return status, headers, None
    length = headers.get("inference-header-content-length")
    result = httpclient.InferenceServerClient.parse_response_body(answer, header_length=length and int(length))
    return status, headers, bytes(result.as_numpy("IMAGE")[0])
