"""What a model advertises: trained sizes from the checkpoint narrowed by the mode file, the one
step limit, the refusal of untrained sizes, and the door's honest /v1 answers built on them."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path

import pytest

from neopp.errors import ConfigError, InputError
from neopp.image_sizes import TrainedSizes
from neopp.launcher.door import model_facts, triton_metrics
from neopp.launcher.door import openai_images as oa
from neopp.limits import Limits
from neopp.model.checkpoint_config import CheckpointConfig
from neopp.modes import ModeSpec, mode_from_dict
from neopp.serving.capabilities import Capabilities
from neopp.serving.model_settings import TritonModelSettings
from testing import REPO
from testing.tiny_checkpoint import tiny_config

DEMO = REPO / "demo" / "checkpoints"


def test_a_range_allows_both_sides_within_it_in_whole_tokens_and_offers_every_size_it_allows() -> None:
    sizes = TrainedSizes.from_raw({"image_size_range": [128, 320]}, "config.json")
    assert sizes.allows(128, 320) and sizes.allows(256, 256) and sizes.allows(192, 128)
    assert not sizes.allows(512, 512) and not sizes.allows(96, 128) and not sizes.allows(128, 336)
    assert not sizes.allows(144, 144)  # in range, but not whole 32-pixel tokens
    sides = (128, 160, 192, 224, 256, 288, 320)
    assert sizes.listed() == [(h, w) for h in sides for w in sides]  # 49: non-square ones too
    assert all(sizes.allows(*size) for size in sizes.listed())
    assert sizes.describe() == "sides of 128 to 320 pixels, multiples of 32"
    wide = TrainedSizes.from_raw({"image_size_range": [256, 2048]}, "config.json")
    assert wide.listed() == [(s, s) for s in range(256, 2049, 32)]  # 57 sides: 3249 sizes, so its squares


def test_a_mode_file_narrows_the_checkpoint_s_sizes_and_never_widens_them() -> None:
    ckpt = TrainedSizes.from_raw({"image_size_range": [128, 320]}, "config.json")
    wider = TrainedSizes.from_raw({"image_size_range": [64, 1024]}, "mode")
    assert ckpt.narrowed(wider).side_range == (128, 320)
    listed = ckpt.narrowed(TrainedSizes.from_raw({"image_sizes": [[256, 256], [512, 512], [128, 256]]}, "mode"))
    assert listed.listed() == [(256, 256), (128, 256)]  # 512 is outside the checkpoint's range
    assert not listed.allows(160, 160) and listed.allows(128, 256)
    assert TrainedSizes().narrowed(TrainedSizes()).declared is False


@pytest.mark.parametrize("raw, match", [
    ({"image_size_range": [320, 128]}, "image_size_range must be"),
    ({"image_size_range": [128]}, "image_size_range must be"),
    ({"image_sizes": [[100, 128]]}, "image_sizes must be"),
    ({"image_sizes": [[128, 128]] * 65}, "image_sizes must be"),
    ({"image_sizes": "256x256"}, "image_sizes must be"),
])
def test_bad_declarations_fail_at_load_naming_the_key(raw: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        TrainedSizes.from_raw(raw, "config.json")


def test_the_demo_checkpoints_declare_what_they_were_trained_at() -> None:
    from demo import shapes

    for variant in ("dense", "moe"):
        config = CheckpointConfig.from_checkpoint(DEMO / variant)
        assert config.trained_sizes.side_range == (128, 320)
        assert all(config.trained_sizes.allows(h, w) for h, w in shapes.SIZES)  # every size the training drew
        assert config.trained_sizes.allows(*config.default_image_size)
    with pytest.raises(ConfigError, match="default_image_size .* is not among its trained sizes"):
        CheckpointConfig.from_dict(tiny_config("dense", {"image_size_range": [128, 320],
                                                         "default_image_size": [512, 512]}))


def _capabilities(untrained: bool = False, mode_raw: dict | None = None, **limits: int) -> Capabilities:
    config = CheckpointConfig.from_dict(tiny_config("dense", {"image_size_range": [128, 320],
                                                              "default_image_size": [256, 256]}))
    mode = config.fit(mode_from_dict({"infer_steps": 30, **(mode_raw or {})}, "m"))
    return Capabilities.of(config, mode, Limits(**limits), untrained, "neopp_dense")


def test_an_untrained_size_is_refused_naming_the_range_unless_the_operator_allows_it() -> None:
    caps = _capabilities()
    caps.check_size(128, 320)
    with pytest.raises(InputError) as info:
        caps.check_size(512, 512)
    assert str(info.value).startswith("SIZE: [512, 512] is not a size this model was trained at")
    assert "sides of 128 to 320 pixels" in str(info.value) and "allow_untrained_sizes" in str(info.value)
    _capabilities(untrained=True).check_size(512, 512)


def test_the_advertised_object_holds_the_sizes_the_default_and_the_one_step_limit() -> None:
    doc = _capabilities(max_steps=120).advertised()
    assert doc["sizes"][:8] == ["128x128", "160x128", "192x128", "224x128", "256x128", "288x128", "320x128",
                                "128x160"]  # WxH, every height with every width
    assert len(doc["sizes"]) == 49 and "256x256" in doc["sizes"] and "128x320" in doc["sizes"]
    assert doc["default_size"] == "256x256" and doc["default_steps"] == 30
    assert doc["steps"] == {"min": 1, "max": 120} and doc["untrained_sizes"] is False
    assert doc["size_range"] == {"min": 128, "max": 320, "multiple": 32}


def test_the_published_facts_come_back_from_prometheus_text_as_they_were() -> None:
    """The label as the metrics port writes it (backslash, quote and newline escaped) reads back
    to the same object; other series and a model without facts are left out."""
    text = json.dumps(_capabilities().advertised(), separators=(",", ":"))
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    page = "\n".join(["# TYPE neopp_model_capabilities gauge",
                      f'neopp_model_capabilities{{capabilities="{escaped}",model="neopp_dense"}} 1',
                      'nv_inference_request_success{model="neopp_dense",version="1"} 7',
                      'nv_inference_pending_request_count{model="neopp_dense",version="1"} 2'])
    published = triton_metrics.capabilities(page)
    assert list(published) == ["neopp_dense"] and model_facts.parse(published["neopp_dense"]) == json.loads(text)
    wanted = {"nv_inference_request_success": "successes", "nv_inference_pending_request_count": "queued"}
    assert triton_metrics.samples(page, wanted) == {"neopp_dense": {"successes": 7.0, "queued": 2.0}}


def test_a_checkpoint_that_declares_nothing_serves_every_size_and_says_so() -> None:
    config = CheckpointConfig.from_dict(tiny_config("dense", {"image_size_range": None}))
    caps = Capabilities.of(config, ModeSpec(), Limits(), False, "m")
    caps.check_size(64, 1024)
    assert caps.advertised()["untrained_sizes"] is True and caps.advertised()["sizes"] == ["1024x1024"]


@pytest.mark.parametrize("mode_raw, limits, match", [
    ({"image_sizes": [[512, 512]]}, {}, "leave none of the checkpoint's trained sizes"),
    ({"image_sizes": [[128, 128]]}, {}, r"default size \[256, 256\] is not a trained size"),
    ({"infer_steps": 300}, {}, "infer_steps 300 exceeds max_steps 200"),
])
def test_a_mode_that_contradicts_its_checkpoint_or_limits_fails_at_load(mode_raw: dict, limits: dict,
                                                                        match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _capabilities(mode_raw=mode_raw, **limits)


def test_max_steps_is_one_limit_the_sampler_s_bound_included(tmp_path: Path) -> None:
    base = {"name": "m", "parameters": {"max_steps": {"string_value": "1001"}}}
    with pytest.raises(ConfigError, match=r"max_steps: must be in 1..1000"):
        TritonModelSettings.from_config(base, tmp_path / "repo" / "m")
    ok = TritonModelSettings.from_config({"name": "m"}, tmp_path / "repo" / "m")
    assert ok.limits.max_steps == 200 and ok.untrained_sizes is False
    allowed = {"name": "m", "parameters": {"allow_untrained_sizes": {"string_value": "true"}}}
    assert TritonModelSettings.from_config(allowed, tmp_path / "repo" / "m").untrained_sizes


@pytest.mark.parametrize("doc, param", [
    ({"quality": "high"}, "quality"), ({"quality": "hd"}, "quality"), ({"background": "transparent"}, "background"),
    ({"style": "vivid"}, "style"), ({"num_inference_steps": 0}, "num_inference_steps"),
    ({"num_inference_steps": 2.5}, "num_inference_steps"),
])
def test_openai_parameters_this_server_cannot_honour_are_refused_by_name(doc: dict, param: str) -> None:
    with pytest.raises(oa.OpenAIError) as info:
        oa.parse_images_request({"prompt": "x", **doc})
    assert info.value.status == 400 and info.value.param == param and "'" + param + "'" in info.value.message
    assert oa.parse_images_request({"prompt": "x", "quality": "auto", "background": "opaque"})


def test_facts_that_are_not_an_advertised_object_are_no_facts() -> None:
    for text in (None, "", "[]", "{", json.dumps({"sizes": []}), "x" * 70000):
        assert model_facts.parse(text) is None
    facts = {"steps": {"min": 1, "max": 40}, "default_size": "320x128"}
    assert model_facts.parse(json.dumps(facts)) == facts
    assert model_facts.max_steps(facts) == 40 and model_facts.default_size(facts) == (128, 320)


def test_the_docs_page_of_the_routes_is_the_one_the_route_table_writes() -> None:
    from neopp.launcher.door import openapi
    from neopp.launcher.door.routes import build_app
    from neopp.launcher.door.server import DoorServer
    from neopp.ports import LOOPBACK

    server = DoorServer(LOOPBACK, 0, f"{LOOPBACK}:1", (LOOPBACK, 1), "docs", parse_workers=0)
    try:
        doc = openapi.document(build_app(server.door).routes)
    finally:
        server.stop()
    assert (REPO / "docs" / "openapi.md").read_text() == openapi.markdown(doc), \
        "run: python -m neopp.launcher.door.openapi_page > docs/openapi.md"
    assert "/v1/{rest}" not in doc["paths"] and "/status" in doc["paths"]


def test_the_status_of_a_model_takes_its_recent_latency_from_what_finished_since_the_last_look() -> None:
    from neopp.launcher.door.status_page import StatusBoard, render_html

    board = StatusBoard(None, None, None)  # type: ignore[arg-type]  # _model reads no server
    first = board._model("m", "READY", {"successes": 4, "duration_us": 4_000_000, "failed_in_triton": 1}, 0)
    assert first["recent_latency_ms"] == 1000.0 and first["errors"] == 1 and first["ready"]
    again = board._model("m", "READY", {"successes": 6, "duration_us": 4_600_000, "failed_in_triton": 3}, 2)
    assert again["recent_latency_ms"] == 300.0 and again["errors"] == 3 and again["restarts"] == 2
    restarted = board._model("m", "UNAVAILABLE", {"successes": 1, "duration_us": 50_000}, 2)
    assert restarted["recent_latency_ms"] == 50.0 and not restarted["ready"]  # counters began again
    idle = board._model("m", "", {}, 0)
    assert idle["state"] == "UNLOADED" and idle["in_flight"] is None and idle["recent_latency_ms"] is None
    page = render_html({"ready": False, "why": "tritonserver is starting <now>", "server_restarts": 1,
                        "models": [idle]})
    assert "not ready: tritonserver is starting &lt;now&gt;" in page and "<td>UNLOADED</td>" in page


def test_a_generation_model_s_status_keeps_refusals_apart_and_times_only_what_it_served() -> None:
    """A generation model counts its own: refusals and cancellations are not errors, and latency is
    its served requests' whole time (a stream's, whose Triton duration is only its first call)."""
    from neopp.launcher.door.status_page import WANTED, StatusBoard

    page = "\n".join([
        'nv_inference_request_success{model="m",version="1"} 3',
        'nv_inference_request_failure{model="m",version="1"} 9',
        'nv_inference_request_duration_us{model="m",version="1"} 5400',  # 1.8 ms each: a stream's first call
        'neopp_generations_total{model="m"} 3',
        'neopp_generation_seconds_total{model="m"} 4.5',
        'neopp_failures_total{model="m",reason="invalid_input"} 4',
        'neopp_failures_total{model="m",reason="queue_full"} 1',
        'neopp_failures_total{model="m",reason="cancelled"} 2',
        'neopp_failures_total{model="m",reason="internal"} 1',
        'neopp_failures_total{model="m",reason="config"} 0',
    ])
    counts = triton_metrics.samples(page, WANTED)["m"]
    for reason, n in triton_metrics.by_label(page, "neopp_failures_total", "reason")["m"].items():
        counts[f"failed:{reason}"] = n
    row = StatusBoard(None, None, None)._model("m", "READY", counts, 0)  # type: ignore[arg-type]
    assert row["recent_latency_ms"] == 1500.0 and row["successes"] == 3
    assert (row["errors"], row["refused"], row["cancelled"]) == (1, 5 + 1, 2)  # one refused by Triton itself


def _serve_once(answer: bytes, piece: int) -> tuple[tuple[str, int], threading.Thread]:
    """A one-shot HTTP server on loopback that sends ``answer`` in pieces of ``piece`` bytes."""
    listener = socket.create_server(("127.0.0.1", 0))

    def run() -> None:
        with listener:
            conn, _ = listener.accept()
            with conn:
                conn.recv(4096)
                for at in range(0, len(answer), piece):
                    conn.sendall(answer[at:at + piece])
                    time.sleep(0.001)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return listener.getsockname()[:2], thread


def test_a_metrics_answer_in_many_pieces_is_read_to_its_end():
    body = "".join(f'neopp_model_capabilities{{model="m{i}",capabilities="{{}}"}} 1\n' for i in range(2000)).encode()
    head = f"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    address, thread = _serve_once(head + body, 1500)
    text = asyncio.run(triton_metrics.fetch(address))
    thread.join(10)
    assert len(triton_metrics.capabilities(text)) == 2000


def test_a_cut_metrics_answer_is_not_used():
    body = b'neopp_model_capabilities{model="m",capabilities="{}"} 1\n'
    head = f"HTTP/1.0 200 OK\r\nContent-Length: {len(body) + 100}\r\n\r\n".encode()
    address, thread = _serve_once(head + body, 10)
    assert asyncio.run(triton_metrics.fetch(address)) == ""
    thread.join(10)


def test_an_adapter_list_is_taken_only_when_its_names_agree_with_its_count():
    """The names on offer (1) against the count: a list caught mid-update is not taken, a
    withdrawn name (0) is not listed, and past LISTED the count says how many more."""
    from neopp.contract.adapter_names import LISTED

    def page(model: str, offered: dict[str, float], total: int) -> list[str]:
        return [f'neopp_model_adapter{{adapter="{n}",model="{model}"}} {v}' for n, v in offered.items()] + \
            [f'neopp_model_adapters{{model="{model}"}} {total}']

    many = {f"a{i:03d}": 1.0 for i in range(LISTED)}
    text = "\n".join(page("steady", {"b": 1.0, "a": 1.0, "gone": 0.0}, 2) + page("mid", {"a": 1.0}, 2)
                     + page("none", {"gone": 0.0}, 0) + page("many", many, LISTED + 5)
                     + page("bad", {"../x": 1.0}, 1))
    assert model_facts.complete_adapter_lists(text) == {"steady": (["a", "b"], 2), "none": ([], 0),
                                                        "many": (sorted(many), LISTED + 5)}
