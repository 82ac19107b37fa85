"""``/v1/images/edits``' form, read by the door: the multipart body split once under its bounds,
the pictures counted and bounded with the contract's numbers, the text fields checked by the
generations parser, and what reaches the encoder and the generation model."""

from __future__ import annotations

import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb

from neopp.contract.inputs import MAX_EDIT_IMAGE_BYTES, MAX_EDIT_IMAGES
from neopp.launcher.door import openai_edits as oe
from neopp.launcher.door import openai_images as oa
from neopp.launcher.door.bounds import DoorLimits, MiB
from neopp.launcher.door.multipart_form import FormError, boundary_of, parts
from neopp.launcher.door.tensors import deserialize_bytes

BOUNDARY = "neopp-0123456789abcdef"
TYPE = f"multipart/form-data; boundary={BOUNDARY}"
PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 24  # the door never decodes a picture: any bytes stand in for one
JPEG = b"\xff\xd8\xff\xe0" + bytes(range(256)) * 3  # holds CR, LF and '-' bytes, as real files do
TEXT_BOUND = DoorLimits().openai_body


def form(*fields: tuple, end: bytes = b"--\r\n") -> bytes:
    """A body as OpenAI's clients write one: (name, value) for a text field, (name, bytes,
    filename) for a file, filename None for a file sent without one."""
    out = []
    for name, value, *file in fields:
        head = f'Content-Disposition: form-data; name="{name}"'
        if file and file[0] is not None:
            head += f'; filename="{file[0]}"\r\nContent-Type: application/octet-stream'
        out.append(f"--{BOUNDARY}\r\n{head}\r\n\r\n".encode() + (value if isinstance(value, bytes) else value.encode())
                   + b"\r\n")
    return b"".join(out) + f"--{BOUNDARY}".encode() + end


def edit(*fields: tuple, content_type: str = TYPE) -> tuple[oa.ImagesRequest, bool]:
    return oe.parse_edit_form(content_type, form(*fields), TEXT_BOUND)


def refused(body: bytes, content_type: str = TYPE) -> oa.OpenAIError:
    with pytest.raises(oa.OpenAIError) as info:
        oe.parse_edit_form(content_type, body, TEXT_BOUND)
    assert info.value.status == 400 and info.value.body()["error"]["message"] == info.value.message
    return info.value


def inputs(wire) -> dict[str, bytes]:
    message = pb.ModelInferRequest.FromString(wire.serialize())
    return dict(zip((t.name for t in message.inputs), message.raw_input_contents))


def test_one_picture_and_a_prompt_are_an_edit_with_the_generation_defaults() -> None:
    req, stream = edit(("image", PNG, "cat.png"), ("prompt", "make it blue"))
    assert req.images == (PNG,) and req.prompt == "make it blue" and not stream
    assert (req.n, req.model, req.output_format, req.image_guidance_scale) == (1, oa.DEFAULT_MODEL, "png", None)
    sent = inputs(oa.encoder_request(req))
    assert list(sent) == ["PROMPT", "IMAGES"] and deserialize_bytes(sent["IMAGES"], 1, "IMAGES") == [PNG]


def test_several_pictures_keep_their_order_and_the_text_fields_are_typed_as_a_generation_s() -> None:
    req, stream = edit(("image[]", JPEG, "a.jpg"), ("prompt", "put Image-2's hat on Image-1"), ("n", "2"),
                       ("image[]", PNG, None),  # a file without a filename, as OpenAI's SDK may send bytes
                       ("size", "96x64"), ("seed", "5"), ("stream", "true"), ("guidance_scale", "2.5"),
                       ("image_guidance_scale", "1.5"), ("num_inference_steps", "3"), ("negative_prompt", "blur"),
                       ("think", "true"), ("think_max_tokens", "12"), ("lora", "style"), ("lora_scale", "-0.5"),
                       ("cache", "fbcache"), ("cache_threshold", ".25"), ("model", "neopp_moe"),
                       ("response_format", "b64_json"), ("output_format", "webp"), ("quality", "auto"))
    assert req.images == (JPEG, PNG) and stream
    assert (req.n, req.size, req.seed, req.steps, req.guidance_scale, req.image_guidance_scale) == \
        (2, (64, 96), 5, 3, 2.5, 1.5)
    assert (req.negative_prompt, req.think, req.think_max_tokens, req.lora, req.lora_scale) == \
        ("blur", True, 12, "style", -0.5)
    assert (req.cache, req.cache_threshold, req.model, req.output_format) == ("fbcache", 0.25, "neopp_moe", "webp")
    sent = inputs(oa.encoder_request(req))
    assert list(sent) == ["PROMPT", "NEGATIVE_PROMPT", "THINK", "THINK_MAX_TOKENS", "IMAGES"]
    assert deserialize_bytes(sent["IMAGES"], 2, "IMAGES") == [JPEG, PNG]


