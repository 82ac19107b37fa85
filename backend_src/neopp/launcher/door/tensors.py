"""Tensor bytes in Triton's raw layout, from and to the JSON a client writes or reads.

Raw layout: little-endian elements, row-major; a BYTES tensor is each element as a 4-byte
little-endian length and its bytes. JSON carries numbers, booleans and strings only: BF16 has no
JSON form here (as in Triton), and a BYTES element that is not UTF-8 text cannot be a JSON string.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable
from typing import Any

import numpy as np

from .door_error import invalid

NUMPY_TYPES = {"BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32,
               "UINT64": np.uint64, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32,
               "INT64": np.int64, "FP16": np.float16, "FP32": np.float32, "FP64": np.float64}
ELEMENT_BYTES = {**{name: np.dtype(t).itemsize for name, t in NUMPY_TYPES.items()}, "BF16": 2}
DATATYPES = (*ELEMENT_BYTES, "BYTES")
MAX_RANK = 8
MAX_BYTES_ELEMENTS = 65_536  # elements of one BYTES input: each costs a step to check


def check_shape(shape: Any, name: str) -> list[int]:
    """A list of at most MAX_RANK non-negative integers (booleans are not integers)."""
    if (not isinstance(shape, list) or len(shape) > MAX_RANK
            or not all(type(d) is int and d >= 0 for d in shape)):
        raise invalid(f"input '{name}': 'shape' must be a list of at most {MAX_RANK} non-negative integers")
    return shape


def element_count(shape: list[int]) -> int:
    return math.prod(shape)


def check_datatype(datatype: Any, name: str) -> str:
    if datatype not in DATATYPES:
        raise invalid(f"input '{name}': 'datatype' must be one of {', '.join(DATATYPES)}")
    return datatype


def flatten(data: Any, name: str, depth: int = 0) -> list[Any]:
    """Nested JSON lists in row-major order (a flat list passes as it is)."""
    if not isinstance(data, list):
        return [data]
    if depth > MAX_RANK:
        raise invalid(f"input '{name}': 'data' nests deeper than {MAX_RANK} levels")
    if not any(isinstance(item, list) for item in data):
        return data
    out: list[Any] = []
    for item in data:
        out.extend(flatten(item, name, depth + 1))
    return out


def serialize_bytes(items: Iterable[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


def deserialize_bytes(raw: bytes | memoryview, count: int, name: str) -> list[bytes]:
    """The elements of a raw BYTES tensor; its framing must hold exactly ``count`` of them."""
    items, pos = [], 0
    view = memoryview(raw)
    while pos < len(raw):
        if pos + 4 > len(raw):
            raise invalid(f"input '{name}': BYTES data ends inside a length prefix")
        (length,) = struct.unpack_from("<I", raw, pos)
        pos += 4
        if pos + length > len(raw):
            raise invalid(f"input '{name}': a BYTES element runs past the end of its data")
        items.append(bytes(view[pos:pos + length]))
        pos += length
    if len(items) != count:
        raise invalid(f"input '{name}': BYTES data holds {len(items)} elements, the shape says {count}")
    return items


def _json_number(value: Any, datatype: str, name: str) -> Any:
    if datatype == "BOOL":
        if type(value) is not bool:
            raise invalid(f"input '{name}': BOOL data must be true or false")
        return value
    if type(value) is bool or not isinstance(value, int | float):
        raise invalid(f"input '{name}': {datatype} data must be numbers")
    if datatype.startswith(("INT", "UINT")):
        if not isinstance(value, int):
            raise invalid(f"input '{name}': {datatype} data must be integers")
        info = np.iinfo(NUMPY_TYPES[datatype])
        if not info.min <= value <= info.max:
            raise invalid(f"input '{name}': {value} is out of range for {datatype}")
    return value


def raw_from_json(data: Any, datatype: str, shape: list[int], name: str) -> bytes:
    """The raw bytes of a JSON ``data`` field; its element count must match ``shape``."""
    values = flatten(data, name)
    count = element_count(shape)
    if len(values) != count:
        raise invalid(f"input '{name}': 'data' holds {len(values)} elements, the shape {shape} needs {count}")
    if datatype == "BF16":
        raise invalid(f"input '{name}': BF16 has no JSON form; send it with the binary tensor extension "
                      "(parameters.binary_data_size)")
    if datatype == "BYTES":
        if not all(isinstance(v, str) for v in values):
            raise invalid(f"input '{name}': BYTES data must be strings")
        return serialize_bytes(v.encode() for v in values)
    checked = [_json_number(v, datatype, name) for v in values]
    with np.errstate(over="ignore"):
        array = np.array(checked, dtype=NUMPY_TYPES[datatype])
    if datatype.startswith("FP") and not np.isfinite(array).all():  # strict JSON has no NaN: an overflow
        raise invalid(f"input '{name}': a value is out of range for {datatype}")
    return array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()


def check_size(size: int, datatype: str, shape: list[int], name: str) -> None:
    """A binary part's declared size must be what the shape needs (BYTES: at most
    MAX_BYTES_ELEMENTS elements, their framing checked with the bytes)."""
    count = element_count(shape)
    if datatype == "BYTES":
        if count > MAX_BYTES_ELEMENTS:
            raise invalid(f"input '{name}': a BYTES input holds at most {MAX_BYTES_ELEMENTS} elements, "
                          f"the shape {shape} has {count}")
    elif size != count * ELEMENT_BYTES[datatype]:
        raise invalid(f"input '{name}': binary_data_size is {size} bytes, the shape {shape} of "
                      f"{datatype} needs {count * ELEMENT_BYTES[datatype]}")


def check_bytes(raw: bytes | memoryview, shape: list[int], name: str) -> None:
    """Binary BYTES data must frame exactly the shape's elements."""
    deserialize_bytes(raw, element_count(shape), name)


def bf16_to_float(raw: bytes) -> np.ndarray:
    """bfloat16 is the upper half of a float32: widen exactly."""
    halves = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
    return halves.view(np.float32)


def json_from_raw(raw: bytes, datatype: str, count: int) -> list[Any] | None:
    """JSON values of a raw output; None for a BYTES element that is not UTF-8 text."""
    if datatype == "BYTES":
        try:
            return [item.decode() for item in deserialize_bytes(raw, count, "output")]
        except UnicodeDecodeError:
            return None
    if datatype == "BF16":
        return bf16_to_float(raw).tolist()
    return np.frombuffer(raw, dtype=np.dtype(NUMPY_TYPES[datatype]).newbyteorder("<")).tolist()
