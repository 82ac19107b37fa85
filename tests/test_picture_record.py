"""The record a served picture carries: written into PNG, JPEG and WebP, read back with the
standard-library reader (and Pillow's own readers, independently), refused in words when absent
or damaged; the RECORD_* inputs; the checkpoint's content hash; the command line's redraw."""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from neopp.cli.client import CliError
from neopp.cli.generate import Ask
from neopp.cli.redraw import redraw_ask
from neopp.contract.picture_record import RECORD_KEY, RecordError, parse_record, read_record, record_text
from neopp.errors import InputError
from neopp.image_io import encode_image
from neopp.image_metadata import DIGITAL_SOURCE_TYPE
from neopp.limits import Limits
from neopp.model import checkpoint_digest as digest_module
from neopp.model.checkpoint_digest import checkpoint_digest
from neopp.modes import SamplingParams
from neopp.request import GenerationRequest
from neopp.serving.picture_records import RecordedInputs, RecordSource, recorded_inputs, request_record
from neopp.serving.request_parsing import parse_request

PIXELS = np.random.default_rng(1).integers(0, 256, (64, 96, 3), dtype=np.uint8)
SOURCE = RecordSource("neopp_dense", "neopp_dense", "dense", "ab" * 32, keep_prompts=True)
PROMPT = 'a "red" <circle> & a square\non the left, é'


def generation(**fields) -> GenerationRequest:
    kv = torch.zeros(2, 2, 3, 2, 4, dtype=torch.bfloat16)
    return GenerationRequest(cond_kv=kv, index_offset_cond=3, height=64, width=96,
                             sampling_params=SamplingParams(infer_steps=7, cfg_scale=4.5, cache="taylorseer",
                                                            cache_threshold=0.25), **fields)


def a_record(**changes) -> str:
    doc = json.loads(request_record(SOURCE, generation(lora="style", lora_scale=0.5), 42, None,
                                    RecordedInputs(PROMPT, "blurry", 512)))
    doc.update(changes)
    return record_text(doc)


@pytest.mark.parametrize("fmt", ["png", "jpeg", "webp"])
def test_the_record_round_trips_in_each_format_and_pillow_sees_the_same(fmt):
    data = encode_image(PIXELS, fmt, record=a_record())
    record = read_record(data)
    assert record == json.loads(a_record())
    assert record["model"] == "neopp_dense" and record["seed"] == 42 and record["prompt"] == PROMPT
    assert (record["steps"], record["guidance_scale"], record["cache"], record["cache_threshold"]) == \
        (7, 4.5, "taylorseer", 0.25)
    assert (record["lora"], record["lora_scale"], record["think"], record["think_max_tokens"]) == \
        ("style", 0.5, True, 512)
    info = Image.open(io.BytesIO(data)).info  # an independent reader of the same file
    xmp = info["xmp"].decode() if isinstance(info["xmp"], bytes) else info["xmp"]
    assert DIGITAL_SOURCE_TYPE in xmp
    if fmt == "png":
        assert json.loads(info[RECORD_KEY]) == record
    else:
        assert "neopp:Record=" in xmp


def test_the_record_changes_no_pixel():
    plain, recorded = encode_image(PIXELS, "png"), encode_image(PIXELS, "png", record=a_record())
    assert plain != recorded
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(plain))), np.asarray(Image.open(io.BytesIO(recorded))))


def test_prompts_too_long_for_a_jpeg_segment_are_left_out_and_said_so():
    long = a_record(prompt="x" * 40_000, negative_prompt="y" * 30_000)
    record = read_record(encode_image(PIXELS, "jpeg", record=long))
    assert record["prompt"] is None and record["negative_prompt"] is None and record["prompts_omitted"] is True
    assert read_record(encode_image(PIXELS, "png", record=long))["prompt"] == "x" * 40_000


@pytest.mark.parametrize("fmt, prompt", [("webp", "\U0001f534" * 8192), ("png", '"' * 32768),
                                         ("jpeg", "\U0001f534" * 8192)])