def _encoded(with_image_branch: bool) -> pb.ModelInferResponse:
    """An encoder answer: the prefixes, the image-only branch when it was given pictures, its reasoning."""
    answer = pb.ModelInferResponse(model_name="neopp_prompt_encoder")
    names = ["COND_KV", "UNCOND_KV", "INDEX_OFFSET_COND", "INDEX_OFFSET_UNCOND", "THINK_TEXT"]
    names += ["IMAGE_KV", "INDEX_OFFSET_IMAGE"] if with_image_branch else []
    for name in names:
        kv = name.endswith("_KV")
        answer.outputs.add(name=name, datatype="BF16" if kv else "BYTES" if name == "THINK_TEXT" else "INT64",
                           shape=[2, 2, 3, 1, 4] if kv else [1])
        answer.raw_output_contents.append(name.encode() * 3)  # tells each prefix apart
    return answer


@pytest.mark.parametrize("with_image_branch", [True, False])
def test_the_generation_model_gets_every_prefix_the_encoder_answered_and_the_sampling_inputs(
        with_image_branch: bool) -> None:
    req, _ = edit(("image", PNG, "x.png"), ("prompt", "p"), ("seed", "9"), ("image_guidance_scale", "1.5"),
                  ("size", "64x64"))
    wire = oa.generation_request(req, _encoded(with_image_branch), 1)
    sent = inputs(wire)
    prefixes = ["COND_KV", "UNCOND_KV", "INDEX_OFFSET_COND", "INDEX_OFFSET_UNCOND"]
    prefixes += ["IMAGE_KV", "INDEX_OFFSET_IMAGE"] if with_image_branch else []
    assert wire.message.model_name == oa.DEFAULT_MODEL and list(sent)[:len(prefixes)] == prefixes
    assert all(sent[name] == name.encode() * 3 for name in prefixes) and "THINK_TEXT" not in sent
    assert np.frombuffer(sent["SEED"], "<i8").tolist() == [10]  # image 1: seed + 1
    assert np.frombuffer(sent["IMAGE_GUIDANCE_SCALE"], "<f4").tolist() == [1.5]
    streamed = oa.streamed_request(req, _encoded(with_image_branch), 2)
    assert streamed.message.model_name == oa.DEFAULT_MODEL + oa.STREAM_SUFFIX
    assert ("IMAGE_KV" in inputs(streamed)) == with_image_branch and "PREVIEW_EVERY" in inputs(streamed)


def test_a_generation_neither_takes_image_guidance_nor_sends_pictures() -> None:
    with pytest.raises(oa.OpenAIError) as info:
        oa.parse_images_request({"prompt": "x", "image_guidance_scale": 2})
    assert info.value.param == "image_guidance_scale"
    req, _ = oa.parse_images_request({"prompt": "x"})
    assert "IMAGES" not in inputs(oa.encoder_request(req))
    assert "IMAGE_GUIDANCE_SCALE" not in inputs(oa.prompt_model_request(req, 0))


def test_the_boundary_may_be_quoted_and_the_body_may_end_without_a_crlf() -> None:
    body = form(("image", PNG, "x.png"), ("prompt", "p"), end=b"--")
    req, _ = oe.parse_edit_form(f'multipart/form-data; charset=utf-8; boundary="{BOUNDARY}"', body, TEXT_BOUND)
    assert req.images == (PNG,)
    assert [p.name for p in parts(body, BOUNDARY.encode())] == ["image", "prompt"]


@pytest.mark.parametrize("content_type, words", [
    ("application/json", "multipart/form-data"),
    ("", "multipart/form-data"),
    ("multipart/form-data", "boundary"),
    ("multipart/form-data; boundary=", "boundary"),
    ("multipart/form-data; boundary=" + "x" * 71, "boundary"),
])
def test_a_body_that_is_not_a_form_with_a_boundary_is_refused_before_it_is_read(content_type: str,
                                                                                words: str) -> None:
    error = refused(b'{"prompt": "x"}', content_type)
    assert words in error.message and error.param is None
    with pytest.raises(oa.OpenAIError):
        oe.boundary(content_type)  # what the route asks before it reads the body


GOOD = (("image", PNG, "x.png"), ("prompt", "p"))


