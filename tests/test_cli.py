"""The ``neopp`` command's own logic: its URL setting, the request it sends, file names, the
progress bar, how it reads events and errors, and its tables. Through a real server:
tests/e2e/test_cli_e2e.py."""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import pytest

from neopp.cli import main as cli
from neopp.cli.client import DEFAULT_URL, CliError, Server, error_message, events
from neopp.cli.generate import Ask, Bar, check_size, output_format, paths
from neopp.cli.info import model_line, status_table
from neopp.contract.inputs import MAX_EDIT_IMAGE_BYTES
from neopp.ports import free_ports


@pytest.mark.parametrize("url, env, want", [
    (None, None, DEFAULT_URL),
    (None, "http://10.0.0.5:9000", "http://10.0.0.5:9000"),
    ("127.0.0.1:9100", "http://10.0.0.5:9000", "http://127.0.0.1:9100"),  # --url wins; no scheme means http
    ("http://h:8000/v1", None, "http://h:8000"),  # an OpenAI base URL works too
    ("https://h", None, "https://h:443"),
])
def test_the_url_comes_from_the_flag_then_neopp_url_then_make_serve_s_default(monkeypatch, url, env, want):
    monkeypatch.delenv("NEOPP_URL", raising=False)
    if env:
        monkeypatch.setenv("NEOPP_URL", env)
    assert Server.from_url(url).url == want


@pytest.mark.parametrize("url", ["ftp://h:1", "http://h:1/v2/models", "http://h:99999", "http://"])
def test_a_bad_url_is_a_usage_error_that_shows_it(url):
    with pytest.raises(CliError) as info:
        Server.from_url(url)
    assert info.value.code == 2 and "URL" in str(info.value)


def test_the_api_key_comes_from_the_environment_only(monkeypatch):
    monkeypatch.setenv("NEOPP_API_KEY", "k-123")
    assert Server.from_url(None).api_key == "k-123"
    monkeypatch.delenv("NEOPP_API_KEY")
    assert Server.from_url(None).api_key is None


def test_the_request_carries_what_was_asked_and_nothing_unset():
    ask = Ask("a red circle", Path("o/x.jpg"), model="neopp_moe", size="128x128", steps=4, seed=5, guidance=2.5,
              negative_prompt="green", n=1)
    assert ask.body(True) == {
        "prompt": "a red circle", "n": 1, "output_format": "jpeg", "model": "neopp_moe", "size": "128x128",
        "num_inference_steps": 4, "seed": 5, "guidance_scale": 2.5, "negative_prompt": "green", "stream": True,
        "partial_images": 1, "progress": True}
    assert Ask("p", Path("x.png"), n=3).body(False) == {"prompt": "p", "n": 3, "output_format": "png",
                                                        "stream": True}


def test_lora_and_cache_take_a_name_and_an_optional_number():
    ns = cli.parser().parse_args(["generate", "p", "--lora", "neopp_8steps_lora:0.5", "--cache", "taylorseer"])
    ask = Ask("p", Path("x.png"), lora=ns.lora, cache=ns.cache)
    assert ask.body(False) == {"prompt": "p", "n": 1, "output_format": "png", "stream": True,
                               "lora": "neopp_8steps_lora", "lora_scale": 0.5, "cache": "taylorseer"}
    ns = cli.parser().parse_args(["generate", "p", "--lora", "x", "--cache", "taylorseer:0.2"])
    assert (ns.lora, ns.cache) == (("x", None), ("taylorseer", 0.2))


def test_think_asks_for_think_mode_with_an_optional_cap():
    for argv, want in ((["--think"], {"think": True}), (["--think", "64"], {"think": True, "think_max_tokens": 64}),
                       ([], {})):
        ns = cli.parser().parse_args(["generate", "p", *argv])
        body = Ask("p", Path("x.png"), think=ns.think).body(False)
        assert body == {"prompt": "p", "n": 1, "output_format": "png", "stream": True, **want}


def test_the_guidance_norm_and_the_shift_are_sent_when_given():
    ns = cli.parser().parse_args(["generate", "p", "--cfg-norm", "channel", "--shift", "2.5"])
    assert Ask("p", Path("x.png"), cfg_norm=ns.cfg_norm, shift=ns.shift).body(False) == {
        "prompt": "p", "n": 1, "output_format": "png", "stream": True, "cfg_norm": "channel", "timestep_shift": 2.5}
    assert (cli.parser().parse_args(["generate", "p"]).cfg_norm, cli.parser().parse_args(["edit", "a.png", "p"]).shift
            ) == (None, None)


