"""A client's protobuf message: its fields counted from its bytes, then parsed once.

Why: a field costs its parser an object, whatever its size on the wire. Two bytes make an empty
``outputs`` entry of a ModelInferRequest, so 100 MiB within the size bound would become about 50
million messages, in the front that parses it and again in Triton. Counting is bounded work: a
message too short to pass the bound is not counted, counting stops at the bound, and a large
field (a tensor's bytes) is skipped in one step. The bound is low because counting runs in the
launcher's interpreter, beside the HTTP door: 8,192 fields cost a few milliseconds.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError

MAX_FIELDS = 8192  # fields of one request, its sub-messages' included (a request of ours has ~100)
MIN_FIELD_BYTES = 2  # a key and the shortest value
MAX_DEPTH = 32  # sub-messages followed this deep (the service's requests are at most 4 deep)


class TooManyFields(ValueError):
    """A message holding more fields than the bound."""


def check_fields(data: bytes, descriptor: Descriptor, limit: int = MAX_FIELDS) -> None:
    """Raise TooManyFields when ``data``, read as ``descriptor``'s message, holds more than ``limit``
    fields, counted through the sub-messages the descriptor names. Bytes that are not a well-formed
    message end the count early: the parser that follows judges them."""
    if len(data) < MIN_FIELD_BYTES * (limit + 1):
        return
    try:
        _count(memoryview(data), descriptor, limit, 0)
    except TooManyFields:
        raise TooManyFields(f"a {descriptor.name} of at most {limit} fields (its sub-messages' included)") from None


def _count(view: memoryview, descriptor: Descriptor | None, left: int, depth: int) -> int:
    """``left`` less the fields of ``view``; raises once it would go below 0."""
    pos, end = 0, len(view)
    while pos < end:
        key, pos = _varint(view, pos)
        left -= 1
        if left < 0:
            raise TooManyFields
        kind = key & 7
        if kind == 0:
            _, pos = _varint(view, pos)
        elif kind == 1:
            pos += 8
        elif kind == 5:
            pos += 4
        elif kind == 2:
            length, pos = _varint(view, pos)
            if pos + length > end:
                return left
            inner = _sub_message(descriptor, key >> 3)
            if inner is not None and depth < MAX_DEPTH:
                left = _count(view[pos:pos + length], inner, left, depth + 1)
            pos += length
        else:  # groups and reserved kinds: none of the service's messages has them
            return left
    return left


def _sub_message(descriptor: Descriptor | None, number: int) -> Descriptor | None:
    field = None if descriptor is None else descriptor.fields_by_number.get(number)
    if field is None or field.type != FieldDescriptor.TYPE_MESSAGE:
        return None
    return field.message_type


def _varint(view: memoryview, pos: int) -> tuple[int, int]:
    """The varint at ``pos`` and the position after it; a truncated one reads as ending the message."""
    value, shift, end = 0, 0, len(view)
    while pos < end and shift < 70:
        byte = view[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    return 0, end


class BadMessage(ValueError):
    """A client's message the front does not send on: it does not parse, or holds too much."""


def parse_request(data: bytes, message: type) -> Any:
    """``data`` as a ``message``, its unknown fields dropped; BadMessage names the rule it breaks."""
    try:
        check_fields(data, message.DESCRIPTOR)
        request = message.FromString(data)
    except TooManyFields as exc:
        raise BadMessage(f"the request is over the bound of {exc}") from None
    except DecodeError:
        raise BadMessage(f"the request is not a {message.DESCRIPTOR.name}") from None
    request.DiscardUnknownFields()
    return request
