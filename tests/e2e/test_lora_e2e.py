"""LoRA per request through the real tritonserver (the suite's shared server; its adapter directory
is NEOPP_LORA_DIR, the tiny LoRA files): the 8-step adapter on neopp_dense draws what the merged
neopp_dense_8steps model draws, concurrent requests on different adapters each get their solo
bytes, and every refusal names its input while the server stays ready."""

from __future__ import annotations

import queue

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from safetensors.torch import save_file
from tritonclient.utils import InferenceServerException

from testing.stream_requests import assert_pixels_match, assert_pixels_near
from testing.tiny_checkpoint import tiny_config, tiny_tensors
from tests.e2e.conftest import MODEL, TritonHandle, ensure_8steps_lora

TIMEOUT_S = 120


def text(value: str) -> np.ndarray:
    return np.array([value.encode()], np.object_)


def pixels(result) -> np.ndarray:
    return np.asarray(TritonHandle.image(result).convert("RGB"))


def infer(triton: TritonHandle, model: str = MODEL, **overrides) -> grpcclient.InferResult:
    return triton.grpc.infer(model, triton.grpc_tensors(**overrides), client_timeout=TIMEOUT_S)


def test_the_8step_adapter_on_neopp_dense_draws_what_the_merged_8step_model_draws(triton: TritonHandle):
    """Merged at load in float32 against unmerged per row: the same image up to a rounding flip."""
    common = {"STEPS": np.array([8], np.int64), "SEED": np.array([5], np.int64), "UNCOND_KV": None,
              "INDEX_OFFSET_UNCOND": None}
    merged = pixels(infer(triton, "neopp_dense_8steps", **common))
    unmerged = pixels(infer(triton, LORA=text("neopp_8steps_lora"), CFG_SCALE=np.array([1.0], np.float32),
                            **common))
    base = pixels(infer(triton, CFG_SCALE=np.array([1.0], np.float32), **common))
    assert_pixels_near(unmerged, merged, "LORA=neopp_8steps_lora against neopp_dense_8steps")
    assert (base != merged).mean() > 0.2  # negative control: the adapter changes the image


def test_concurrent_requests_on_different_adapters_equal_their_solo_bytes(triton: TritonHandle):
    cases = [{}, {"LORA": text("lora_up_down")}, {"LORA": text("lora_B_A"), "LORA_SCALE": np.array([0.5], np.float32)},
             {"LORA": text("lora_peft"), "SEED": np.array([9], np.int64)}]
    cases = [{"SEED": np.array([3], np.int64), **c} for c in cases]
    solo = [pixels(infer(triton, **c)) for c in cases]
    answers: queue.Queue = queue.Queue()
    for i, c in enumerate(cases):
        def done(result, error, i=i):
            answers.put((i, result, error))
        triton.grpc.async_infer(MODEL, triton.grpc_tensors(**c), done, client_timeout=TIMEOUT_S)
    got = {}
    for _ in cases:
        i, result, error = answers.get(timeout=TIMEOUT_S)
        assert error is None, error
        got[i] = pixels(result)
    for i, want in enumerate(solo):
        assert_pixels_match(got[i], want, f"case {i}")
    assert (solo[0] != solo[1]).mean() > 0.2 and (solo[1] != solo[2]).mean() > 0.2


@pytest.mark.parametrize("model", ["neopp_dense_cfg", "neopp_dense_cfg_seq"])
def test_parallel_modes_apply_the_adapter_on_every_rank(triton: TritonHandle, model):
    """Each rank loads the adapter by name; its rows (a CFG rank's branch, a Ulysses rank's shard)
    take the per-row delta, so the image is the one-device one (as the parallel tests allow: one
    level on under 1% of the values)."""
    lora = {"LORA": text("lora_up_down"), "LORA_SCALE": np.array([0.8], np.float32), "SEED": np.array([6], np.int64)}
    one_device = pixels(infer(triton, **lora))
    assert_pixels_near(pixels(infer(triton, model, **lora)), one_device, model)
    assert (pixels(infer(triton, model, SEED=lora["SEED"])) != one_device).mean() > 0.2