@pytest.mark.parametrize("body, param, words", [
    (form(*GOOD)[:-len(f"--{BOUNDARY}--\r\n")], "prompt", "truncated"),
    (form(*GOOD)[:40], None, "truncated"),
    (form(*GOOD, end=b"--\r\nmore"), None, "after its closing boundary"),
    (b"preamble\r\n" + form(*GOOD), None, "must start with its boundary"),
    (form(*GOOD).replace(b'form-data; name="prompt"', b'attachment; name="prompt"'), None, "form-data"),
    (form(*GOOD).replace(b'; name="prompt"', b""), None, "name its field"),
    (form(*GOOD).replace(b'name="prompt"', b'name="prompt"; name="seed"'), None, "twice"),
    (form(*GOOD).replace(b'name="prompt"', b'name="prompt"\r\nX-Pad: ' + b"a" * 9000), None, "headers are over"),
    (form(*GOOD).replace(b'name="prompt"', b'name="prompt"' + b"\r\nX: y" * 8), None, "header lines"),
    (form(*GOOD).replace(b'name="prompt"', b'name="prompt"\r\n folded'), None, "Name: value"),
    (form(*[("image", PNG, f"{i}.png") for i in range(MAX_EDIT_IMAGES + 1)], ("prompt", "p")), "image",
     f"at most {MAX_EDIT_IMAGES} pictures"),
    (form(("image[]", b"\x89" * (MAX_EDIT_IMAGE_BYTES + 1), "big.png"), ("prompt", "p")), "image",
     f"over the {MAX_EDIT_IMAGE_BYTES}"),
    (form(("image", b"", "x.png"), ("prompt", "p")), "image", "empty"),
    (form(*GOOD, ("mask", PNG, "mask.png")), "mask", "'mask' is not supported"),
    (form(*GOOD, ("colour", "red")), "colour", "Unknown parameter: 'colour'"),
    (form(*GOOD, ("seed", "1"), ("seed", "2")), "seed", "given twice"),
    (form(*GOOD, ("prompt", "again")), "prompt", "given twice"),
    (form(("image", PNG, "x.png")), "prompt", "'prompt' is required"),
    (form(("prompt", "p")), "image", "'image' is required"),
    (form(*GOOD, ("negative_prompt", "x" * TEXT_BOUND)), "negative_prompt", f"more than {TEXT_BOUND} bytes"),
    (form(*GOOD, ("negative_prompt", b"\xff\xfe")), "negative_prompt", "UTF-8"),
    (form(*GOOD, ("n", "two")), "n", "'n' must be an integer"),  # the generations parser's own refusal
    (form(*GOOD, ("stream", "yes")), "stream", "'stream' must be true or false"),
    (form(*GOOD, ("image_guidance_scale", "nan")), "image_guidance_scale", "from 0 to 100"),
    (form(*GOOD, ("image_guidance_scale", "1e999")), "image_guidance_scale", "from 0 to 100"),
    (form(*GOOD, ("response_format", "url")), "response_format", "b64_json"),
])
def test_each_refusal_is_a_400_naming_the_field(body: bytes, param: str | None, words: str) -> None:
    error = refused(body)
    assert error.param == param and words in error.message, (error.param, error.message)


def test_every_part_is_scanned_once_and_a_file_may_hold_any_bytes() -> None:
    """A picture holding the boundary's own text, short of CRLF and two dashes before it, is one part."""
    tricky = JPEG + f"--{BOUNDARY}".encode() + b"\r\n" + JPEG + b"\r\n-" + BOUNDARY.encode()
    req, _ = edit(("image", tricky, "t.jpg"), ("prompt", "p"))
    assert req.images == (tricky,)
    with pytest.raises(FormError):
        boundary_of("multipart/form-data; boundary=a b ")  # a boundary may not end in a space


def test_the_edits_body_cap_fits_the_pictures_and_stays_under_the_inference_cap() -> None:
    cap = DoorLimits().cap("edits")
    assert MAX_EDIT_IMAGES * MAX_EDIT_IMAGE_BYTES + DoorLimits().openai_body < cap.body <= DoorLimits().max_body
    assert DoorLimits(max_body=MiB).cap("edits").body == MiB


def test_a_refusal_from_the_encoder_names_the_image_field() -> None:
    message = "IMAGES: this checkpoint cannot edit pictures: the demo model has no image understanding"
    assert oa.refusal(400, message, {}).param == "image"
    assert oa.refusal(400, "IMAGE_GUIDANCE_SCALE: must be within -100..100, got 200", {}).param == \
        "image_guidance_scale"


def test_the_form_s_lengths_are_read_from_the_body_not_from_a_header() -> None:
    body = form(("image", PNG, "x.png"), ("prompt", "p"))
    head = body.replace(b"Content-Type: application/octet-stream", b"Content-Length: 1")
    req, _ = oe.parse_edit_form(TYPE, head, TEXT_BOUND)
    assert req.images == (PNG,)


@pytest.mark.parametrize("text, interval", [("0.1,0.9", (0.1, 0.9)), ("[-1.0, 2.0]", (-1.0, 2.0))])
def test_an_edit_s_guidance_interval_reads_as_two_numbers(text, interval) -> None:
    req, _ = edit(("image", PNG, "a.png"), ("prompt", "make it blue"), ("cfg_interval", text))
    assert req.cfg_interval == interval


def test_an_edit_s_guidance_interval_that_is_not_two_numbers_is_refused_by_name() -> None:
    with pytest.raises(oa.OpenAIError, match="'cfg_interval' must be two numbers") as info:
        edit(("image", PNG, "a.png"), ("prompt", "make it blue"), ("cfg_interval", "0.1,x"))
    assert info.value.param == "cfg_interval"