def test_prompts_at_their_bound_never_make_a_record_the_reader_refuses(fmt, prompt):
    record = read_record(encode_image(PIXELS, fmt, record=a_record(prompt=prompt, negative_prompt=prompt)))
    assert record["prompts_omitted"] is True and record["prompt"] is None and record["seed"] == 42


@pytest.mark.parametrize("fmt", ["png", "jpeg", "webp"])
def test_the_stored_record_is_what_the_file_holds(fmt):
    """What a signature covers: the record as the file holds it, prompts dropped or not."""
    from neopp.image_io import PIL_FORMATS
    from neopp.image_metadata import stored_record

    for record in (a_record(), a_record(prompt="x" * 40_000, negative_prompt="y" * 30_000)):
        held = read_record(encode_image(PIXELS, fmt, record=record))
        assert held == json.loads(stored_record(PIL_FORMATS[fmt], record))


def test_without_keep_prompts_the_record_holds_none():
    doc = json.loads(request_record(RecordSource("m", "mode", "c", "00"), generation(), "stream", (32, 48),
                                    RecordedInputs(PROMPT)))
    assert "prompt" not in doc and "negative_prompt" not in doc
    assert doc["seed"] == "stream" and doc["resize"] == [32, 48] and doc["think"] is False and doc["lora"] is None


def _png_chunks(data: bytes, drop: bytes | None = None, text: bytes | None = None) -> bytes:
    """``data`` rewritten chunk by chunk: the record chunk dropped, or its text replaced."""
    out, at = [data[:8]], 8
    while at < len(data):
        length, kind = struct.unpack(">I4s", data[at:at + 8])
        body = data[at + 8:at + 8 + length]
        if kind == b"iTXt" and body.startswith(RECORD_KEY.encode() + b"\0"):
            if drop:
                at += 12 + length
                continue
            if text is not None:
                body = RECORD_KEY.encode() + b"\0\0\0\0\0" + text
        out.append(struct.pack(">I4s", len(body), kind) + body + b"\0\0\0\0")
        at += 12 + length
    return b"".join(out)


@pytest.mark.parametrize("data, words", [
    (b"GIF89a....", "not a PNG, JPEG or WebP"),
    (encode_image(PIXELS, "png"), "holds no NeoPP record"),
    (encode_image(PIXELS, "jpeg"), "holds no NeoPP record"),
    (_png_chunks(encode_image(PIXELS, "png", record=a_record()), text=b"{not json"), "not valid JSON"),
    (_png_chunks(encode_image(PIXELS, "png", record=a_record()), text=b"[1, 2]"), "must be a JSON object"),
    (_png_chunks(encode_image(PIXELS, "png", record=a_record()), text=b'{"record": 1, "seed": NaN}'), "NaN"),
    (_png_chunks(encode_image(PIXELS, "png", record=a_record()), text=b"\xff\xfe"), "not UTF-8"),
    (encode_image(PIXELS, "png", record=a_record())[:60], "cut short"),
])
def test_a_file_without_a_sound_record_is_refused_in_words(data, words):
    with pytest.raises(RecordError, match=words):
        read_record(data)


@pytest.mark.parametrize("change, words", [
    ({"shape": "circle"}, "unknown key 'shape'"),
    ({"steps": "7"}, "'steps' has the wrong type"),
    ({"steps": None}, "'steps' must not be null"),
    ({"record": 2}, "record version 2"),
    ({"seed": "lucky"}, "'seed' must be a number or one of"),
    ({"guidance_interval": [0.0]}, "'guidance_interval' must hold two finite numbers"),
    ({"resize": [10**400, 5]}, "'resize' must hold two finite numbers"),
    ({"guidance_scale": 10**400}, "'guidance_scale' is out of range"),
    ({"think": 1}, "'think' has the wrong type"),
])
def test_a_damaged_record_is_refused_naming_the_key(change, words):
    with pytest.raises(RecordError, match=words):
        parse_record(a_record(**change))


