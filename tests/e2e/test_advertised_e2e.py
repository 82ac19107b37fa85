"""What the server advertises and how honestly it answers, through the real launcher (door,
watchdog, tritonserver) serving the demo checkpoint, trained at 128-320 pixels per side: its
models' sizes and step limits in /v1/models and on the metrics port, the refusals of what they cannot
draw, OpenAI's shape on every /v1 path, the status page, the OpenAPI document and the playground's
size and step controls. One launcher for the module; each draw is 2 steps."""

from __future__ import annotations

import base64
import http.client
import io
import json
import shutil
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from PIL import Image
from tritonclient.utils import InferenceServerException

from neopp.launcher.door import model_facts, triton_metrics
from neopp.ports import LOOPBACK
from testing import REPO
from testing.browser import browser as open_browser
from testing.launched import Launched, serving

DEMO = REPO / "demo" / "checkpoints" / "dense"
MODELS = ("neopp_dense", "neopp_dense_8steps", "neopp_dense_stream", "neopp_prompt_encoder", "neopp_t2i",
          "neopp_session")
EIGHT_STEPS = "neopp_8steps_lora"  # the demo's adapter: neopp_dense_8steps merges it at load
KEY = "advertised-operator-key-0123456789"
PROMPT = "a red circle on the left on a blue background"
SIDES = (128, 160, 192, 224, 256, 288, 320)
TRAINED = [f"{w}x{h}" for h in SIDES for w in SIDES]  # every size of the range, non-square ones too


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Launched:
    root = tmp_path_factory.mktemp("advertised")
    (root / "lora").mkdir()
    shutil.copyfile(DEMO.parent / "lora" / f"{EIGHT_STEPS}.safetensors", root / "lora" / f"{EIGHT_STEPS}.safetensors")
    env = {"NEOPP_CHECKPOINT": str(DEMO), "NEOPP_ADMIN_KEY": KEY, "NEOPP_LORA_DIR": str(root / "lora")}
    with serving(root / "serve.log", env, MODELS, no_traceback=True) as handle:
        yield handle


