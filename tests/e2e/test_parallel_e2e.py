"""CFG-parallel (2 ranks) and CFG + Ulysses (4 ranks) models through the real server.

Tolerance for images: every rank runs the sequential pipeline's float32 layer code; the
only differences are reassociations (thread count, head/token split), a few float32 ulps
of the final state, which can move a pixel across a rounding boundary: decoded PNG pixels
may differ by at most 1 level of 255, and almost all must be identical.
"""

from __future__ import annotations

import base64
import io
import re
import signal
import threading
import time

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from conftest import COND_TOKENS, DEFAULT_SIZE, DEFAULT_STEPS, UNCOND_TOKENS
from PIL import Image
from tritonclient.utils import InferenceServerException

from testing import lightllm_client_module
from testing.faults import rank_pids, signal_own
from testing.pictures import same_pixels
from testing.tiny_checkpoint import random_kv, tiny_config

STEPS_METRIC = "neopp_denoising_steps_total"
PARALLEL = ("neopp_dense_cfg", "neopp_dense_cfg_seq")


def infer(triton, model: str, timeout: float = 180.0, **overrides):
    return triton.grpc.infer(model, triton.grpc_tensors(**overrides), client_timeout=timeout)


def pixels(result) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(result.as_numpy("IMAGE")[0])).convert("RGB")).astype(int)


CASES = {  # name -> request overrides
    "cfg-on": {},
    "cfg-off": {"CFG_SCALE": np.array([1.0], np.float32)},
    "partial-interval": {"CFG_INTERVAL": np.array([0.3, 0.8], np.float32), "STEPS": np.array([5], np.int64)},
    "odd-tokens-96x160": {"SIZE": np.array([96, 160], np.int64)},
}


@pytest.mark.parametrize("model", PARALLEL)
@pytest.mark.parametrize("case", list(CASES))
def test_parallel_model_equals_single_device(triton, model, case):
    seed = np.array([77], np.int64)
    expected = pixels(infer(triton, "neopp_dense", SEED=seed, **CASES[case]))
    got = pixels(infer(triton, model, SEED=seed, **CASES[case]))
    assert got.shape == expected.shape
    diff = np.abs(got - expected)
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01


def test_image_editing_gives_the_same_png_on_dense_and_cfg(triton):
    """Three branches (IMAGE_GUIDANCE_SCALE 2 != CFG_SCALE): batched on one device, or spread over
    2 CFG ranks with one rank carrying two; the same pixels either way."""
    image_kv = random_kv(tiny_config("dense"), 15, seed=5).float().numpy()
    edit = {"SEED": np.array([31], np.int64), "IMAGE_KV": (image_kv, "BF16"),
            "INDEX_OFFSET_IMAGE": np.array([15], np.int64), "IMAGE_GUIDANCE_SCALE": np.array([2.0], np.float32)}
    dense = infer(triton, "neopp_dense", **edit).as_numpy("IMAGE")[0]
    assert same_pixels(infer(triton, "neopp_dense_cfg", **edit).as_numpy("IMAGE")[0], dense)  # records name the model
    assert dense[:8] == b"\x89PNG\r\n\x1a\n"
    # the image branch and its scale enter the result
    assert infer(triton, "neopp_dense", SEED=edit["SEED"]).as_numpy("IMAGE")[0] != dense
    other_scale = dict(edit, IMAGE_GUIDANCE_SCALE=np.array([1.5], np.float32))
    assert infer(triton, "neopp_dense", **other_scale).as_numpy("IMAGE")[0] != dense

    # LightLLM's calls through the client: the image branch and its scale are sent, not dropped
    lightllm = lightllm_client_module()
    with lightllm.NeoPPTritonClient(triton.server.grpc_url, stateless=True, model="neopp_dense",
                                    shared_memory=False) as client:
        client.set_kvcache_i2i(triton.cond, triton.uncond, torch.from_numpy(image_kv))
        client.set_inference_params(COND_TOKENS, UNCOND_TOKENS, infer_steps=DEFAULT_STEPS, output_format="png",
                                    image_guidance_scale=2.0, index_offset_image=15)
        assert base64.b64decode(client.generate(seed=31, target_shape=list(DEFAULT_SIZE))) == dense
        client.set_kvcache(triton.cond, triton.uncond)
        with pytest.raises(InferenceServerException, match="IMAGE_KV: required together with INDEX_OFFSET_IMAGE"):
            client.generate(seed=31, target_shape=list(DEFAULT_SIZE))  # the offset alone is not dropped
        client.set_inference_params(COND_TOKENS, UNCOND_TOKENS, infer_steps=DEFAULT_STEPS, output_format="png",
                                    image_guidance_scale=2.0)
        with pytest.raises(InferenceServerException, match="IMAGE_GUIDANCE_SCALE: 2 refused without the image"):
            client.generate(seed=31, target_shape=list(DEFAULT_SIZE))


