"""Every error of the contract's Errors section: INVALID_ARG naming the input and the rule,
and the model answers the next valid request."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tritonclient.utils import InferenceServerException

I64, F32 = np.int64, np.float32


def _kv(triton, **change):
    """The cond prefix as float32, reshaped/altered for one case."""
    kv = triton.cond.float().clone()
    if "layers" in change:
        kv = torch.cat([kv, kv[:1]], 0)
    if "replay" in change:
        kv = kv.transpose(2, 3).contiguous()
    if "nan" in change:
        kv[0, 1, 3, 0, 5] = math.nan
    if "tokens" in change:
        kv = kv[:, :, :1].expand(-1, -1, change["tokens"], -1, -1).contiguous()
    if "rank4" in change:
        kv = kv[0]
    return (kv.numpy(), "BF16")


def _text(value: bytes):
    return np.array([value], np.object_)


# (id, overrides builder, input named in the message, rule fragment of the message)
CASES = [
    ("missing-cond", lambda t: {"COND_KV": None}, "COND_KV", "missing"),
    ("missing-offset", lambda t: {"INDEX_OFFSET_COND": None}, "INDEX_OFFSET_COND", "missing"),
    ("kv-rank", lambda t: {"COND_KV": _kv(t, rank4=1)}, "COND_KV", "shape"),
    ("kv-layers", lambda t: {"COND_KV": _kv(t, layers=1)}, "COND_KV", "shape"),
    ("kv-replay-layout", lambda t: {"COND_KV": _kv(t, replay=1)}, "COND_KV", "shape"),
    ("kv-nan", lambda t: {"COND_KV": _kv(t, nan=1)}, "COND_KV", "NaN"),
    ("kv-too-long", lambda t: {"COND_KV": _kv(t, tokens=32769)}, "COND_KV", "limit"),
    ("kv-wrong-dtype", lambda t: {"COND_KV": (t.cond.float().numpy(), "FP32")}, "COND_KV", "expects 'BF16'"),
    ("uncond-without-offset", lambda t: {"INDEX_OFFSET_UNCOND": None}, "INDEX_OFFSET_UNCOND", "required"),
    ("guidance-without-uncond", lambda t: {"UNCOND_KV": None, "INDEX_OFFSET_UNCOND": None}, "UNCOND_KV", "guidance"),
    ("offset-negative", lambda t: {"INDEX_OFFSET_COND": np.array([-1], I64)}, "INDEX_OFFSET_COND", "range"),
    ("offset-too-large", lambda t: {"INDEX_OFFSET_UNCOND": np.array([10**9], I64)}, "INDEX_OFFSET_UNCOND", "range"),
    ("size-not-32", lambda t: {"SIZE": np.array([64, 80], I64)}, "SIZE", "multiple of 32"),
    ("size-zero", lambda t: {"SIZE": np.array([0, 64], I64)}, "SIZE", "multiple of 32"),
    ("size-beyond-max", lambda t: {"SIZE": np.array([4096, 64], I64)}, "SIZE", "maximum"),
    ("size-wrong-dims", lambda t: {"SIZE": np.array([64, 64, 64], I64)}, "SIZE", "shape"),
    ("size-wrong-dtype", lambda t: {"SIZE": np.array([64, 64], F32)}, "SIZE", "expects 'INT64'"),
    ("steps-zero", lambda t: {"STEPS": np.array([0], I64)}, "STEPS", "1.."),
    ("steps-beyond-max", lambda t: {"STEPS": np.array([10_000], I64)}, "STEPS", "1.."),
    ("unknown-cfg-norm", lambda t: {"CFG_NORM": _text(b"layer")}, "CFG_NORM", "unknown"),
    ("unknown-format", lambda t: {"OUTPUT_FORMAT": _text(b"gif")}, "OUTPUT_FORMAT", "unknown"),
    ("unknown-task", lambda t: {"TASK": _text(b"edit")}, "TASK", "unknown"),
    ("unknown-input", lambda t: {"FOO": np.array([1], I64)}, "FOO", "unexpected"),
    ("cfg-scale-nan", lambda t: {"CFG_SCALE": np.array([math.nan], F32)}, "CFG_SCALE", "finite"),
    ("cfg-interval-reversed", lambda t: {"CFG_INTERVAL": np.array([1.0, 0.0], F32)}, "CFG_INTERVAL", "low"),
    ("shift-zero", lambda t: {"TIMESTEP_SHIFT": np.array([0.0], F32)}, "TIMESTEP_SHIFT", "> 0"),
    ("resize-zero", lambda t: {"RESIZE": np.array([0, 32], I64)}, "RESIZE", "positive"),
    ("rng-state-short", lambda t: {"RNG_STATE": np.zeros(10, np.uint8)}, "RNG_STATE", "bytes"),
    ("seed-and-rng-state", lambda t: {"SEED": np.array([1], I64), "RNG_STATE": np.zeros(10, np.uint8)}, "SEED",
     "not both"),
    ("image-guidance-without-image-kv", lambda t: {"IMAGE_GUIDANCE_SCALE": np.array([2.0], F32)},
     "IMAGE_GUIDANCE_SCALE", "refused without the image branch (image_kv / IMAGE_KV"),
    ("image-kv-without-offset", lambda t: {"IMAGE_KV": _kv(t)}, "INDEX_OFFSET_IMAGE", "required together"),
    ("image-kv-nan", lambda t: {"IMAGE_KV": _kv(t, nan=1), "INDEX_OFFSET_IMAGE": np.array([3], I64)}, "IMAGE_KV",
     "NaN"),
    ("image-offset-too-large", lambda t: {"IMAGE_KV": _kv(t), "INDEX_OFFSET_IMAGE": np.array([10**9], I64)},
     "INDEX_OFFSET_IMAGE", "range"),
    ("three-branches-without-uncond", lambda t: {"IMAGE_KV": _kv(t), "INDEX_OFFSET_IMAGE": np.array([3], I64),
                                                 "IMAGE_GUIDANCE_SCALE": np.array([2.0], F32), "UNCOND_KV": None,
                                                 "INDEX_OFFSET_UNCOND": None}, "UNCOND_KV", "image_guidance_scale 2"),
]


def _assert_valid_request_succeeds(triton):
    result = triton.infer_grpc(SEED=np.array([9], I64))
    assert triton.image(result).size == (64, 64)


@pytest.mark.parametrize("build,name,rule", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_grpc_error_is_invalid_arg_naming_input_and_rule(triton, build, name, rule):
    with pytest.raises(InferenceServerException) as info:
        triton.infer_grpc(**build(triton))
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT", info.value
    message = info.value.message()
    assert name in message and rule in message, message
    _assert_valid_request_succeeds(triton)


@pytest.mark.parametrize("case", ["kv-nan", "size-not-32", "unknown-format", "guidance-without-uncond"])
def test_http_error_is_400_naming_input_and_rule(triton, case):
    _, build, name, rule = next(c for c in CASES if c[0] == case)
    with pytest.raises(InferenceServerException) as info:
        triton.infer_http(**build(triton))
    assert info.value.status() == "400", info.value
    assert name in info.value.message() and rule in info.value.message(), info.value.message()
    _assert_valid_request_succeeds(triton)
    assert triton.http.is_server_ready() and triton.http.is_model_ready("neopp_dense")


def test_failed_request_does_not_advance_the_instance_stream(triton):
    before = triton.infer_grpc()
    with pytest.raises(InferenceServerException):
        triton.infer_grpc(SIZE=np.array([64, 80], I64))
    after = triton.infer_grpc()
    replay = triton.infer_grpc(RNG_STATE=before.as_numpy("NEXT_RNG_STATE"))
    assert after.as_numpy("IMAGE")[0] == replay.as_numpy("IMAGE")[0]


def test_8step_mode_refuses_image_guidance_even_with_the_image_branch(triton):
    """Guidance is off in the 8-step mode (enable_cfg false): IMAGE_GUIDANCE_SCALE != 1 is refused."""
    tensors = triton.grpc_tensors(IMAGE_KV=_kv(triton), INDEX_OFFSET_IMAGE=np.array([3], I64),
                                  IMAGE_GUIDANCE_SCALE=np.array([2.0], F32))
    with pytest.raises(InferenceServerException) as info:
        triton.grpc.infer("neopp_dense_8steps", tensors)
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT", info.value
    assert "IMAGE_GUIDANCE_SCALE: 2 refused; guidance is disabled" in info.value.message()
    assert triton.grpc.infer("neopp_dense_8steps", triton.grpc_tensors(SEED=np.array([9], I64))) is not None
