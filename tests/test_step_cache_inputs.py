"""The step cache's inputs: the Triton tensors, the OpenAI body, the model's ``cache_methods`` and the
mode's own rules, each refused by name."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from tritonclient.grpc import service_pb2 as pb

from neopp.errors import ConfigError, InputError
from neopp.launcher.door import openai_images as oa
from neopp.limits import Limits
from neopp.modes import ModeSpec
from neopp.serving.model_settings import _cache_methods
from neopp.serving.request_parsing import parse_request


def _inputs(**overrides):
    base = {"COND_KV": torch.zeros(2, 2, 3, 2, 32, dtype=torch.bfloat16), "INDEX_OFFSET_COND": np.array([5], np.int64)}
    base.update(overrides)
    return base


def test_cache_inputs_reach_the_sampling_params():
    req = parse_request(_inputs(CACHE=np.array([b"FBCache"], np.object_),
                                CACHE_THRESHOLD=np.array([0.25], np.float32)), Limits())
    assert (req.sampling_params.cache, req.sampling_params.cache_threshold) == ("fbcache", 0.25)
    plain = parse_request(_inputs(), Limits()).sampling_params
    assert (plain.cache, plain.cache_threshold) == ("off", None)


@pytest.mark.parametrize("overrides,message", [
    ({"CACHE": np.array([b"magcache"], np.object_)}, "CACHE: unknown method 'magcache'"),
    ({"CACHE": np.array([1], np.int64)}, "CACHE:"),
    ({"CACHE_THRESHOLD": np.array([0.1], np.float64)}, "CACHE_THRESHOLD: datatype must be FP32"),
    ({"CACHE_THRESHOLD": np.array([0.1], np.float32)}, "CACHE_THRESHOLD: 0.1 given with cache off"),
    ({"CACHE": np.array([b"fbcache"], np.object_), "CACHE_THRESHOLD": np.array([2.0], np.float32)},
     "CACHE_THRESHOLD: must be a number in"),
])
def test_bad_cache_inputs_are_refused_by_name(overrides, message):
    with pytest.raises(InputError) as info:
        parse_request(_inputs(**overrides), Limits())
    assert str(info.value).startswith(message)


def test_the_openai_body_carries_cache_and_its_threshold():
    req, _ = oa.parse_images_request({"prompt": "a red circle", "cache": "taylorseer", "cache_threshold": 0.2})
    sent = pb.ModelInferRequest.FromString(oa.prompt_model_request(req, 0).serialize())
    raw = dict(zip((t.name for t in sent.inputs), sent.raw_input_contents))
    assert raw["CACHE"] == struct.pack("<I", 10) + b"taylorseer"
    assert np.frombuffer(raw["CACHE_THRESHOLD"], "<f4").tolist() == [np.float32(0.2)]
    plain = pb.ModelInferRequest.FromString(oa.prompt_model_request(oa.parse_images_request({"prompt": "x"})[0], 0)
                                            .serialize())
    assert {"CACHE", "CACHE_THRESHOLD"}.isdisjoint(t.name for t in plain.inputs)  # absent: the model's off
    for doc, param in (({"prompt": "x", "cache_threshold": 0}, "cache_threshold"),
                       ({"prompt": "x", "cache_threshold": "low"}, "cache_threshold"),
                       ({"prompt": "x", "cache": 3}, "cache"), ({"prompt": "x", "cache": "x" * 40}, "cache")):
        with pytest.raises(oa.OpenAIError) as info:
            oa.parse_images_request(doc)
        assert info.value.param == param
    refused = oa.refusal(400, "CACHE: 'fbcache' is not offered by this model (mode neopp_dense_8steps: ...)", {})
    assert refused.param == "cache"


def test_cache_methods_parameter_and_what_a_mode_offers():
    assert _cache_methods("auto") is None and _cache_methods("") == () and _cache_methods("None") == ()
    assert _cache_methods(" FBCache, taylorseer ") == ("fbcache", "taylorseer")
    assert ModeSpec().step_caches == ("fbcache", "taylorseer")
    assert ModeSpec(cache_methods=("fbcache",)).step_caches == ("fbcache",)
    assert ModeSpec(seq_p_size=2).step_caches == ()  # auto on Ulysses ranks: none
    with pytest.raises(ConfigError, match="cache_methods: unknown method 'magcache'"):
        ModeSpec(cache_methods=("magcache",)).check()
    with pytest.raises(ConfigError, match="not offered with Ulysses"):
        ModeSpec(seq_p_size=2, cache_methods=("fbcache",)).check()
