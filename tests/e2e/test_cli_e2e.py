"""A person's path through a real server: the ``neopp`` command (as installed, found through
``NEOPP_URL``, its key in ``NEOPP_API_KEY``) draws, lists models and reports status; errors are
the server's message and a non-zero exit (an edit on the demo, which cannot edit, too); the
playground's new controls in a browser. One ``make serve``-like launcher on the demo checkpoints
(the prompt encoder needs its language tower) with an API key serves the whole module; every
picture is compared with the bytes ``neopp_t2i`` draws for the same seed over gRPC."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from PIL import Image

from neopp.launcher.admin import GRPC_API_KEY_HEADER
from neopp.ports import free_ports
from testing import REPO
from testing.browser import browser as open_browser
from testing.launched import Launched, serving

MODELS = ("neopp_dense", "neopp_dense_stream", "neopp_dense_8steps", "neopp_prompt_encoder", "neopp_t2i")
DEMO = REPO / "demo" / "checkpoints"
PROMPT = "a red circle on the left on a blue background"
NEOPP = Path(sys.executable).with_name("neopp")  # the console script `pip install -e .` puts beside python
KEY = "cli-e2e-api-key-0123456789"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Launched:
    log = tmp_path_factory.mktemp("cli") / "serve.log"
    env = {"NEOPP_CHECKPOINT": str(DEMO / "dense"), "NEOPP_LORA_DIR": str(DEMO / "lora"), "NEOPP_API_KEY": KEY}
    with serving(log, env, MODELS, launcher_args=["--admin-key-file", str(log.parent / "admin.key")]) as handle:
        yield handle


def neopp(served: Launched, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The command as a person types it, the server found through NEOPP_URL."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEOPP_")}
    env.update(NEOPP_URL=f"http://127.0.0.1:{served.http_port}", NEOPP_API_KEY=KEY)
    return subprocess.run([str(NEOPP), *args], capture_output=True, text=True, timeout=300, cwd=cwd, env=env)


def t2i(served: Launched, seed: int, model: str = "neopp_dense", size: int = 128, **extra: np.ndarray) -> bytes:
    """What neopp_t2i draws for the prompt at ``size`` squared: the independent reference."""
    inputs = {"PROMPT": np.array([PROMPT.encode()], np.object_), "MODEL": np.array([model.encode()], np.object_),
              "SIZE": np.array([size, size], np.int64), "SEED": np.array([seed], np.int64),
              "OUTPUT_FORMAT": np.array([b"png"], np.object_), **extra}
    tensors = []
    for name, value in inputs.items():
        kind = {np.dtype(np.object_): "BYTES", np.dtype(np.float32): "FP32"}.get(value.dtype, "INT64")
        tensor = grpcclient.InferInput(name, list(value.shape), kind)
        tensor.set_data_from_numpy(value)
        tensors.append(tensor)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{served.grpc_port}")
    try:
        return client.infer("neopp_t2i", tensors, client_timeout=120,
                            headers={GRPC_API_KEY_HEADER: f"Bearer {KEY}"}).as_numpy("IMAGE")[0]
    finally:
        client.close()


def test_generate_streams_progress_and_writes_the_picture_neopp_t2i_draws(served: Launched, tmp_path: Path):
    done = neopp(served, "generate", PROMPT, "-o", "outputs/red.png", "--size", "128x128", "--steps", "2",
                 "--seed", "5", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "step 2/2" in done.stderr  # the streamed twin's per-step progress, as plain lines off a terminal
    assert done.stdout.startswith("wrote outputs/red.png (") and "seed 5)" in done.stdout
    assert done.stdout.splitlines()[-1] == f"drawn by http://127.0.0.1:{served.http_port}"  # which server answered
    assert (tmp_path / "outputs" / "red.png").read_bytes() == t2i(served, 5, STEPS=np.array([2], np.int64))


def test_n_pictures_of_a_model_without_a_streamed_twin_are_numbered_and_seeded_in_turn(served: Launched,
                                                                                       tmp_path: Path):
    done = neopp(served, "generate", PROMPT, "-o", "g.png", "-n", "2", "--size", "128x128", "--seed", "11",
                 "--model", "neopp_dense_8steps", "--negative-prompt", "green", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "picture 2/2" in done.stderr and not (tmp_path / "g.png").exists()
    neg = np.array([b"green"], np.object_)
    for index in (0, 1):
        png = (tmp_path / f"g-{index + 1}.png").read_bytes()
        assert png == t2i(served, 11 + index, "neopp_dense_8steps", NEGATIVE_PROMPT=neg)
        assert Image.open(tmp_path / f"g-{index + 1}.png").size == (128, 128)


def test_a_single_picture_without_a_streamed_twin_falls_back_to_the_finished_picture(served: Launched,
                                                                                    tmp_path: Path):
    done = neopp(served, "generate", PROMPT, "-o", "e.png", "--size", "128x128", "--seed", "3",
                 "--model", "neopp_dense_8steps", "-q", cwd=tmp_path)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert (tmp_path / "e.png").read_bytes() == t2i(served, 3, "neopp_dense_8steps")


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "'num_inference_steps' must be a positive integer"),
    (["--model", "neopp_nothing"], "neopp_nothing"),
    (["--size", "250x256"], "multiple of 32"),
])
def test_a_refusal_exits_1_with_the_server_s_message_and_writes_nothing(served: Launched, tmp_path: Path, args,
                                                                        message: str):
    done = neopp(served, "generate", PROMPT, "-o", "x.png", *args, cwd=tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("error: ") and message in done.stderr, done.stderr
    assert not (tmp_path / "x.png").exists()


def test_edit_on_a_checkpoint_that_cannot_edit_prints_the_encoder_s_refusal_on_one_line(served: Launched,
                                                                                       tmp_path: Path):
    """``neopp edit`` posts its form to /v1/images/edits; the demo's encoder refuses pictures, and the
    command says so in one line and exits 1, writing nothing. A picture it cannot read is a usage error."""
    Image.new("RGB", (64, 64), "red").save(tmp_path / "red.png")
    done = neopp(served, "edit", "red.png", "make the circle green", "-o", "x.png", "--size", "128x128",
                 "--steps", "2", "--image-guidance", "1.5", "--negative", "blue", cwd=tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("error: /v1/images/edits: 400 IMAGES: this checkpoint cannot edit pictures: the "
                                  "demo model has no image understanding") and "(parameter image)" in done.stderr
    assert not (tmp_path / "x.png").exists()
    done = neopp(served, "edit", "red.png", "gone.png", "make the circle green", cwd=tmp_path)
    assert done.returncode == 2 and done.stderr == "error: gone.png: cannot read the picture (No such file or " \
        "directory)\n", done.stderr


def _get(served: Launched, path: str) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{served.http_port}{path}",
                                 headers={"Accept": "application/json", "Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_models_lists_what_v1_models_offers_with_its_sizes_or_says_they_are_not_advertised(served: Launched,
                                                                                          tmp_path: Path):
    data = json.loads(_get(served, "/v1/models")[1])["data"]
    done = neopp(served, "models", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines] == [m["id"] for m in data] and "neopp_dense" in done.stdout
    for entry, line in zip(data, lines):
        if "neopp" in entry:  # a server that advertises them: the range is shown
            assert f"steps {entry['neopp']['steps']['min']}-{entry['neopp']['steps']['max']}" in line
        else:
            assert line.endswith("(sizes and step limits not advertised by this server)")
    as_json = neopp(served, "models", "--json", cwd=tmp_path)
    assert json.loads(as_json.stdout) == data


def test_status_shows_every_model_or_says_the_page_is_missing(served: Launched, tmp_path: Path):
    status, body = _get(served, "/status")
    done = neopp(served, "status", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    if status == 404:  # a server without the status page: readiness and the models that draw
        assert "has no /status page" in done.stdout and "server ready: yes" in done.stdout
        assert "ready to draw: neopp_dense" in done.stdout
    else:
        assert status == 200 and any(line.split()[:1] == ["model"] for line in done.stdout.splitlines())
        for name in ("neopp_dense", "neopp_t2i"):  # a line each, whatever fields the page sends
            assert any(line.split()[:1] == [name] for line in done.stdout.splitlines()), done.stdout


def test_no_server_is_exit_2_and_names_the_url(served: Launched, tmp_path: Path):
    (port,) = free_ports(1)
    done = subprocess.run([str(NEOPP), "--url", f"127.0.0.1:{port}", "generate", PROMPT], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 2 and f"http://127.0.0.1:{port}" in done.stderr and "Traceback" not in done.stderr


def test_without_the_key_the_server_s_refusal_is_shown(served: Launched, tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEOPP_")}
    done = subprocess.run([str(NEOPP), "--url", f"http://127.0.0.1:{served.http_port}", "models"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert done.returncode == 1 and "401" in done.stderr and "API key" in done.stderr, done.stderr


def test_the_playground_s_new_controls_in_a_browser(served: Launched):
    """The page on a server with a key: no models until the key is typed, then the list without a
    reload; a negative prompt; n=2 as a grid of the pictures neopp_t2i draws for seed and seed+1;
    an error that clears the picture and its seed; this browser's history, kept across a reload,
    whose thumbnail brings a picture and its seed back."""
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select, WebDriverWait

    def field(b, name: str, value: str) -> None:
        b.find_element("id", name).clear()
        b.find_element("id", name).send_keys(value)

    def draw(b, prompt: str, done) -> None:
        field(b, "prompt", prompt)
        b.find_element("id", "prompt").send_keys(Keys.ENTER)
        WebDriverWait(b, 180).until(lambda b: not b.find_element("id", "generate").get_attribute("disabled")
                                    and done(b))

    shown = "return document.getElementById('image').getAttribute('src')"
    b = open_browser()
    try:
        b.get(f"http://127.0.0.1:{served.http_port}/")
        WebDriverWait(b, 60).until(lambda b: "API key" in b.find_element("id", "status").text)
        assert len(Select(b.find_element("id", "model")).options) == 0
        b.find_element("id", "key").send_keys(KEY, Keys.TAB)  # the change event, no reload
        WebDriverWait(b, 60).until(lambda b: len(Select(b.find_element("id", "model")).options) > 0)
        Select(b.find_element("id", "size")).select_by_visible_text("128x128")
        for name, value in (("steps", "2"), ("seed", "21"), ("negative", "green")):
            field(b, name, value)
        draw(b, PROMPT, lambda b: b.find_element("id", "caption").text == "seed 21")
        one = b.execute_script(shown)
        draw(b, "a red dragon", lambda b: b.find_element("id", "status").get_attribute("class") == "error")
        error = (b.find_element("id", "status").text, b.execute_script(shown), b.find_element("id", "caption").text,
                 b.find_element("id", "seed").get_attribute("placeholder"))
        field(b, "n", "2")
        draw(b, PROMPT, lambda b: len(b.find_elements("css selector", "#grid img")) == 2)
        grid = [img.get_attribute("src") for img in b.find_elements("css selector", "#grid img")]
        caption = b.find_element("id", "caption").text
        b.refresh()  # the history and the key outlive the page
        WebDriverWait(b, 60).until(lambda b: len(b.find_elements("css selector", "#history img")) == 3)
        b.find_elements("css selector", "#history img")[2].click()  # the oldest: the first picture
        back = (b.execute_script(shown), b.find_element("id", "seed").get_attribute("value"))
    finally:
        b.quit()
    neg = np.array([b"green"], np.object_)
    steps = np.array([2], np.int64)

    def png(src: str) -> bytes:
        return base64.b64decode(src.split(",", 1)[1])

    assert png(one) == t2i(served, 21, size=128, STEPS=steps, NEGATIVE_PROMPT=neg)
    assert "dragon" in error[0] and error[1:] == (None, "", "random"), error
    assert [png(src) for src in grid] == [t2i(served, seed, size=128, STEPS=steps, NEGATIVE_PROMPT=neg)
                                          for seed in (21, 22)]
    assert caption == "seeds 21, 22"
    assert back == (one, "21")


def _checkpoint_hash(folder: Path) -> str:
    """The checkpoint's content hash as the record defines it, computed here from the files."""
    import hashlib

    combined = hashlib.sha256()
    for file in [folder / "config.json", *sorted(folder.glob("*.safetensors"))]:
        combined.update(f"{file.name}\0{hashlib.sha256(file.read_bytes()).hexdigest()}\n".encode())
    return combined.hexdigest()


