"""Requests at fault get INVALID_ARG naming the input through the real server (gRPC), directly and
through neopp_session, short messages even for huge strings, and the server stays ready."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from small_repo import SmallServer, write_repo
from tritonclient.utils import InferenceServerException

I64, F32 = np.int64, np.float32
BF16_MAX = float(torch.finfo(torch.bfloat16).max)


@pytest.fixture(scope="module")
def small(tiny_dense, tmp_path_factory):
    root = tmp_path_factory.mktemp("limits")
    server = SmallServer(write_repo(root, {}, 2048), tiny_dense, root / "tritonserver.log").start()
    try:
        yield server
    finally:
        assert not server.stop(), "tritonserver left processes behind"


def _absurd_kv(s: SmallServer):
    return (np.full(tuple(s.cond.shape), BF16_MAX, np.float32), "BF16")


CASES = [
    ("size-int64-max", lambda s: {"SIZE": (np.array([2**63 - 1, 64], I64), "INT64")}, "SIZE"),
    ("size-huge-square", lambda s: {"SIZE": (np.array([2**40, 2**40], I64), "INT64")}, "SIZE"),
    ("shift-tiny", lambda s: {"TIMESTEP_SHIFT": (np.array([1e-38], F32), "FP32")}, "TIMESTEP_SHIFT"),
    ("shift-huge", lambda s: {"TIMESTEP_SHIFT": (np.array([3e38], F32), "FP32")}, "TIMESTEP_SHIFT"),
    ("cfg-scale-huge", lambda s: {"CFG_SCALE": (np.array([3e38], F32), "FP32")}, "CFG_SCALE"),
    ("resize-int64-max", lambda s: {"RESIZE": (np.array([2**63 - 1, 2**63 - 1], I64), "INT64")}, "RESIZE"),
    ("offset-int64-min", lambda s: {"INDEX_OFFSET_COND": (np.array([-(2**63)], I64), "INT64")},
     "INDEX_OFFSET_COND"),
    ("steps-int64-max", lambda s: {"STEPS": (np.array([2**63 - 1], I64), "INT64")}, "STEPS"),
    ("format-4mib", lambda s: {"OUTPUT_FORMAT": (np.array([b"x" * (4 << 20)], np.object_), "BYTES")},
     "OUTPUT_FORMAT"),
    ("format-non-utf8", lambda s: {"OUTPUT_FORMAT": (np.array([b"\xff\xfe"], np.object_), "BYTES")},
     "OUTPUT_FORMAT"),
    ("kv-absurd", lambda s: {"COND_KV": _absurd_kv(s), "UNCOND_KV": None, "INDEX_OFFSET_UNCOND": None,
                             "CFG_SCALE": (np.array([1.0], F32), "FP32"),
                             "STEPS": (np.array([2], I64), "INT64")},
     "COND_KV"),
]


def _refused(call) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        call()
    return info.value


def _check(err: InferenceServerException, name: str) -> None:
    assert err.status() == "StatusCode.INVALID_ARGUMENT", err.message()[:300]
    assert err.message().startswith(f"{name}: ") and len(err.message()) < 600, err.message()[:300]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_values_are_invalid_arg_naming_the_input(small, case):
    _, build, name = case
    direct = _refused(lambda: small.grpc.infer("neopp_dense", small.tensors(**build(small)),
                                               client_timeout=120))
    _check(direct, name)
    via_session = _refused(lambda: small.grpc.infer("neopp_session", small.tensors(**build(small)),
                                                    sequence_id=77, sequence_start=True, sequence_end=True,
                                                    client_timeout=120))
    _check(via_session, name)
    assert small.grpc.is_server_ready() and small.grpc.is_model_ready("neopp_dense")


@pytest.mark.parametrize("model", [b"\xff\xfeneopp", b"m" * (1 << 20)])
def test_a_bad_model_name_is_invalid_arg_naming_model(small, model):
    tensors = small.tensors(MODEL=(np.array([model], np.object_), "BYTES"))
    err = _refused(lambda: small.grpc.infer("neopp_session", tensors, sequence_id=78, sequence_start=True,
                                            sequence_end=True, client_timeout=120))
    _check(err, "MODEL")
    assert small.grpc.is_model_ready("neopp_session")


def test_the_server_still_generates_afterwards(small):
    seed = (np.array([1], I64), "INT64")
    result = small.grpc.infer("neopp_dense", small.tensors(SEED=seed), client_timeout=120)
    assert bytes(result.as_numpy("IMAGE")[0])[:8] == b"\x89PNG\r\n\x1a\n"
