"""Prompt in, picture out on a SenseNova-U1 checkpoint, through a real tritonserver.

Served by the launcher, as an operator runs it (the door's /v1 beside Triton's gRPC port). The
checkpoint is tiny but real in form (``testing.tiny_u1``: the understanding tower, a
byte-level BPE tokenizer with the special tokens at their real ids, ``template: neo1_0``).
``neopp_prompt_encoder`` must answer the official template's prefixes (ids written out plainly
in ``tests.reference.u1_prompts``), an edit's three branches from its pictures, ``neopp_t2i`` the
picture ``neopp_dense`` draws on them, and a prompt over the token bound or a bad picture is refused
by name while the model keeps serving.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tritonclient.utils import InferenceServerException

from neopp.ports import LOOPBACK
from neopp.text.edit_images import read_pictures
from neopp.text.language_tower import LanguageTower
from neopp.text.think import think
from testing import tiny_u1
from testing.browser import playground
from testing.launched import serving
from testing.model_calls import ModelCalls, text
from testing.pictures import same_pixels
from tests.e2e.test_openai_edits_e2e import multipart
from tests.reference.u1_prompts import cond_pieces, expected_ids, uncond_pieces

MODELS = ("neopp_dense", "neopp_prompt_encoder", "neopp_t2i")
PROMPT, NEGATIVE = "Ünïcödé: a red cat on the mat — 猫!", "blurry, a dog"
PREFIXES = ("COND_KV", "UNCOND_KV", "INDEX_OFFSET_COND", "INDEX_OFFSET_UNCOND")
SMALL = {"SIZE": np.array([64, 96], np.int64), "STEPS": np.array([2], np.int64), "SEED": np.array([7], np.int64),
         "OUTPUT_FORMAT": np.array([b"png"], np.object_)}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_u1.write_tiny_u1_checkpoint(tmp_path_factory.mktemp("u1") / "dense", seed=4)


@pytest.fixture(scope="module")
def served(ckpt, tmp_path_factory):
    """The launcher (its door for /v1, Triton's gRPC port beside it) on the U1 checkpoint."""
    log = tmp_path_factory.mktemp("u1-serve") / "serve.log"
    with serving(log, {"NEOPP_CHECKPOINT": str(ckpt)}, MODELS, no_traceback=True) as handle:
        yield handle


@pytest.fixture(scope="module")
def client(served):
    handle = ModelCalls(f"{LOOPBACK}:{served.grpc_port}")
    yield handle
    handle.close()


def v1(served, body: dict) -> dict:
    conn = http.client.HTTPConnection(LOOPBACK, served.http_port, timeout=300)
    try:
        conn.request("POST", "/v1/images/generations", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        doc = json.loads(resp.read())
        assert resp.status == 200, doc
        return doc
    finally:
        conn.close()


def within_bf16(served: np.ndarray, local: torch.Tensor) -> None:
    """The server's BF16 prefix against this process's float32 one: the stub's CPU threads may sum
    in another order, so within one bf16 rounding (8 bits of mantissa) of the largest value."""
    got = torch.from_numpy(served)
    assert got.shape == local.shape
    assert (got - local).abs().max().item() <= 2 ** -8 * local.abs().max().item()


def test_the_encoder_answers_the_official_prefixes(client, ckpt):
    out = client.infer("neopp_prompt_encoder", PREFIXES, PROMPT=text(PROMPT), NEGATIVE_PROMPT=text(NEGATIVE))
    bare = tiny_u1.bare_bpe()
    cond_ids, uncond_ids = expected_ids(bare, cond_pieces(PROMPT)), expected_ids(bare, uncond_pieces(NEGATIVE))
    assert out["INDEX_OFFSET_COND"].tolist() == [len(cond_ids)]
    assert out["INDEX_OFFSET_UNCOND"].tolist() == [len(uncond_ids)]
    tower = LanguageTower.from_pretrained(ckpt)  # its float32 prefixes against the float64 ones: test_u1_prompt_encoder
    within_bf16(out["COND_KV"], tower.encode_ids(cond_ids)[0])
    within_bf16(out["UNCOND_KV"], tower.encode_ids(uncond_ids)[0])


def test_t2i_draws_what_neopp_dense_draws_on_those_prefixes(client):
    image = client.infer("neopp_t2i", ("IMAGE",), PROMPT=text(PROMPT), NEGATIVE_PROMPT=text(NEGATIVE),
                         **SMALL)["IMAGE"][0]
    assert image[:4] == b"\x89PNG" and Image.open(io.BytesIO(image)).size == (96, 64)
    enc = client.infer("neopp_prompt_encoder", PREFIXES, PROMPT=text(PROMPT), NEGATIVE_PROMPT=text(NEGATIVE))
    direct = client.infer("neopp_dense", ("IMAGE",), COND_KV=(enc["COND_KV"], "BF16"),
                          UNCOND_KV=(enc["UNCOND_KV"], "BF16"), INDEX_OFFSET_COND=enc["INDEX_OFFSET_COND"],
                          INDEX_OFFSET_UNCOND=enc["INDEX_OFFSET_UNCOND"], **SMALL)["IMAGE"][0]
    assert direct == image


def test_think_mode_answers_its_reasoning_and_draws_on_the_prefix_continued_from_it(client, ckpt):
    thinking = {"THINK": np.array([True]), "THINK_MAX_TOKENS": np.array([3], np.int64)}
    out = client.infer("neopp_prompt_encoder", (*PREFIXES, "THINK_TEXT"), PROMPT=text(PROMPT), **thinking)
    thought = think(LanguageTower.from_pretrained(ckpt), PROMPT, 3)  # against the reference: test_u1_think
    assert out["INDEX_OFFSET_COND"].tolist() == [thought.offset]
    within_bf16(out["COND_KV"], thought.kv)
    assert out["THINK_TEXT"].tolist() == [thought.text.encode()]
    answer = client.infer("neopp_t2i", ("IMAGE", "THINK_TEXT"), PROMPT=text(PROMPT), **thinking, **SMALL)
    assert answer["THINK_TEXT"].tolist() == [thought.text.encode()]
    direct = client.infer("neopp_dense", ("IMAGE",), COND_KV=(out["COND_KV"], "BF16"),
                          UNCOND_KV=(out["UNCOND_KV"], "BF16"), INDEX_OFFSET_COND=out["INDEX_OFFSET_COND"],
                          INDEX_OFFSET_UNCOND=out["INDEX_OFFSET_UNCOND"], RECORD_THINK=np.array([3], np.int64),
                          **SMALL)["IMAGE"][0]
    assert answer["IMAGE"][0] == direct  # the record says think mode, as neopp_t2i's does
    plain = client.infer("neopp_t2i", ("IMAGE", "THINK_TEXT"), PROMPT=text(PROMPT), **SMALL)
    assert plain["THINK_TEXT"].tolist() == [b""] and not same_pixels(plain["IMAGE"][0], direct)


def test_v1_thinks_when_asked_and_answers_the_reasoning_beside_the_image(served, client, ckpt):
    body = {"prompt": PROMPT, "size": "96x64", "num_inference_steps": 2, "seed": 7, "guidance_scale": 1}
    thought = think(LanguageTower.from_pretrained(ckpt), PROMPT, 3)
    doc = v1(served, {**body, "think": True, "think_max_tokens": 3})
    assert doc["data"][0]["think"] == thought.text
    same = client.infer("neopp_t2i", ("IMAGE",), PROMPT=text(PROMPT), THINK=np.array([True]),
                        THINK_MAX_TOKENS=np.array([3], np.int64), CFG_SCALE=np.array([1.0], np.float32),
                        **SMALL)["IMAGE"][0]
    assert base64.b64decode(doc["data"][0]["b64_json"]) == same
    assert "think" not in v1(served, body)["data"][0]  # only when asked


def test_the_neopp_command_thinks_and_prints_the_reasoning(served, client, ckpt, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEOPP_")}
    env["NEOPP_URL"] = f"http://{LOOPBACK}:{served.http_port}"
    done = subprocess.run([str(Path(sys.executable).with_name("neopp")), "generate", PROMPT, "--think", "3",
                           "--size", "96x64", "--steps", "2", "--seed", "7", "-q", "-o", str(tmp_path / "u1.png")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    thought = think(LanguageTower.from_pretrained(ckpt), PROMPT, 3)
    assert f"think: {thought.text}\n" in done.stdout and f"wrote {tmp_path / 'u1.png'}" in done.stdout
    same = client.infer("neopp_t2i", ("IMAGE",), PROMPT=text(PROMPT), THINK=np.array([True]),
                        THINK_MAX_TOKENS=np.array([3], np.int64), **SMALL)["IMAGE"][0]
    assert (tmp_path / "u1.png").read_bytes() == same


def test_a_prompt_over_the_token_bound_is_refused_and_the_next_is_served(client):
    with pytest.raises(InferenceServerException) as info:
        client.infer("neopp_t2i", ("IMAGE",), PROMPT=text("a cat"), THINK=np.array([True]),
                     THINK_MAX_TOKENS=np.array([5000], np.int64))
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT" and "THINK_MAX_TOKENS: must be in 1..4096" in \
        info.value.message(), info.value
    for model in ("neopp_prompt_encoder", "neopp_t2i"):
        with pytest.raises(InferenceServerException) as info:
            client.infer(model, ("IMAGE",) if model == "neopp_t2i" else PREFIXES, PROMPT=text("猫" * 4000))
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT", info.value
        assert "PROMPT: its prefix makes" in info.value.message() and "at most 4096" in info.value.message()
    out = client.infer("neopp_prompt_encoder", ("INDEX_OFFSET_COND",), PROMPT=text("a cat"))
    assert out["INDEX_OFFSET_COND"][0] > 0


def test_the_playground_thinks_and_shows_the_reasoning_in_a_browser(served, client, ckpt):
    """The page at /, the think switch on: the picture, and the model's reasoning beside it (no
    streamed twin here, so the page draws without previews); the picture is neopp_t2i's for that seed."""
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    browser = playground(served.http_port, "64x64", "7", "2")  # a range offers its squares
    try:
        browser.find_element("id", "think").click()
        prompt = browser.find_element("id", "prompt")
        prompt.clear()
        prompt.send_keys(PROMPT, Keys.ENTER)
        WebDriverWait(browser, 300).until(lambda b: b.find_element("id", "caption").text == "seed 7")
        reasoning = browser.execute_script("const r = document.getElementById('reasoning'); "
                                           "return [r.hidden, r.textContent];")
        png = base64.b64decode(browser.find_element("id", "download").get_attribute("href").split(",", 1)[1])
    finally:
        browser.quit()
    thought = think(LanguageTower.from_pretrained(ckpt), PROMPT)  # the server's default cap
    assert reasoning == [False, thought.text or "(the model wrote no reasoning)"]
    assert png == client.infer("neopp_t2i", ("IMAGE",), PROMPT=text(PROMPT), THINK=np.array([True]),
                               **{**SMALL, "SIZE": np.array([64, 64], np.int64)})["IMAGE"][0]


EDIT = "make the cat blue, keep Image-2's sky"
EDIT_PREFIXES = (*PREFIXES, "IMAGE_KV", "INDEX_OFFSET_IMAGE")


def pictures() -> np.ndarray:
    """Two pictures: one that needs no resize, one the encoder scales up to its pixel floor."""
    files = []
    for seed, (width, height) in ((1, (512, 512)), (2, (300, 200))):
        buf = io.BytesIO()
        Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)).save(
            buf, "PNG" if seed == 1 else "JPEG")
        files.append(buf.getvalue())
    return np.array(files, dtype=np.object_)


def test_the_encoder_edits_two_pictures_into_its_three_branches(client, ckpt):
    out = client.infer("neopp_prompt_encoder", EDIT_PREFIXES, PROMPT=text(EDIT), IMAGES=pictures())
    tower = LanguageTower.from_pretrained(ckpt)  # its prefixes against the float64 tower: test_u1_edit_encoder
    embedded = tower.embed_pictures(read_pictures(tuple(pictures())))
    assert embedded.grids == [(16, 16), (14, 20)]
    (cond, cond_offset), (image_only, image_offset) = tower.edit_prefixes(EDIT, embedded)
    assert out["INDEX_OFFSET_COND"].tolist() == [cond_offset] and out["INDEX_OFFSET_IMAGE"].tolist() == [image_offset]
    within_bf16(out["COND_KV"], cond)
    within_bf16(out["IMAGE_KV"], image_only)
    within_bf16(out["UNCOND_KV"], tower.unconditional("")[0])


def test_t2i_edits_as_neopp_dense_draws_on_the_encoder_s_three_branches(client):
    guidance = {"CFG_SCALE": np.array([3.0], np.float32), "IMAGE_GUIDANCE_SCALE": np.array([1.5], np.float32)}
    image = client.infer("neopp_t2i", ("IMAGE",), PROMPT=text(EDIT), IMAGES=pictures(), **guidance, **SMALL)["IMAGE"][0]
    enc = client.infer("neopp_prompt_encoder", EDIT_PREFIXES, PROMPT=text(EDIT), IMAGES=pictures())
    direct = client.infer("neopp_dense", ("IMAGE",), COND_KV=(enc["COND_KV"], "BF16"),
                          UNCOND_KV=(enc["UNCOND_KV"], "BF16"), IMAGE_KV=(enc["IMAGE_KV"], "BF16"),
                          INDEX_OFFSET_COND=enc["INDEX_OFFSET_COND"], INDEX_OFFSET_UNCOND=enc["INDEX_OFFSET_UNCOND"],
                          INDEX_OFFSET_IMAGE=enc["INDEX_OFFSET_IMAGE"], **guidance, **SMALL)["IMAGE"][0]
    assert direct == image
    no_pictures = client.infer("neopp_t2i", ("IMAGE",), PROMPT=text(EDIT), CFG_SCALE=guidance["CFG_SCALE"],
                               **SMALL)["IMAGE"][0]
    assert no_pictures != image  # the pictures change the picture


@pytest.mark.parametrize(("files", "message"), [
    (np.array([b"GIF89a not really"], dtype=np.object_), "IMAGES: picture 1 does not decode as PNG, JPEG, WEBP"),
    (np.array([b"x"] * 5, dtype=np.object_), "IMAGES: shape must be [N] with 1 <= N <= 4 pictures, got [5]"),
])
def test_a_bad_picture_is_refused_by_name_and_the_next_edit_is_served(client, files, message):
    for model in ("neopp_prompt_encoder", "neopp_t2i"):
        with pytest.raises(InferenceServerException) as info:
            client.infer(model, ("IMAGE",) if model == "neopp_t2i" else PREFIXES, PROMPT=text(EDIT), IMAGES=files)
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT" and message in info.value.message(), info.value
    out = client.infer("neopp_prompt_encoder", ("INDEX_OFFSET_IMAGE",), PROMPT=text(EDIT), IMAGES=pictures()[:1])
    assert out["INDEX_OFFSET_IMAGE"][0] > 0


def test_v1_edits_two_pictures_as_neopp_t2i_does(served, client):
    files = [("image[]", bytes(p)) for p in pictures()]
    content_type, body = multipart({"prompt": EDIT, "size": "96x64", "num_inference_steps": "2", "seed": "7",
                                    "guidance_scale": "3", "image_guidance_scale": "1.5"}, files)
    conn = http.client.HTTPConnection(LOOPBACK, served.http_port, timeout=300)
    try:
        conn.request("POST", "/v1/images/edits", body=body, headers={"Content-Type": content_type})
        resp = conn.getresponse()
        doc = json.loads(resp.read())
    finally:
        conn.close()
    assert resp.status == 200, doc
    same = client.infer("neopp_t2i", ("IMAGE",), PROMPT=text(EDIT), IMAGES=pictures(),
                        CFG_SCALE=np.array([3.0], np.float32), IMAGE_GUIDANCE_SCALE=np.array([1.5], np.float32),
                        **SMALL)["IMAGE"][0]
    assert base64.b64decode(doc["data"][0]["b64_json"]) == same


def test_the_neopp_command_edits_the_pictures_it_is_given(served, client, tmp_path):
    paths = []
    for i, data in enumerate(pictures()):
        paths.append(tmp_path / f"in{i}.{'png' if i == 0 else 'jpg'}")
        paths[-1].write_bytes(data)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEOPP_")}
    env["NEOPP_URL"] = f"http://{LOOPBACK}:{served.http_port}"
    done = subprocess.run([str(Path(sys.executable).with_name("neopp")), "edit", *map(str, paths), EDIT,
                           "--size", "96x64", "--steps", "2", "--seed", "7", "-q", "-o", str(tmp_path / "out.png")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    same = client.infer("neopp_t2i", ("IMAGE",), PROMPT=text(EDIT), IMAGES=pictures(), **SMALL)["IMAGE"][0]
    assert (tmp_path / "out.png").read_bytes() == same


def test_the_playground_edits_a_picture_in_a_browser(served, client, tmp_path):
    """A person's path on a checkpoint that edits: choose a picture, type the instruction, press
    Enter; the picture drawn is neopp_t2i's edit of it for that seed."""
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    source = tmp_path / "source.png"
    source.write_bytes(bytes(pictures()[0]))
    browser = playground(served.http_port, "64x64", "7", "2")
    try:
        browser.find_element("id", "images").send_keys(str(source))
        prompt = browser.find_element("id", "prompt")
        prompt.clear()
        prompt.send_keys(EDIT, Keys.ENTER)
        WebDriverWait(browser, 300).until(lambda b: b.find_element("id", "caption").text == "seed 7")
        png = base64.b64decode(browser.find_element("id", "download").get_attribute("href").split(",", 1)[1])
    finally:
        browser.quit()
    assert png == client.infer("neopp_t2i", ("IMAGE",), PROMPT=text(EDIT), IMAGES=pictures()[:1],
                               **{**SMALL, "SIZE": np.array([64, 64], np.int64)})["IMAGE"][0]


def test_v1_passes_the_guidance_norm_and_the_time_shift_and_names_them_when_refused(served, client):
    body = {"prompt": PROMPT, "size": "96x64", "num_inference_steps": 2, "seed": 7, "cfg_norm": "none",
            "timestep_shift": 2.0}
    same = client.infer("neopp_t2i", ("IMAGE",), PROMPT=text(PROMPT), CFG_NORM=text("none"),
                        TIMESTEP_SHIFT=np.array([2.0], np.float32), **SMALL)["IMAGE"][0]
    assert base64.b64decode(v1(served, body)["data"][0]["b64_json"]) == same
    assert same != client.infer("neopp_t2i", ("IMAGE",), PROMPT=text(PROMPT), **SMALL)["IMAGE"][0]
    conn = http.client.HTTPConnection(LOOPBACK, served.http_port, timeout=300)
    try:
        conn.request("POST", "/v1/images/generations", json.dumps({**body, "cfg_norm": "l2"}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        doc = json.loads(resp.read())
    finally:
        conn.close()
    assert resp.status == 400 and doc["error"]["param"] == "cfg_norm", doc