@pytest.mark.parametrize("model, overrides, message", [
    (MODEL, {"LORA": text("no_such_adapter")},
     "LORA: no adapter named 'no_such_adapter' on this model; offered: lora_B_A, "),
    (MODEL, {"LORA": text("../neopp_8steps_lora")}, "LORA: '../neopp_8steps_lora' is not an adapter name"),
    (MODEL, {"LORA_SCALE": np.array([0.5], np.float32)}, "LORA_SCALE: given without LORA"),
    (MODEL, {"LORA": text("lora_peft"), "LORA_SCALE": np.array([50.0], np.float32)}, "LORA_SCALE: must be"),
    ("neopp_dense_cfg", {"LORA": text("no_such_adapter")}, "LORA: no adapter named 'no_such_adapter'"),
])
def test_refusals_name_the_input_and_the_server_stays_ready(triton: TritonHandle, model, overrides, message):
    with pytest.raises(InferenceServerException) as info:
        infer(triton, model, **overrides)
    assert message in info.value.message(), info.value.message()
    assert "INVALID_ARG" in str(info.value.status())
    assert TritonHandle.image(infer(triton, model)).size == (64, 64)


def test_a_malformed_adapter_is_refused_naming_the_key_and_the_model_stays_up(triton: TritonHandle):
    folder = ensure_8steps_lora().parent
    broken = folder / "e2e_broken.safetensors"
    save_file({"language_model.model.layers.0.self_attn.q_proj_mot_gen.lora_up.weight": torch.zeros(3, 2)},
              str(broken))
    try:
        with pytest.raises(InferenceServerException) as info:
            infer(triton, LORA=text("e2e_broken"))
        assert "LORA: adapter 'e2e_broken' refused" in info.value.message()
        assert "'language_model.model.layers.0.self_attn.q_proj_mot_gen.lora_up.weight'" in info.value.message()
    finally:
        broken.unlink()
    assert TritonHandle.image(infer(triton, LORA=text("lora_up_down"))).size == (64, 64)


@pytest.mark.parametrize("model", [MODEL, "neopp_dense_cfg", "neopp_dense_cfg_seq"])
def test_an_adapter_that_misfits_the_tower_is_refused_on_every_rank_and_the_model_serves(triton: TritonHandle, model):
    """Its header is sound, so only the engine, which knows the tower's shapes, can refuse it: on a
    parallel mode every rank reads it, they agree, and rank 0 reports the refusal."""
    weights = tiny_tensors(tiny_config("dense"), 0)
    key = sorted(k for k in weights if k.endswith("q_proj_mot_gen.weight"))[0]
    out_f, in_f = weights[key].shape
    misfit = ensure_8steps_lora().parent / f"e2e_misfit_{model}.safetensors"
    save_file({key[: -len(".weight")] + ".lora_up.weight": torch.zeros(out_f, 2),
               key[: -len(".weight")] + ".lora_down.weight": torch.zeros(2, in_f + 1)}, str(misfit))
    try:
        with pytest.raises(InferenceServerException) as info:
            infer(triton, model, LORA=text(misfit.stem))
    finally:
        misfit.unlink()
    assert info.value.message().startswith(f"LORA: adapter '{misfit.stem}' refused: key ") and \
        f"has {in_f + 1} columns" in info.value.message(), info.value.message()
    assert TritonHandle.image(infer(triton, model, LORA=text("lora_up_down"))).size == (64, 64)


def v1_loras(triton: TritonHandle) -> dict[str, list[str]]:
    import json
    import urllib.request

    with urllib.request.urlopen(f"http://{triton.door_url}/v1/models", timeout=30) as answer:
        return {e["id"]: e["neopp"]["loras"] for e in json.load(answer)["data"]}


