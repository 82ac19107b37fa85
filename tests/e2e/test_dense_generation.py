"""neopp_dense through the real server: formats, sizes, metadata, and exact reproducibility."""

from __future__ import annotations

import numpy as np
import pytest

from neopp.image_io import encode_image
from neopp.model.checkpoint_config import CheckpointConfig
from neopp.modes import load_mode
from neopp.request import GenerationRequest
from neopp.runner import InProcessRunner
from neopp.sampling.pipeline import NeoPPPipeline
from neopp.sampling.rng import NoiseStream
from testing import REPO as REPO_ROOT
from testing.pictures import same_pixels

MODE_FILE = REPO_ROOT / "configs" / "neopp" / "neopp_dense.json"


@pytest.fixture(scope="module")
def pipeline(tiny_dense):
    return NeoPPPipeline.from_pretrained(tiny_dense, load_mode(MODE_FILE))


def test_metadata_reports_checkpoint_kv_geometry(triton):
    layers, kv_heads, head_dim = CheckpointConfig.from_checkpoint(triton.checkpoint).kv_dims
    meta = triton.grpc.get_model_metadata("neopp_dense", as_json=True)
    shapes = {i["name"]: [int(d) for d in i["shape"]] for i in meta["inputs"]}
    assert shapes["COND_KV"] == [layers, 2, -1, kv_heads, head_dim]
    assert shapes["UNCOND_KV"] == [layers, 2, -1, kv_heads, head_dim]
    assert shapes["IMAGE_KV"] == [layers, 2, -1, kv_heads, head_dim]
    assert shapes["INDEX_OFFSET_IMAGE"] == [1]
    http_meta = triton.http.get_model_metadata("neopp_dense")
    assert {o["name"]: o["datatype"] for o in http_meta["outputs"]} == {"IMAGE": "BYTES", "NEXT_RNG_STATE": "UINT8"}


@pytest.mark.parametrize("transport", ["grpc", "http"])
@pytest.mark.parametrize("size,fmt,pil_format", [((64, 96), "png", "PNG"), ((96, 64), "jpeg", "JPEG"),
                                                 ((64, 64), "webp", "WEBP")])
def test_image_has_requested_size_and_format(triton, transport, size, fmt, pil_format):
    overrides = dict(SIZE=np.array(size, np.int64), OUTPUT_FORMAT=np.array([fmt.encode()], np.object_),
                     SEED=np.array([1], np.int64))
    result = triton.infer_grpc(**overrides) if transport == "grpc" else triton.infer_http(**overrides)
    image = triton.image(result)
    assert image.format == pil_format
    assert image.size == (size[1], size[0])  # PIL reports (width, height)
    assert result.as_numpy("NEXT_RNG_STATE").dtype == np.uint8


def test_resize_delivers_the_requested_size(triton):
    result = triton.infer_grpc(RESIZE=np.array([40, 50], np.int64), SEED=np.array([1], np.int64))
    assert triton.image(result).size == (50, 40)


def test_default_task_and_explicit_i2i_share_the_generation_path(triton):
    text = [triton.infer_grpc(SEED=np.array([5], np.int64), TASK=np.array([t], np.object_)) for t in (b"t2i", b"i2i")]
    plain = triton.infer_grpc(SEED=np.array([5], np.int64))
    assert text[0].as_numpy("IMAGE")[0] == plain.as_numpy("IMAGE")[0] == text[1].as_numpy("IMAGE")[0]


def test_seeded_png_is_identical_across_calls_transports_and_in_process(triton, pipeline):
    seed, size = 123, (64, 96)
    overrides = dict(SEED=np.array([seed], np.int64), SIZE=np.array(size, np.int64))
    served = [triton.infer_grpc(**overrides), triton.infer_grpc(**overrides), triton.infer_http(**overrides)]
    images = [r.as_numpy("IMAGE")[0] for r in served]
    assert images[0] == images[1] == images[2]

    stream = NoiseStream(seed)
    sampling = pipeline.mode.sampling_params.replace(infer_steps=4, output_format="png")
    req = GenerationRequest(cond_kv=triton.cond, uncond_kv=triton.uncond, index_offset_cond=24,
                            index_offset_uncond=7, height=size[0], width=size[1],
                            noise=stream.draw(*size), sampling_params=sampling)
    assert same_pixels(encode_image(pipeline.generate(req), "png"), images[0])  # the served file adds its record
    assert served[0].as_numpy("NEXT_RNG_STATE").tobytes() == stream.state()


def test_rng_state_continues_the_stream_like_the_runner(triton, tiny_dense):
    runner = InProcessRunner(tiny_dense, MODE_FILE)
    runner.set_kvcache(triton.cond, triton.uncond)
    expected = []
    for seed in (200, None, None):  # LightLLM's turns: params, then generate
        runner.set_inference_params(24, 7, infer_steps=4, output_format="png")
        expected.append(runner.generate(seed=seed, size=(64, 64)))

    first = triton.infer_grpc(SEED=np.array([200], np.int64))
    second = triton.infer_http(RNG_STATE=first.as_numpy("NEXT_RNG_STATE"))
    third = triton.infer_grpc(RNG_STATE=second.as_numpy("NEXT_RNG_STATE"))
    served = [r.as_numpy("IMAGE")[0] for r in (first, second, third)]
    assert all(same_pixels(s, e) for s, e in zip(served, expected))  # the served files add their records
    assert len(set(served)) == 3  # the stream really moved on each turn


def test_without_seed_the_instance_stream_continues(triton):
    first = triton.infer_grpc()
    second = triton.infer_grpc()
    assert first.as_numpy("IMAGE")[0] != second.as_numpy("IMAGE")[0]
    # the second request drew from where the first left the instance's stream
    replay = triton.infer_grpc(RNG_STATE=first.as_numpy("NEXT_RNG_STATE"))
    assert replay.as_numpy("IMAGE")[0] == second.as_numpy("IMAGE")[0]


def test_request_is_logged_without_tensors(triton):
    triton.infer_grpc(SIZE=np.array([96, 32], np.int64), SEED=np.array([3], np.int64))
    log = triton.log_once(lambda text: "neopp_dense: 96x32" in text)
    lines = [line for line in log.splitlines() if "neopp_dense: 96x32" in line]
    assert lines and "steps=4" in lines[-1] and "prefix=24+7 tokens" in lines[-1]
    assert "tensor(" not in log
