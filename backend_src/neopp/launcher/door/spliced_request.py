"""A gRPC inference request whose tensor bytes are spliced in, not copied through protobuf.

Handing a 44 MB KV to protobuf costs a copy into the message and another to serialise it. The
bytes the door checked are instead written once, after the small serialised message, as
``raw_input_contents`` fields (field 7, length-delimited): protobuf reads repeated fields in any
position, so Triton receives the same message.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tritonclient.grpc import service_pb2 as pb

RAW_INPUT_TAG = bytes([7 << 3 | 2])  # field 7, wire type 2 (length-delimited)


def _varint(value: int) -> bytes:
    """Protobuf's base-128 varint: 7 bits a byte, low first, the high bit set on all but the last."""
    groups = [(value >> shift) & 0x7F for shift in range(0, max(value.bit_length(), 1), 7)]
    return bytes([g | 0x80 for g in groups[:-1]] + groups[-1:])


@dataclass
class WireRequest:
    """The message without its raw contents, and the raw contents in input order."""

    message: pb.ModelInferRequest
    raws: list[bytes | memoryview] = field(default_factory=list)

    def serialize(self) -> bytes:
        parts: list[bytes | memoryview] = [self.message.SerializeToString()]
        for raw in self.raws:
            parts += [RAW_INPUT_TAG, _varint(len(raw)), raw]
        return b"".join(parts)

    def __reduce__(self):
        """Across processes as bytes (the generated message classes do not pickle)."""
        return _rebuild, (self.message.SerializeToString(), [bytes(raw) for raw in self.raws])

    def to_message(self) -> pb.ModelInferRequest:
        """The same request as one protobuf message (small requests, streams)."""
        message = pb.ModelInferRequest()
        message.CopyFrom(self.message)
        message.raw_input_contents.extend(bytes(raw) for raw in self.raws)
        return message


def _rebuild(message: bytes, raws: list[bytes]) -> WireRequest:
    return WireRequest(pb.ModelInferRequest.FromString(message), raws)
