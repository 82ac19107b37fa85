"""A client's protobuf message: its fields counted from its bytes, then parsed once.

Why: a field costs its parser an object, whatever its size on the wire. Two bytes make an empty
``outputs`` entry of a ModelInferRequest, so 100 MiB within the size bound would become about 50
million messages, in the front that parses it and again in Triton. Counting is bounded work: a
message too short to pass the bound is not counted, counting stops at the bound, and a large
field (a tensor's bytes) is skipped in one step. The bound is low because counting runs in the
launcher's interpreter, beside the HTTP door: 8,192 fields cost a few milliseconds. Integers packed
in a repeated field grow up to eightfold once parsed (a byte on the wire, an int64 in memory), so
they have a bound of their own. The service's messages have no groups; a message that holds one is
refused (a parser keeps an unknown group, and would have stopped the count before what follows).
"""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError

from ...contract.inputs import CLASSIFICATION_REFUSED

MAX_FIELDS = 8192  # fields of one request, its sub-messages' included (a request of ours has ~100)
MIN_FIELD_BYTES = 2  # a key and the shortest value
MAX_PACKED = 1 << 20  # integers packed in repeated fields, all of one request's together
MAX_NAME_BYTES = 4096  # an inference's id and model name: Triton echoes both in every answer
MAX_DEPTH = 32  # sub-messages followed this deep (the service's requests are at most 4 deep)
_GROWING = {FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT32,
            FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SINT64,
            FieldDescriptor.TYPE_ENUM}  # varints: one byte on the wire, four or eight parsed
_CONTINUED = bytes(range(0x80, 0x100))  # a varint's bytes but its last


class TooManyFields(ValueError):
    """A message holding more fields (or packed integers) than the bound."""


class NotTheMessage(ValueError):
    """Bytes that cannot be a message of the service (a group, or a kind of field no encoder writes)."""


class _Budget:
    def __init__(self, fields: int, packed: int) -> None:
        self.fields, self.packed = fields, packed


def check_fields(data: bytes, descriptor: Descriptor, limit: int = MAX_FIELDS, packed: int = MAX_PACKED) -> None:
    """Raise TooManyFields when ``data``, read as ``descriptor``'s message, holds more than ``limit``
    fields or ``packed`` packed integers, counted through the sub-messages the descriptor names;
    NotTheMessage for a group. Other malformed bytes end the count early: the parser that follows
    refuses them."""
    if len(data) < MIN_FIELD_BYTES * (limit + 1) and len(data) <= packed:
        return
    try:
        _count(memoryview(data), descriptor, _Budget(limit, packed), 0)
    except TooManyFields:
        raise TooManyFields(f"a {descriptor.name} of at most {limit} fields and {packed} packed integers "
                            "(its sub-messages' included)") from None


def _count(view: memoryview, descriptor: Descriptor | None, budget: _Budget, depth: int) -> None:
    """Take the fields of ``view`` from ``budget``; raises once either part would go below 0."""
    pos, end = 0, len(view)
    while pos < end:
        key, pos = _varint(view, pos)
        budget.fields -= 1
        if budget.fields < 0:
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
                return
            _count_inside(view[pos:pos + length], _field(descriptor, key >> 3), budget, depth)
            pos += length
        else:
            raise NotTheMessage(f"a field of wire type {kind} (a group or no type at all)")


def _count_inside(view: memoryview, field: FieldDescriptor | None, budget: _Budget, depth: int) -> None:
    """A length-delimited field: a sub-message's fields, or a packed field's integers."""
    if field is None:
        return
    if field.type == FieldDescriptor.TYPE_MESSAGE and depth < MAX_DEPTH:
        _count(view, field.message_type, budget, depth + 1)
    elif field.type in _GROWING and field.label == FieldDescriptor.LABEL_REPEATED:
        budget.packed -= len(view.tobytes().translate(None, _CONTINUED))
        if budget.packed < 0:
            raise TooManyFields


def _field(descriptor: Descriptor | None, number: int) -> FieldDescriptor | None:
    return None if descriptor is None else descriptor.fields_by_number.get(number)


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
    except (DecodeError, NotTheMessage):
        raise BadMessage(f"the request is not a {message.DESCRIPTOR.name}") from None
    request.DiscardUnknownFields()
    return request


def inference_problem(request: Any) -> str | None:
    """Why an inference is refused before Triton sees it (None: it is not): an id or model name
    every answer would echo, or an output's classification (Triton 2.51 dies on it)."""
    for field in ("id", "model_name"):
        size = len(getattr(request, field).encode())
        if size > MAX_NAME_BYTES:
            return f"{field}: at most {MAX_NAME_BYTES} bytes, got {size}"
    for output in request.outputs:
        if "classification" in output.parameters:
            return f"output '{output.name[:64]}': {CLASSIFICATION_REFUSED}"
    return None