def test_log_states_whether_cfg_parallel_was_active(triton):
    seed = np.array([1], np.int64)
    infer(triton, "neopp_dense_cfg", SEED=seed)
    infer(triton, "neopp_dense_cfg", SEED=seed, CFG_SCALE=np.array([1.0], np.float32))
    infer(triton, "neopp_dense_cfg", SEED=seed, UNCOND_KV=None, INDEX_OFFSET_UNCOND=None,
          CFG_SCALE=np.array([0.5], np.float32))
    # 5 steps start at t = 0, .08, .18, .33, .57: the last two lie inside [0.3, 0.8]
    infer(triton, "neopp_dense_cfg", SEED=seed, **CASES["partial-interval"])
    infer(triton, "neopp_dense_cfg_seq", SEED=seed)
    infer(triton, "neopp_dense_8steps", SEED=seed)  # the request's STEPS (4) replaces the mode's 8
    infer(triton, "neopp_dense", SEED=seed)
    line = r"{}: 64x64 task=t2i prefix=24\+{} tokens steps={} png \d+ B e2e_time_ms=\d+ {} {}"
    off_seq = re.escape("seq_parallel=off(reason=one_seq_rank)")
    want = [line.format("neopp_dense_cfg", 7, 4, "cfg_parallel=on", off_seq),
            line.format("neopp_dense_cfg", 7, 4, re.escape("cfg_parallel=off(reason=cfg_scale<=1)"), off_seq),
            line.format("neopp_dense_cfg", 0, 4, re.escape("cfg_parallel=off(reason=cfg_scale<=1)"), off_seq),
            line.format("neopp_dense_cfg", 7, 5,
                        re.escape("cfg_parallel=partial(steps=2/5,reason=steps_outside_cfg_interval)"), off_seq),
            line.format("neopp_dense_cfg_seq", 7, 4, "cfg_parallel=on", re.escape("seq_parallel=on(ranks=2)")),
            line.format("neopp_dense_8steps", 7, 4, re.escape("cfg_parallel=off(reason=guidance_off_in_mode)"),
                        off_seq),
            line.format("neopp_dense", 7, 4, re.escape("cfg_parallel=off(reason=one_cfg_rank)"), off_seq)]
    log = triton.log_once(lambda text: all(re.search(w, text) for w in want))
    for pattern in want:
        assert re.search(pattern, log), pattern


def _rank_pids(triton, model: str) -> list[int]:
    """Rank workers of a model under this suite's server only (its tree and process group)."""
    return rank_pids(triton.server.process.pid, model)


def _kill(triton, pid: int) -> None:
    signal_own(triton.server.process.pid, pid, signal.SIGKILL)


def test_rank_killed_between_requests_is_rebuilt(triton):
    seed = np.array([9], np.int64)
    expected = infer(triton, "neopp_dense_cfg", SEED=seed).as_numpy("IMAGE")[0]
    ranks = _rank_pids(triton, "neopp_dense_cfg")
    assert len(ranks) == 2
    _kill(triton, ranks[1])
    assert infer(triton, "neopp_dense_cfg", SEED=seed).as_numpy("IMAGE")[0] == expected
    assert ranks[1] not in _rank_pids(triton, "neopp_dense_cfg")


def test_rank_killed_during_request_fails_cleanly_then_recovers(triton):
    model, seed = "neopp_dense_cfg_seq", np.array([9], np.int64)
    expected = infer(triton, model, SEED=seed).as_numpy("IMAGE")[0]
    ranks = _rank_pids(triton, model)
    assert len(ranks) == 4
    outcome: dict = {}

    def long_request() -> None:
        try:
            infer(triton, model, SEED=seed, STEPS=np.array([200], np.int64), SIZE=np.array([256, 256], np.int64))
            outcome["result"] = "ok"
        except InferenceServerException as exc:
            outcome["error"] = exc

    before = triton.metric(STEPS_METRIC, model=model)
    worker = threading.Thread(target=long_request)
    worker.start()
    assert triton.wait_metric(STEPS_METRIC, before + 2, timeout=120, model=model) >= before + 2, "no step ran"
    started = time.monotonic()
    _kill(triton, ranks[2])
    worker.join(timeout=120)
    assert not worker.is_alive()
    assert "error" in outcome, "the request should fail when a rank dies"
    assert "died" in str(outcome["error"]) and "restarted" in str(outcome["error"])
    assert time.monotonic() - started < 60
    assert infer(triton, model, SEED=seed).as_numpy("IMAGE")[0] == expected
    assert triton.grpc.is_server_ready()


def test_worker_count_must_match_mode_file(triton):
    """A config whose worker_processes disagrees with the mode's parallel sizes is refused at load."""
    client: grpcclient.InferenceServerClient = triton.grpc
    config = client.get_model_config("neopp_dense_cfg_seq", as_json=True)["config"]
    config["parameters"]["worker_processes"] = {"string_value": "2"}
    import json

    with pytest.raises(InferenceServerException, match="must equal the product of the parallel sizes"):
        client.load_model("neopp_dense_cfg_seq", config=json.dumps(config))
    client.load_model("neopp_dense_cfg_seq")  # restore from the repository
    assert client.is_model_ready("neopp_dense_cfg_seq")