def test_each_model_lists_the_adapters_it_takes(triton: TritonHandle):
    """The model judges its folder: neopp_dense takes every file; neopp_dense_8steps has the 8-step
    adapter merged, and MoE's dense-MLP targets are routed experts there."""
    attention_only = ["lora_B_A", "lora_peft", "lora_up_down"]
    listed = v1_loras(triton)
    assert listed[MODEL] == [*attention_only, "neopp_8steps_lora"]
    assert listed["neopp_dense_8steps"] == attention_only
    assert listed["neopp_moe"] == listed["neopp_moe_cfg"] == attention_only


def test_an_adapter_copied_in_while_serving_is_offered_and_withdrawn_once_removed(triton: TritonHandle):
    """One look judges the whole folder: once the fitting copy is listed, the misfit beside it has
    been judged too, and is not."""
    import shutil
    import time

    folder = ensure_8steps_lora().parent
    misfit = folder / "zz_misfit.safetensors"
    key = "language_model.model.layers.0.self_attn.q_proj_mot_gen"
    save_file({key + ".lora_up.weight": torch.zeros(3, 2), key + ".lora_down.weight": torch.zeros(2, 3)}, str(misfit))
    shutil.copyfile(folder / "lora_up_down.safetensors", folder / "zz_copied.safetensors")  # after the misfit
    try:
        deadline = time.monotonic() + 90
        while "zz_copied" not in v1_loras(triton)[MODEL] and time.monotonic() < deadline:
            time.sleep(1)
        assert "zz_copied" in v1_loras(triton)[MODEL] and "zz_misfit" not in v1_loras(triton)[MODEL]
    finally:
        (folder / "zz_copied.safetensors").unlink()
        misfit.unlink()
    deadline = time.monotonic() + 90
    while "zz_copied" in v1_loras(triton)[MODEL] and time.monotonic() < deadline:
        time.sleep(1)
    assert "zz_copied" not in v1_loras(triton)[MODEL]


def test_an_adapter_s_recommended_values_fill_what_the_request_leaves_unset(triton: TritonHandle):
    """A sidecar recommends 2 steps and guidance off: a request without STEPS and CFG_SCALE draws
    what the explicit values draw; one that sets STEPS keeps its own."""
    sidecar = ensure_8steps_lora().parent / "lora_peft.json"
    sidecar.write_text('{"sampling": {"infer_steps": 2, "enable_cfg": false}}')
    try:
        lora = {"LORA": text("lora_peft"), "SEED": np.array([4], np.int64)}
        recommended = pixels(infer(triton, STEPS=None, **lora))
        own_steps = pixels(infer(triton, **lora))  # STEPS=4 from the request, guidance off from the sidecar
    finally:
        sidecar.unlink()
    explicit = pixels(infer(triton, STEPS=np.array([2], np.int64), CFG_SCALE=np.array([1.0], np.float32), **lora))
    four = pixels(infer(triton, CFG_SCALE=np.array([1.0], np.float32), **lora))
    assert_pixels_match(recommended, explicit, "sidecar values against explicit ones")
    assert_pixels_match(own_steps, four, "the request's STEPS kept")


def test_the_streamed_twin_takes_lora_and_ends_on_the_plain_model_s_bytes(triton: TritonHandle):
    from tests.e2e.test_streaming_e2e import stream

    ask = {"LORA": text("lora_B_A"), "LORA_SCALE": np.array([0.7], np.float32), "SEED": np.array([12], np.int64),
           "STEPS": np.array([3], np.int64)}
    answers = stream(triton, "neopp_dense_stream", **ask)
    assert all(error is None for _, error in answers), [e for _, e in answers if e]
    assert answers[-1][0].as_numpy("IMAGE")[0] == infer(triton, **ask).as_numpy("IMAGE")[0]