@pytest.mark.parametrize("flag, text", [("--lora", ":1"), ("--lora", "x:"), ("--lora", "x:big"), ("--cache", "t:1:2"),
                                        ("--cfg-norm", "l2"), ("--shift", "0"), ("--shift", "-1"), ("--shift", "nan"),
                                        ("--shift", "fast")])
def test_a_bad_lora_or_cache_is_a_one_line_usage_error(capsys, flag, text):
    with pytest.raises(SystemExit) as exited:
        cli.main(["generate", "p", flag, text])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in err and f"argument {flag}:" in err.splitlines()[-1]


def test_a_model_line_names_its_adapters():
    from neopp.cli.info import model_line

    line = model_line({"id": "neopp_dense", "neopp": {"loras": ["a", "b"], "loras_total": 5}})
    assert line == "neopp_dense  loras a,b (of 5)"


def test_file_names_follow_o_and_number_several_pictures():
    assert paths(Path("out.png"), 1) == [Path("out.png")]
    assert paths(Path("d/out.webp"), 3) == [Path("d/out-1.webp"), Path("d/out-2.webp"), Path("d/out-3.webp")]
    assert output_format(Path("a.JPEG")) == "jpeg"
    with pytest.raises(CliError, match="must end in one of"):
        output_format(Path("a.gif"))


@pytest.mark.parametrize("text, ok", [("256x256", True), ("auto", True), ("256", False), ("-1x4", False)])
def test_the_size_is_width_x_height_or_auto(text, ok):
    if ok:
        assert check_size(text) == text
    else:
        with pytest.raises(argparse.ArgumentTypeError, match="WIDTHxHEIGHT"):
            check_size(text)


