"""``POST /v1/images/edits`` through the real launcher (door, watchdog, tritonserver) on the demo
checkpoint, whose encoder has no image understanding: a form with a picture reaches the encoder,
whose refusal comes back as OpenAI's 400 naming ``image``, and the server goes on drawing. The
door's own refusals (too many pictures, a JSON body) never reach Triton. The official ``openai``
client's ``images.edit`` is answered the same, and the playground sends chosen pictures there. One
launcher for the module."""

from __future__ import annotations

import base64
import http.client
import io
import json
import uuid

import pytest
from PIL import Image

from neopp.contract.inputs import MAX_EDIT_IMAGES
from neopp.ports import LOOPBACK
from testing import REPO
from testing.browser import playground
from testing.launched import Launched, serving

DEMO = REPO / "demo" / "checkpoints" / "dense"
MODELS = ("neopp_dense", "neopp_prompt_encoder", "neopp_t2i")
PROMPT = "a red circle on the left on a blue background"
CANNOT_EDIT = "IMAGES: this checkpoint cannot edit pictures: the demo model has no image understanding"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Launched:
    log = tmp_path_factory.mktemp("edits") / "serve.log"
    with serving(log, {"NEOPP_CHECKPOINT": str(DEMO)}, MODELS, no_traceback=True) as handle:
        yield handle


def png(colour: str = "red") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (64, 64), colour).save(out, "PNG")
    return out.getvalue()


def multipart(fields: dict[str, str], files: list[tuple[str, bytes]]) -> tuple[str, bytes]:
    """A form as a browser's FormData writes one: the Content-Type and the body."""
    boundary = uuid.uuid4().hex
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
             for name, value in fields.items()]
    parts += [f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="p{i}.png"\r\n'
              f"Content-Type: image/png\r\n\r\n".encode() + data + b"\r\n" for i, (name, data) in enumerate(files)]
    return f"multipart/form-data; boundary={boundary}", b"".join(parts) + f"--{boundary}--\r\n".encode()


def post(served: Launched, path: str, body: bytes, content_type: str) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(LOOPBACK, served.http_port, timeout=120)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": content_type})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def edit(served: Launched, files: list[tuple[str, bytes]], **fields: str) -> tuple[int, dict]:
    content_type, body = multipart({"prompt": "make the circle green", **fields}, files)
    return post(served, "/v1/images/edits", body, content_type)


def ready(served: Launched) -> bool:
    conn = http.client.HTTPConnection(LOOPBACK, served.http_port, timeout=30)
    try:
        conn.request("GET", "/v2/health/ready")
        return conn.getresponse().status == 200
    finally:
        conn.close()


def test_an_edit_reaches_the_encoder_whose_refusal_names_image_and_the_server_draws_on(served: Launched):
    status, doc = edit(served, [("image", png())], size="128x128", num_inference_steps="2", seed="3",
                       image_guidance_scale="1.5", negative_prompt="green")
    error = doc["error"]
    assert status == 400 and error["message"].startswith(CANNOT_EDIT), doc
    assert error["param"] == "image" and error["type"] == "invalid_request_error"
    assert ready(served)
    body = json.dumps({"prompt": PROMPT, "size": "128x128", "num_inference_steps": 2, "seed": 3}).encode()
    status, doc = post(served, "/v1/images/generations", body, "application/json")
    assert status == 200, doc
    assert Image.open(io.BytesIO(base64.b64decode(doc["data"][0]["b64_json"]))).size == (128, 128)


def test_several_pictures_as_image_brackets_reach_the_encoder_too(served: Launched):
    status, doc = edit(served, [("image[]", png()), ("image[]", png("blue"))], n="2", stream="true")
    assert status == 400 and doc["error"]["message"].startswith(CANNOT_EDIT), doc


@pytest.mark.parametrize("files, fields, param, words", [
    ([("image[]", png())] * (MAX_EDIT_IMAGES + 1), {}, "image", f"at most {MAX_EDIT_IMAGES} pictures"),
    ([("image", png()), ("mask", png())], {}, "mask", "'mask' is not supported"),
    ([("image", png())], {"colour": "red"}, "colour", "Unknown parameter: 'colour'"),
    ([("image", png())], {"num_inference_steps": "201"}, "num_inference_steps", "steps.max"),
    ([], {}, "image", "'image' is required"),
])
def test_the_door_s_own_refusals_name_the_field(served: Launched, files, fields, param, words):
    status, doc = edit(served, files, **fields)
    assert status == 400 and doc["error"]["param"] == param and words in doc["error"]["message"], doc


def test_a_json_body_is_refused_saying_the_form_is_required(served: Launched):
    status, doc = post(served, "/v1/images/edits", json.dumps({"prompt": "x", "image": "x"}).encode(),
                       "application/json")
    assert status == 400 and "multipart/form-data" in doc["error"]["message"], doc


def test_the_openai_client_s_edit_reaches_the_route_and_gets_the_encoder_s_refusal(served: Launched, tmp_path):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://{LOOPBACK}:{served.http_port}/v1", api_key="x", max_retries=0)
    picture = tmp_path / "source.png"
    picture.write_bytes(png())

    def refused(image) -> None:
        with pytest.raises(openai.BadRequestError) as info:
            client.images.edit(image=image, prompt="make the circle green", model="neopp_dense", size="128x128",
                               extra_body={"seed": 3, "image_guidance_scale": 1.5})
        assert info.value.status_code == 400 and info.value.param == "image", info.value.body
        assert info.value.body["message"].startswith(CANNOT_EDIT)

    with picture.open("rb") as handle:
        refused(handle)  # a file, sent with its name
    refused([picture.read_bytes(), picture.read_bytes()])  # bytes, as image[] twice


def test_the_playground_edits_the_chosen_pictures_and_draws_again_once_they_are_cleared(served: Launched, tmp_path):
    """A person's path: a picture chosen turns Generate into Edit and sends the form to /v1/images/edits
    (the demo's refusal is shown); "clear" takes it away, and the same page draws the prompt again."""
    from selenium.webdriver.support.ui import WebDriverWait

    picture = tmp_path / "red.png"
    picture.write_bytes(png())
    b = playground(served.http_port, "128x128", "3", "2")
    try:
        b.find_element("id", "images").send_keys(str(picture))
        chosen = (b.find_element("id", "generate").text, b.find_element("id", "clear-images").is_displayed())
        b.find_element("id", "generate").click()
        WebDriverWait(b, 120).until(lambda b: b.find_element("id", "status").get_attribute("class") == "error")
        refusal = b.find_element("id", "status").text
        b.find_element("id", "clear-images").click()
        cleared = (b.find_element("id", "generate").text, b.find_element("id", "clear-images").is_displayed(),
                   b.execute_script("return document.getElementById('images').files.length"))
        b.find_element("id", "generate").click()
        WebDriverWait(b, 180).until(lambda b: b.find_element("id", "caption").text == "seed 3")
    finally:
        b.quit()
    assert chosen == ("Edit", True)
    assert refusal.startswith(CANNOT_EDIT), refusal
    assert cleared == ("Generate", False, 0)