def test_a_picture_records_how_it_was_drawn_and_generate_from_draws_the_same_bytes(served: Launched,
                                                                                    tmp_path: Path):
    from neopp.contract.picture_record import read_record

    done = neopp(served, "generate", PROMPT, "-o", "first.png", "--size", "160x128", "--steps", "3", "--seed", "11",
                 "--guidance", "5", "--shift", "2.5", "--cfg-norm", "channel", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    first = (tmp_path / "first.png").read_bytes()
    record = read_record(first)
    assert {k: record[k] for k in ("model", "mode", "width", "height", "steps", "seed", "guidance_scale",
                                   "timestep_shift", "guidance_norm", "checkpoint", "think", "edit", "cache")} == {
        "model": "neopp_dense", "mode": "neopp_dense", "width": 160, "height": 128, "steps": 3, "seed": 11,
        "guidance_scale": 5.0, "timestep_shift": 2.5, "guidance_norm": "channel", "checkpoint": "dense",
        "think": False, "edit": False, "cache": "off"}
    assert record["checkpoint_sha256"] == _checkpoint_hash(DEMO / "dense")
    assert record["software"].startswith("neopp ") and "prompt" not in record  # prompts kept only when allowed
    # the same picture through neopp_t2i (the model itself, no streamed twin) has the same record and bytes
    t2i_png = t2i(served, 11, size=0, SIZE=np.array([128, 160], np.int64), STEPS=np.array([3], np.int64),
                  CFG_SCALE=np.array([5.0], np.float32), TIMESTEP_SHIFT=np.array([2.5], np.float32),
                  CFG_NORM=np.array([b"channel"], np.object_))
    assert t2i_png == first

    refused = neopp(served, "generate", "--from", "first.png", "-o", "again.png", cwd=tmp_path)
    assert refused.returncode == 2 and "holds no prompt" in refused.stderr and not (tmp_path / "again.png").exists()
    again = neopp(served, "generate", PROMPT, "--from", "first.png", "-o", "again.png", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "again.png").read_bytes() == first
    other = neopp(served, "generate", PROMPT, "--from", "first.png", "--seed", "12", "-o", "other.png", cwd=tmp_path)
    assert other.returncode == 0 and read_record((tmp_path / "other.png").read_bytes())["seed"] == 12


def test_generate_from_a_file_without_a_record_is_refused_in_words(served: Launched, tmp_path: Path):
    Image.new("RGB", (8, 8)).save(tmp_path / "plain.png")
    (tmp_path / "notes.png").write_text("not a picture")
    for name, words in (("plain.png", "holds no NeoPP record"), ("notes.png", "not a PNG, JPEG or WebP"),
                        ("absent.png", "cannot read the picture")):
        done = neopp(served, "generate", PROMPT, "--from", name, cwd=tmp_path)
        assert done.returncode == 2 and f"--from {name}: " in done.stderr and words in done.stderr, done.stderr
    assert not (tmp_path / "outputs").exists()


def test_the_playground_draws_again_from_a_picture_chosen_or_refuses_it(served: Launched, tmp_path: Path):
    """A picture the CLI drew, chosen in the playground's redraw field: its settings fill the form,
    and Generate draws the very same bytes; a picture without a record is refused in the status."""
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select, WebDriverWait

    done = neopp(served, "generate", PROMPT, "-o", "drawn.png", "--size", "128x128", "--steps", "2", "--seed", "31",
                 "--shift", "2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    Image.new("RGB", (8, 8)).save(tmp_path / "plain.png")
    shown = "return document.getElementById('image').getAttribute('src')"
    b = open_browser()
    try:
        b.get(f"http://127.0.0.1:{served.http_port}/")
        b.find_element("id", "key").send_keys(KEY, Keys.TAB)
        WebDriverWait(b, 60).until(lambda b: len(Select(b.find_element("id", "model")).options) > 0)
        b.find_element("id", "redraw").send_keys(str(tmp_path / "plain.png"))
        WebDriverWait(b, 30).until(lambda b: "holds no NeoPP record" in b.find_element("id", "status").text)
        b.find_element("id", "redraw").send_keys(str(tmp_path / "drawn.png"))
        WebDriverWait(b, 30).until(lambda b: b.find_element("id", "seed").get_attribute("value") == "31")
        form = {name: b.find_element("id", name).get_attribute("value") for name in ("steps", "size", "model")}
        note = b.find_element("id", "redraw-note").text
        b.find_element("id", "prompt").clear()
        b.find_element("id", "prompt").send_keys(PROMPT, Keys.ENTER)
        WebDriverWait(b, 180).until(lambda b: b.find_element("id", "caption").text == "seed 31")
        drawn = b.execute_script(shown)
    finally:
        b.quit()
    assert form == {"steps": "2", "size": "128x128", "model": "neopp_dense"}
    assert "drawn.png" in note and "its prompt" in note
    assert base64.b64decode(drawn.split(",", 1)[1]) == (tmp_path / "drawn.png").read_bytes()