def test_a_bad_size_is_argparse_s_one_line_usage_error_not_a_traceback(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["generate", "a cat", "--size", "100"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in err
    assert err.splitlines()[-1] == ("neopp generate: error: argument --size: must be WIDTHxHEIGHT (e.g. 256x256) or "
                                    "auto, got '100'")


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_bar_redraws_one_line_on_a_terminal_and_writes_lines_elsewhere():
    tty, log = Tty(), io.StringIO()
    for stream in (tty, log):
        bar = Bar(stream)
        bar.show(1, 4, "step")
        bar.show(4, 4, "step")
        bar.end()
    assert tty.getvalue() == f"\r[{'#' * 7}{'.' * 23}] step 1/4\r[{'#' * 30}] step 4/4\n"
    assert log.getvalue() == f"[{'#' * 7}{'.' * 23}] step 1/4\n[{'#' * 30}] step 4/4\n"
    many = io.StringIO()
    bar = Bar(many)
    for step in range(1, 51):
        bar.show(step, 50, "step")
    assert len(many.getvalue().splitlines()) == 11 and many.getvalue().endswith("step 50/50\n")  # start, each tenth
    Bar(None).show(1, 2, "step")  # quiet: nothing to write to


def test_events_are_read_one_json_document_each_as_the_door_sends_them():
    stream = io.BytesIO(b'event: neopp.progress\ndata: {"type": "neopp.progress", "step": 1}\n\n'
                        b'event: x\r\ndata: {"a":\r\ndata: 2}\r\n\r\n'
                        b'data: {"last": true}')
    assert list(events(stream)) == [{"type": "neopp.progress", "step": 1}, {"a": 2}, {"last": True}]


@pytest.mark.parametrize("doc, raw, want", [
    ({"error": {"message": "'n' must be ...", "type": "invalid_request_error", "param": "n", "code": None}}, b"",
     "'n' must be ... (parameter n)"),
    ({"error": "Triton says no"}, b"", "Triton says no"),
    (None, b"plain text\n", "plain text"),
    (None, b"", "(no message)"),
])
def test_an_error_shows_the_server_s_message_and_the_parameter_it_names(doc, raw, want):
    assert error_message(doc, raw) == want


def test_models_show_the_advertised_sizes_and_limits_or_say_they_are_not_advertised():
    ext = {"sizes": ["128x128", "256x256"], "default_size": "256x256", "steps": {"min": 1, "max": 200},
           "default_steps": 50, "untrained_sizes": False}
    assert model_line({"id": "neopp_dense", "neopp": ext}) == \
        "neopp_dense  sizes 128x128,256x256; default 256x256; steps 1-200; default steps 50"
    assert model_line({"id": "neopp_moe"}) == "neopp_moe  (sizes and step limits not advertised by this server)"
    grid = [f"{w}x{h}" for h in (128, 160, 192) for w in (128, 160, 192)]
    ranged = {"sizes": grid, "size_range": {"min": 128, "max": 192, "multiple": 32}}
    assert model_line({"id": "m", "neopp": ranged}) == "m  sizes WxH, each side 128-192 in steps of 32"
    gappy = {"sizes": grid[:-1], "size_range": {"min": 128, "max": 192, "multiple": 32}}
    assert model_line({"id": "m", "neopp": gappy}).startswith("m  sizes 128x128,160x128,")


def test_the_status_table_has_a_line_per_model_a_column_per_field_sent_and_a_dash_for_what_is_not():
    doc = {"server": "ready", "models": [
        {"latency_ms": {"p50": 812.4, "p99": 2100.0}, "model": "neopp_dense", "errors": 1, "queued": 0,
         "ready": True, "in_flight": 2, "restarts": 0},
        {"model": "neopp_moe", "ready": False, "unloaded_by": "operator"}]}
    lines = status_table(doc).splitlines()
    assert lines[0] == "server: ready"
    assert lines[1].split() == ["model", "ready", "in", "flight", "queued", "latency", "ms", "errors", "restarts",
                                "unloaded", "by"]
    assert lines[2].split() == ["neopp_dense", "yes", "2", "0", "p50=812", "p99=2100", "1", "0", "-"]
    assert lines[3].split() == ["neopp_moe", "no", "-", "-", "-", "-", "-", "operator"]
    assert status_table({"models": {"m": {"ready": True}}}).splitlines() == ["model  ready", "m      yes"]
    assert status_table({"models": []}) == "(the server lists no models)\n"


def test_no_server_at_the_url_exits_2_saying_how_to_point_elsewhere(capsys):
    (port,) = free_ports(1)
    assert cli.main(["--url", f"127.0.0.1:{port}", "models"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: no answer from http://127.0.0.1:{port}") and "NEOPP_URL" in err


def test_the_help_says_where_the_url_comes_from(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    out = capsys.readouterr().out
    assert "NEOPP_URL" in out and "NEOPP_API_KEY" in out and "--negative-prompt" in out


def test_an_edit_is_a_form_the_door_reads_back_as_the_same_request(tmp_path):
    """The command's form, read by the door's own parser: the fields of a generation, typed as they
    were, and the pictures as image[] in the order given (bytes that hold CR, LF and dashes too)."""
    from neopp.launcher.door.bounds import DoorLimits
    from neopp.launcher.door.openai_edits import parse_edit_form

    first, second = tmp_path / "a.png", tmp_path / "b.webp"
    first.write_bytes(b"\x89PNG\r\n--\r\n" + bytes(range(256)))
    second.write_bytes(b"RIFF\r\n\r\nWEBP")
    ns = cli.parser().parse_args(["edit", str(first), str(second), "put Image-2 on Image-1", "-o", "e.jpg",
                                  "--negative", "blur", "--image-guidance", "1.5", "--seed", "4", "--guidance", "2",
                                  "--think", "8", "-n", "2"])
    ask = Ask(ns.prompt, ns.out, seed=ns.seed, guidance=ns.guidance, negative_prompt=ns.negative_prompt, n=ns.n,
              think=ns.think, images=tuple(ns.images), image_guidance=ns.image_guidance)
    assert ask.path == "/v1/images/edits"
    content_type, body = ask.request(False).encode()
    req, stream = parse_edit_form(content_type, body, DoorLimits().openai_body)
    assert req.images == (first.read_bytes(), second.read_bytes()) and stream
    assert (req.prompt, req.negative_prompt, req.seed, req.guidance_scale, req.image_guidance_scale) == \
        ("put Image-2 on Image-1", "blur", 4, 2.0, 1.5)
    assert (req.n, req.think, req.think_max_tokens, req.output_format) == (2, True, 8, "jpeg")
    assert Ask("p", Path("x.png")).request(False) == Ask("p", Path("x.png")).body(False)  # a generation: JSON


@pytest.mark.parametrize("files, words", [
    (["missing.png"], "missing.png: cannot read the picture (No such file or directory)"),
    (["."], ".: cannot read the picture"),
    (["a.png"] * 5, "at most 4 pictures per edit, got 5"),
    (["big.png"], f"big.png: {MAX_EDIT_IMAGE_BYTES + 1} bytes, over the {MAX_EDIT_IMAGE_BYTES} one picture may hold"),
])
def test_a_picture_that_cannot_be_sent_is_a_one_line_usage_error(capsys, tmp_path, monkeypatch, files, words):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.png").write_bytes(b"\x89PNG")
    with (tmp_path / "big.png").open("wb") as big:
        big.truncate(MAX_EDIT_IMAGE_BYTES + 1)  # sparse: nothing written
    (port,) = free_ports(1)  # nothing listens: the command stops before it calls the server
    assert cli.main(["--url", f"127.0.0.1:{port}", "edit", *files, "make it blue"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err and err.count("\n") == 1 and "Traceback" not in err