def test_a_number_past_a_float_s_range_is_refused():
    text = a_record().replace('"guidance_interval":[-1.0,2.0]', '"guidance_interval":[1e999,0]')
    assert "1e999" in text
    with pytest.raises(RecordError, match="two finite numbers"):
        parse_record(text)


def test_a_record_nested_past_the_parser_s_depth_is_refused_in_words():
    with pytest.raises(RecordError, match="not valid JSON"):
        parse_record('{"prompt": ' + "[" * 40_000 + "]" * 40_000 + "}")


def test_a_record_lacking_a_required_key_or_too_large_is_refused():
    doc = json.loads(a_record())
    del doc["model"]
    with pytest.raises(RecordError, match="lacks 'model'"):
        parse_record(json.dumps(doc))
    with pytest.raises(RecordError, match="over"):
        parse_record(a_record(prompt="z" * 200_000))


def test_two_records_in_one_xmp_are_refused():
    data = encode_image(PIXELS, "jpeg", record=a_record())
    at = data.index(b"neopp:Record=")
    doubled = data[:at] + data[at:].replace(b"neopp:Record=", b"neopp:Record=\"1\" neopp:Record=", 1)
    with pytest.raises(RecordError, match="more than one NeoPP record"):
        read_record(doubled)


def test_record_inputs_are_parsed_with_their_own_rules():
    recorded = recorded_inputs({"RECORD_PROMPT": np.array([PROMPT.encode()], np.object_),
                                "RECORD_NEGATIVE_PROMPT": np.array([b""], np.object_),
                                "RECORD_THINK": np.array([300], np.int64)})
    assert recorded == RecordedInputs(PROMPT, None, 300)
    with pytest.raises(InputError, match="RECORD_THINK: must be INT64"):
        recorded_inputs({"RECORD_THINK": np.array([1], np.int32)})
    with pytest.raises(InputError, match="RECORD_THINK: 0 \\(no think mode\\) or think mode's cap, 1..4096"):
        recorded_inputs({"RECORD_THINK": np.array([5000], np.int64)})
    with pytest.raises(InputError, match="RECORD_PROMPT: at most"):
        recorded_inputs({"RECORD_PROMPT": np.array([b"x" * 40_000], np.object_)})
    with pytest.raises(InputError, match="RECORD_PROMPT: must be UTF-8"):
        recorded_inputs({"RECORD_PROMPT": np.array([b"\xff"], np.object_)})


def test_a_generation_request_takes_the_record_inputs_and_draws_nothing_from_them():
    inputs = {"COND_KV": torch.zeros(2, 2, 3, 2, 4, dtype=torch.bfloat16), "INDEX_OFFSET_COND": np.array([3]),
              "RECORD_PROMPT": np.array([b"a red circle"], np.object_)}
    parsed = parse_request(inputs, Limits())
    assert parsed.recorded == RecordedInputs("a red circle")
    assert not hasattr(GenerationRequest, "recorded")


def _checkpoint(folder: Path, weights: bytes) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"a": 1}')
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "tokenizer.json").write_text("not hashed")
    return folder


