"""The streaming models' extra inputs: previews, base64 KV for JSON clients, base64 outputs."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from neopp.errors import InputError
from neopp.limits import Limits
from neopp.serving.stream_parsing import (
    PREVIEW_MAX_SIDE,
    StreamOptions,
    decode_kv_b64,
    default_preview_size,
    parse_stream_request,
    refuse_input_like_parameters,
)
from testing.tiny_checkpoint import random_kv, tiny_config

CFG = tiny_config("dense")
DIMS = (2, 2, 32)  # layers, kv_heads, head_dim of the tiny checkpoint
LIMITS = Limits(max_steps=50, max_request_bytes=1 << 20)


def b64(kv: torch.Tensor) -> np.ndarray:
    raw = kv.to(torch.bfloat16).contiguous().view(torch.uint8).numpy().tobytes()
    return np.array([base64.b64encode(raw)], dtype=np.object_)


def inputs(**extra):
    base = {"COND_KV": random_kv(CFG, 5, seed=1), "INDEX_OFFSET_COND": np.array([5], np.int64)}
    base.update(extra)
    return {k: v for k, v in base.items() if v is not None}


def test_dims_match_the_tiny_checkpoint():
    kv = random_kv(CFG, 1, seed=0)
    assert (kv.shape[0], kv.shape[3], kv.shape[4]) == DIMS


def test_plain_inputs_parse_as_the_plain_models_and_options_default_off():
    parsed, options = parse_stream_request(inputs(STEPS=np.array([7], np.int64)), LIMITS, DIMS)
    assert parsed.sampling_overrides["infer_steps"] == 7 and parsed.prefix_tokens == 5
    assert options == StreamOptions()


def test_base64_kv_is_the_same_tensor():
    cond, uncond = random_kv(CFG, 9, seed=3), random_kv(CFG, 4, seed=4)
    parsed, _ = parse_stream_request(inputs(COND_KV=None, COND_KV_B64=b64(cond), UNCOND_KV_B64=b64(uncond),
                                            INDEX_OFFSET_UNCOND=np.array([4], np.int64)), LIMITS, DIMS)
    assert torch.equal(parsed.cond_kv, cond) and torch.equal(parsed.uncond_kv, uncond)
    assert parsed.cond_kv.dtype == torch.bfloat16 and parsed.index_offset_uncond == 4


def test_preview_options():
    _, options = parse_stream_request(inputs(PREVIEW_EVERY=np.array([3], np.int64),
                                             PREVIEW_SIZE=np.array([40, 24], np.int64),
                                             BASE64_OUTPUT=np.array([1], np.int64)), LIMITS, DIMS)
    assert options == StreamOptions(3, (40, 24), True)


@pytest.mark.parametrize("extra, message", [
    ({"PREVIEW_EVERY": np.array([-1], np.int64)}, r"^PREVIEW_EVERY: must be 0 \(no previews\) \.\. 50"),
    ({"PREVIEW_EVERY": np.array([51], np.int64)}, "^PREVIEW_EVERY: must be 0"),
    ({"PREVIEW_EVERY": np.array([1.0], np.float32)}, "^PREVIEW_EVERY: datatype must be INT64"),
    ({"PREVIEW_SIZE": np.array([0, 10], np.int64)}, f"^PREVIEW_SIZE: .* must each be 1..{PREVIEW_MAX_SIDE}"),
    ({"PREVIEW_SIZE": np.array([10, PREVIEW_MAX_SIDE + 1], np.int64)}, "^PREVIEW_SIZE: "),
    ({"PREVIEW_SIZE": np.array([10], np.int64)}, r"^PREVIEW_SIZE: shape must be \[2\]"),
    ({"BASE64_OUTPUT": np.array([2], np.int64)}, "^BASE64_OUTPUT: must be 0 or 1"),
    ({"COND_KV_B64": b64(random_kv(CFG, 2, seed=0))}, "^COND_KV_B64: give one of COND_KV and COND_KV_B64"),
    ({"COND_KV": None}, "^COND_KV: required input is missing"),
    ({"COND_KV": None, "COND_KV_B64": np.array([b"not base64!"], np.object_)}, "^COND_KV_B64: must be base64"),
    ({"COND_KV": None, "COND_KV_B64": np.array([base64.b64encode(b"\0" * 10)], np.object_)},
     "^COND_KV_B64: 10 decoded bytes are not a positive whole number of tokens of 512 bytes"),
    ({"COND_KV": None, "COND_KV_B64": np.array([b""], np.object_)}, "^COND_KV_B64: 0 decoded bytes"),
    ({"SOMETHING": np.array([1], np.int64)}, "^SOMETHING: unknown input"),
    ({"STEPS": np.array([0], np.int64)}, "^STEPS: "),  # the plain rules still apply
])
def test_refusals_name_the_input_and_the_rule(extra, message):
    with pytest.raises(InputError, match=message):
        parse_stream_request(inputs(**extra), LIMITS, DIMS)


def test_preview_size_stays_within_a_smaller_max_side():
    with pytest.raises(InputError, match=r"^PREVIEW_SIZE: \[height, width\] must each be 1..512, got \[600, 10\]"):
        parse_stream_request(inputs(PREVIEW_SIZE=np.array([600, 10], np.int64)), Limits(max_side=512), DIMS)


def test_base64_text_is_bounded_before_decoding():
    big = np.array([b"A" * (2 << 20)], np.object_)
    with pytest.raises(InputError, match="^COND_KV_B64: the request's inputs hold .* over the limit max_request_bytes"):
        parse_stream_request(inputs(COND_KV=None, COND_KV_B64=big), LIMITS, DIMS)


def test_decode_shape_comes_from_the_checkpoint():
    kv = random_kv(CFG, 3, seed=7)
    assert decode_kv_b64("COND_KV_B64", b64(kv), DIMS).shape == (2, 2, 3, 2, 32)
    with pytest.raises(InputError, match=r"^X: shape must be \[1\]"):
        decode_kv_b64("X", np.array([b"", b""], np.object_), DIMS)


@pytest.mark.parametrize("size, want", [((64, 64), (64, 64)), ((1024, 512), (256, 128)), ((512, 2048), (64, 256)),
                                        ((1000, 30), (256, 8))])
def test_default_preview_size_scales_the_longer_side_to_256(size, want):
    assert default_preview_size(*size) == want


def test_base64_prefix_over_the_token_limit_is_refused_before_decoding():
    limits = Limits(max_steps=50, max_request_bytes=1 << 20, max_prefix_tokens=4)
    at_limit = parse_stream_request(inputs(COND_KV=None, COND_KV_B64=b64(random_kv(CFG, 4, seed=2))), limits, DIMS)
    assert at_limit[0].cond_kv.shape[2] == 4
    with pytest.raises(InputError, match=r"^COND_KV_B64: .* hold at least 5 tokens .* max_prefix_tokens=4"):
        parse_stream_request(inputs(COND_KV=None, COND_KV_B64=b64(random_kv(CFG, 5, seed=2))), limits, DIMS)
    with pytest.raises(InputError, match=r"^COND_KV_B64: 4096 characters of base64 hold at least 6 tokens"):
        parse_stream_request(inputs(COND_KV=None, COND_KV_B64=b64(random_kv(CFG, 6, seed=2))), limits, DIMS)
    # the length alone decides: text that is not even base64 is refused for its size, never decoded
    junk = np.array([b"!" * (512 * 8 * 4 // 3)], np.object_)
    with pytest.raises(InputError, match=r"^IMAGE_KV_B64: .* over the limit max_prefix_tokens=4"):
        parse_stream_request(inputs(IMAGE_KV_B64=junk, INDEX_OFFSET_IMAGE=np.array([1], np.int64)), limits, DIMS)


def test_parameters_spelt_like_inputs_are_refused():
    # what Triton hands the model for generate_stream's {"PREVIEW_EVRY": 1, ...}: a parameter
    with pytest.raises(InputError, match=r"^PREVIEW_EVRY: unknown input; expected names from \['BASE64_OUTPUT'"):
        refuse_input_like_parameters('{"PREVIEW_EVRY": 1}')
    with pytest.raises(InputError, match="^SEEED: unknown input"):
        refuse_input_like_parameters({"priority": 0, "SEEED": 3})
    for fine in ("", "{}", '{"priority": 0, "triton_enable_empty_final_response": true}', None):
        refuse_input_like_parameters(fine)