def call(served: Launched, method: str, path: str, body: Any = None,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection(LOOPBACK, served.http_port, timeout=120)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def draw(served: Launched, **fields: Any) -> tuple[int, dict[str, str], dict]:
    status, headers, raw = call(served, "POST", "/v1/images/generations",
                                {"prompt": PROMPT, "num_inference_steps": 2, "seed": 3, **fields})
    return status, headers, json.loads(raw)


def test_v1_models_lists_only_the_models_that_draw_with_what_they_were_trained_at(served: Launched):
    status, _, raw = call(served, "GET", "/v1/models")
    doc = json.loads(raw)
    drawing = [m["id"] for m in doc["data"]]
    assert status == 200 and drawing == ["neopp_dense", "neopp_dense_8steps"], doc  # no session, twin or encoder
    facts = doc["data"][0]["neopp"]
    assert facts["sizes"] == TRAINED and facts["default_size"] == "256x256" and facts["untrained_sizes"] is False
    assert facts["steps"] == {"min": 1, "max": 200} and facts["default_steps"] == 50
    metrics = http.client.HTTPConnection(LOOPBACK, served.metrics_port, timeout=30)  # for any client too
    try:
        metrics.request("GET", "/metrics")
        text = metrics.getresponse().read().decode()
    finally:
        metrics.close()
    published = triton_metrics.capabilities(text)
    from_the_model = {k: v for k, v in facts.items() if k not in ("loras", "loras_total")}  # their own lines
    assert json.loads(published["neopp_dense"]) == from_the_model and "neopp_session" not in published
    assert model_facts.complete_adapter_lists(text)["neopp_dense"] == ([EIGHT_STEPS], 1)
    assert facts["loras"] == [EIGHT_STEPS] and facts["loras_total"] == 1
    assert doc["data"][1]["neopp"]["loras"] == [] and doc["data"][1]["neopp"]["loras_total"] == 0  # merged there


def test_a_size_the_model_was_not_trained_at_is_refused_naming_the_range(served: Launched):
    status, _, doc = draw(served, size="512x512")
    assert status == 400 and doc["error"]["param"] == "size", doc
    assert "not a size this model was trained at" in doc["error"]["message"]
    assert "sides of 128 to 320 pixels" in doc["error"]["message"]
    client = grpcclient.InferenceServerClient(f"{LOOPBACK}:{served.grpc_port}")  # the same rule over gRPC
    try:
        inputs = []
        for name, arr, dtype in (("PROMPT", np.array([PROMPT.encode()], np.object_), "BYTES"),
                                 ("SIZE", np.array([1024, 1024], np.int64), "INT64")):
            inputs.append(grpcclient.InferInput(name, list(arr.shape), dtype))
            inputs[-1].set_data_from_numpy(arr)
        with pytest.raises(InferenceServerException) as info:
            client.infer("neopp_t2i", inputs, client_timeout=60)
        assert "SIZE: [1024, 1024] is not a size this model was trained at" in info.value.message()
        assert client.is_server_ready()
    finally:
        client.close()


def test_steps_over_the_advertised_limit_are_refused_by_name(served: Launched):
    status, _, doc = draw(served, size="128x128", num_inference_steps=201)
    assert status == 400 and doc["error"]["param"] == "num_inference_steps", doc
    assert "from 1 to 200" in doc["error"]["message"]


def test_auto_is_answered_with_the_size_drawn(served: Launched):
    status, _, doc = draw(served, size="auto", output_format="png")
    assert status == 200 and doc["size"] == "256x256", doc
    assert Image.open(io.BytesIO(base64.b64decode(doc["data"][0]["b64_json"]))).size == (256, 256)


def test_previews_say_the_format_they_carry(served: Launched):
    status, _, raw = call(served, "POST", "/v1/images/generations",
                          {"prompt": PROMPT, "size": "128x160", "num_inference_steps": 2, "seed": 1, "stream": True,
                           "partial_images": 1, "output_format": "png"})
    events = [json.loads(line[len(b"data: "):]) for line in raw.splitlines() if line.startswith(b"data: ")]
    assert status == 200 and [e["type"] for e in events] == ["image_generation.partial_image",
                                                             "image_generation.completed"], events
    formats = {e["output_format"]: Image.open(io.BytesIO(base64.b64decode(e["b64_json"]))).format for e in events}
    assert formats == {"jpeg": "JPEG", "png": "PNG"} and {e["size"] for e in events} == {"128x160"}


@pytest.mark.parametrize("method, path, status, code, words", [
    ("POST", "/v1/images/edits", 400, None, "multipart/form-data"),  # a JSON body, as OpenAI answers it
    ("POST", "/v1/images/variations", 400, "unsupported_endpoint", "/v1/images/edits"),
    ("POST", "/v1/chat/completions", 404, "unknown_url", "POST /v1/chat/completions"),
    ("DELETE", "/v1/models", 404, "unknown_url", "DELETE /v1/models"),
])
def test_every_v1_path_answers_in_openai_s_shape(served: Launched, method, path, status, code, words):
    got, _, raw = call(served, method, path, {"prompt": "x"} if method == "POST" else None)
    error = json.loads(raw)["error"]
    assert got == status and error["code"] == code and words in error["message"], error
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"


def test_a_model_not_loaded_is_a_503_naming_it_and_an_unknown_one_a_404(served: Launched):
    status, headers, doc = draw(served, model="neopp_moe", size="128x128")
    assert status == 503 and headers.get("retry-after") == "2" and "'neopp_moe' is not loaded" in \
        doc["error"]["message"], doc
    status, _, doc = draw(served, model="nope", size="128x128")
    assert status == 404 and doc["error"]["code"] == "model_not_found" and doc["error"]["param"] == "model"
    status, _, doc = draw(served, model="neopp_session", size="128x128")
    assert status == 400 and "does not draw images" in doc["error"]["message"]
    status, _, doc = draw(served, quality="high")
    assert status == 400 and doc["error"]["param"] == "quality"


def test_the_status_page_shows_each_model_s_state_and_figures(served: Launched):
    status, _, raw = call(served, "GET", "/status", headers={"Accept": "application/json"})
    doc = json.loads(raw)
    models = {m["model"]: m for m in doc["models"]}
    dense = models["neopp_dense"]
    assert status == 200 and doc["ready"] is True and doc["server_restarts"] == 0, doc
    assert dense["ready"] and dense["successes"] >= 1 and dense["refused"] >= 1  # the refused 512x512 above
    assert dense["errors"] == 0 and dense["cancelled"] >= 0
    assert dense["queued"] == 0 and dense["in_flight"] == 0 and dense["restarts"] == 0
    assert dense["recent_latency_ms"] > 0 and models["neopp_t2i"]["ready"]
    assert models["neopp_moe"]["ready"] is False  # in the repository, not loaded
    status, headers, page = call(served, "GET", "/status")
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert b"<td>neopp_dense</td><td>READY</td>" in page and b'href="/"' in page


def test_the_openapi_document_lists_the_door_s_routes(served: Launched):
    status, _, raw = call(served, "GET", "/openapi.json")
    doc = json.loads(raw)
    assert status == 200 and doc["openapi"].startswith("3.")
    assert {"/v1/images/generations", "/v1/models", "/status", "/", "/v2/models/{model}/infer"} <= set(doc["paths"])
    body = doc["paths"]["/v1/images/generations"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["required"] == ["prompt"] and "num_inference_steps" in body["properties"]


def test_the_playground_offers_the_trained_sizes_the_step_limit_and_each_model_s_adapters(served: Launched):
    from selenium.webdriver.support.ui import Select, WebDriverWait

    browser = open_browser()
    try:
        browser.get(f"http://{LOOPBACK}:{served.http_port}/")
        WebDriverWait(browser, 60).until(lambda b: len(Select(b.find_element("id", "size")).options) > 1)
        sizes = [o.get_attribute("value") for o in Select(browser.find_element("id", "size")).options]
        steps = browser.find_element("id", "steps")
        limits = (steps.get_attribute("min"), steps.get_attribute("max"), steps.get_attribute("placeholder"))
        steps.send_keys("500")
        too_many = browser.execute_script("return document.getElementById('steps').validity.rangeOverflow")
        link = browser.find_element("id", "status-link").get_attribute("href")
        loras = {}
        for model in ("neopp_dense_8steps", "neopp_dense"):  # each choice lists that model's adapters
            Select(browser.find_element("id", "model")).select_by_value(model)
            loras[model] = [o.get_attribute("value") for o in Select(browser.find_element("id", "lora")).options]
    finally:
        browser.quit()
    assert sizes == ["auto", *TRAINED] and limits == ("1", "200", "model default (50, at most 200)")
    assert too_many is True and link.endswith("/status")
    assert loras == {"neopp_dense": ["", EIGHT_STEPS], "neopp_dense_8steps": [""]}