def test_the_checkpoint_hash_is_of_the_files_whole_wherever_they_are(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    one, two = _checkpoint(tmp_path / "one", b"w" * 100), _checkpoint(tmp_path / "two", b"w" * 100)
    expected = hashlib.sha256()
    for name, data in (("config.json", b'{"a": 1}'), ("model.safetensors", b"w" * 100)):
        expected.update(f"{name}\0{hashlib.sha256(data).hexdigest()}\n".encode())
    assert checkpoint_digest(one, cache) == checkpoint_digest(two, cache) == expected.hexdigest()
    (two / "tokenizer.json").write_text("changed")  # not a file that decides the pixels
    assert checkpoint_digest(two, cache) == expected.hexdigest()
    (two / "model.safetensors").write_bytes(b"v" * 100)
    assert checkpoint_digest(two, cache) != expected.hexdigest()


def test_the_checkpoint_hash_is_read_from_the_cache_until_a_file_changes(tmp_path, monkeypatch):
    cache, ckpt = tmp_path / "cache", _checkpoint(tmp_path / "ckpt", b"w" * 100)
    hashed = []
    real = digest_module._sha256
    monkeypatch.setattr(digest_module, "_sha256", lambda file: hashed.append(file.name) or real(file))
    first = checkpoint_digest(ckpt, cache)
    assert sorted(hashed) == ["config.json", "model.safetensors"]
    hashed.clear()
    assert checkpoint_digest(ckpt, cache) == first and hashed == []
    (ckpt / "model.safetensors").write_bytes(b"w" * 101)
    assert checkpoint_digest(ckpt, cache) != first and hashed == ["model.safetensors"]
    (cache / "file-sha256.json").write_text("{damaged")  # a damaged cache is hashed anew, never trusted
    hashed.clear()
    checkpoint_digest(ckpt, cache)
    assert sorted(hashed) == ["config.json", "model.safetensors"]


def _redraw(record: dict, **given) -> Ask:
    ask = Ask(given.pop("prompt", ""), Path("out.png"), **given)
    return redraw_ask(argparse.Namespace(from_file=Path("picture.png")), record, ask)


def test_a_redraw_asks_for_everything_the_record_says():
    ask = _redraw(json.loads(a_record(guidance_norm="channel", timestep_shift=2.5, guidance_interval=[0.1, 0.9])))
    assert (ask.prompt, ask.negative_prompt, ask.seed, ask.model, ask.size, ask.steps) == \
        (PROMPT, "blurry", 42, "neopp_dense", "96x64", 7)
    assert (ask.guidance, ask.lora, ask.cache, ask.think) == (4.5, ("style", 0.5), ("taylorseer", 0.25), 512)
    assert (ask.cfg_norm, ask.shift, ask.cfg_interval) == ("channel", 2.5, (0.1, 0.9))
    body = ask.body(previews=False)
    assert body["cfg_interval"] == [0.1, 0.9] and body["seed"] == 42 and body["cache"] == "taylorseer"


def test_what_the_command_line_gives_replaces_the_record():
    ask = _redraw(json.loads(a_record()), prompt="a blue square", seed=7, steps=3, size="128x128")
    assert (ask.prompt, ask.seed, ask.steps, ask.size, ask.model) == ("a blue square", 7, 3, "128x128", "neopp_dense")


@pytest.mark.parametrize("change, given, words", [
    ({"seed": "stream"}, {}, "continued a noise stream"),
    ({"seed": "noise"}, {}, "noise its client sent"),
    ({"prompt": None}, {}, "holds no prompt"),
    ({"prompt": None, "prompts_omitted": True}, {}, "did not fit in the file's metadata"),
    ({"resize": [32, 32]}, {}, "resized"),
    ({"edit": True}, {}, "was an edit"),
])
def test_a_record_that_cannot_redraw_is_refused_in_words(change, given, words):
    with pytest.raises(CliError, match=words) as info:
        _redraw(json.loads(a_record(**change)), **given)
    assert info.value.code == 2


def test_a_continued_stream_is_drawn_anew_with_a_seed_given():
    assert _redraw(json.loads(a_record(seed="stream")), seed=9).seed == 9


@pytest.mark.parametrize("fmt", ["jpeg", "webp"])
def test_a_prompt_of_any_characters_keeps_the_xmp_well_formed(fmt):
    """XML allows no U+FFFF or U+0001 even escaped: the XMP holds the record in ASCII, which JSON
    reads back as written."""
    import xml.etree.ElementTree as ET

    prompt = "a \uffff \x01 \u00e9 \U0001f534 </x:xmpmeta> &amp; circle"
    data = encode_image(PIXELS, fmt, record=a_record(prompt=prompt))
    assert read_record(data)["prompt"] == prompt
    xmp = Image.open(io.BytesIO(data)).info["xmp"]
    packet = xmp if isinstance(xmp, bytes) else xmp.encode()
    body = packet[packet.index(b"<x:xmpmeta"):packet.index(b"</x:xmpmeta>") + len(b"</x:xmpmeta>")]
    assert body.isascii()
    ET.fromstring(body)  # well-formed
