"""``POST /v1/images/edits``'s form, read into the same checked request as a generation.

OpenAI's clients send an edit as ``multipart/form-data``: the pictures as files (``image``, or
``image[]`` once per picture) and every other field as text. The pictures are counted and their
sizes bounded here with the contract's numbers; their contents are the encoder's to decode and
check. The text fields are typed as the JSON body of a generation types them (the schema in
``openapi`` says which are numbers and booleans) and then checked by the very parser generations
use, so both routes take the same names under the same rules; an edit adds ``image_guidance_scale``.
"""

from __future__ import annotations

import re
from typing import Any

from ...contract.inputs import MAX_EDIT_IMAGE_BYTES, MAX_EDIT_IMAGES
from . import multipart_form as form
from . import openai_images as oa
from .openapi import EDIT_REQUEST

IMAGE_FIELDS = ("image", "image[]")  # one picture, or each of several
UNSUPPORTED_FILES = {"mask": "this model edits the whole picture as the prompt says; describe the region in the "
                             "prompt instead",
                     "markup": "this model takes no markup; describe the edit in the prompt instead"}
MULTIPART_ONLY = ("/v1/images/edits takes multipart/form-data, as OpenAI's API does: the pictures as files "
                  "('image', or 'image[]' once per picture) and the other fields as text")
INTEGER = re.compile(r"^-?[0-9]{1,20}$")
NUMBER = re.compile(r"^-?(?:[0-9]{1,20}(?:\.[0-9]{0,20})?|\.[0-9]{1,20})(?:[eE][-+]?[0-9]{1,3})?$")
# A form field's JSON type, as the published schema has it; the rest are text.
KINDS = {name: spec["type"] for name, spec in EDIT_REQUEST["properties"].items()
         if spec.get("type") in ("integer", "number", "boolean", "array")}


def boundary(content_type: str) -> bytes:
    """The form's boundary; a JSON (or any other) body is refused before it is read."""
    try:
        return form.boundary_of(content_type)
    except form.FormError as exc:
        if form.media_type(content_type) != "multipart/form-data":
            raise oa.OpenAIError(400, f"{MULTIPART_ONLY}; this request's Content-Type is "
                                 f"{form.media_type(content_type)[:64] or 'missing'}") from None
        raise oa.OpenAIError(400, str(exc)) from None


def parse_edit_form(content_type: str, body: bytes | bytearray, text_bytes: int) -> tuple[oa.ImagesRequest, bool]:
    """The checked edit and whether it asked for a stream. ``text_bytes`` bounds the text fields
    together (the bound of a generation's whole JSON body)."""
    mark = boundary(content_type)
    images: list[bytes] = []
    texts: dict[str, str] = {}
    used = 0
    try:
        for part in form.parts(body, mark):
            if part.name in IMAGE_FIELDS:
                images.append(_picture(part, len(images)))
            elif part.name in UNSUPPORTED_FILES:
                raise oa.OpenAIError(400, f"'{part.name}' is not supported: {UNSUPPORTED_FILES[part.name]}",
                                     part.name)
            else:
                used += len(part.data)
                texts[part.name] = _text(part, texts, used, text_bytes)
    except form.FormError as exc:
        raise oa.OpenAIError(400, str(exc), exc.field and _field_of(exc.field)) from None
    if not images:
        raise oa.OpenAIError(400, "'image' is required: the picture to edit, as a file ('image', or 'image[]' once "
                             f"per picture, at most {MAX_EDIT_IMAGES})", "image")
    return oa.parse_images_request(typed(texts), tuple(images))


def _picture(part: form.Part, count: int) -> bytes:
    """One more picture, within the contract's count and size (its format is the encoder's to check)."""
    if count >= MAX_EDIT_IMAGES:
        raise oa.OpenAIError(400, f"'image': at most {MAX_EDIT_IMAGES} pictures per edit", "image")
    if len(part.data) > MAX_EDIT_IMAGE_BYTES:
        raise oa.OpenAIError(400, f"'image': picture {count + 1} holds {len(part.data)} bytes, over the "
                             f"{MAX_EDIT_IMAGE_BYTES} one picture may hold", "image")
    if not part.data:
        raise oa.OpenAIError(400, f"'image': picture {count + 1} is empty", "image")
    return bytes(part.data)


def _text(part: form.Part, seen: dict[str, str], used: int, limit: int) -> str:
    """A text field: known, given once, UTF-8, and within the text fields' bound."""
    name = part.name
    if name not in oa.PARAMETERS and name not in oa.EDIT_PARAMETERS:
        raise oa.OpenAIError(400, f"Unknown parameter: '{name[:64]}'.", name[:64])
    if name in seen:
        raise oa.OpenAIError(400, f"'{name}' is given twice; send each field once", name)
    if used > limit:
        raise oa.OpenAIError(400, f"the text fields hold more than {limit} bytes (the bound of a generation's "
                             "whole body)", name)
    try:
        return bytes(part.data).decode("utf-8")
    except UnicodeDecodeError:
        raise oa.OpenAIError(400, f"'{name}' must be UTF-8 text", name) from None


def _field_of(name: str) -> str:
    return "image" if name in IMAGE_FIELDS else name


def typed(texts: dict[str, str]) -> dict[str, Any]:
    """The form's text as the JSON document a generation would send: numbers and booleans where
    the schema has them. A value that does not read as its type stays text, for the generations
    parser to refuse by name with its own message."""
    doc: dict[str, Any] = {}
    for name, text in texts.items():
        kind = KINDS.get(name)
        if kind == "boolean" and text in ("true", "false"):
            doc[name] = text == "true"
        elif kind in ("integer", "number") and INTEGER.match(text):
            doc[name] = int(text)
        elif kind == "number" and NUMBER.match(text):
            doc[name] = float(text)
        elif kind == "array" and all(NUMBER.match(v.strip()) for v in text.strip().strip("[]").split(",")):
            doc[name] = [float(v) for v in text.strip().strip("[]").split(",")]  # "low,high" or "[low, high]"
        else:
            doc[name] = text
    return doc
