"""Triton's ``generate`` / ``generate_stream`` JSON, built and answered by the door.

A request body is one JSON object: a key naming a model input is that input (one value, or a
list nested as the tensor's shape); a ``parameters`` object and any other scalar key become
request parameters, as in Triton. Answers are JSON objects with one key per output: one element
as itself, more as a flat list, and an encoded image (``IMAGE``, ``PREVIEW``) as base64 text, so
the response is valid JSON whatever the image bytes are.
"""

from __future__ import annotations

import base64
from typing import Any

from tritonclient.grpc import service_pb2 as pb

from . import strict_json, tensors
from .door_error import invalid
from .kserve_infer import set_parameter
from .spliced_request import WireRequest

IMAGE_OUTPUTS = ("IMAGE", "PREVIEW")
# Inputs that asked the model for base64 images: through generate they always are, so the
# door drops them and encodes the model's bytes itself.
BASE64_SWITCHES = ("BASE64_OUTPUT",)


def _shape_of(value: Any, rank: int, name: str) -> list[int]:
    """A scalar fills the input's rank with ones; a list gives its nesting (which must be regular)."""
    if not isinstance(value, list):
        return [1] * max(1, rank)
    shape, level = [], value
    while isinstance(level, list):
        shape.append(len(level))
        if len(shape) > tensors.MAX_RANK:
            raise invalid(f"input '{name}': nests deeper than {tensors.MAX_RANK} levels")
        level = level[0] if level else None
    return shape


def parse_generate(body: bytes, model: str, version: str, metadata: pb.ModelMetadataResponse,
                   stream: bool, max_values: int = 65_536) -> WireRequest:
    """The gRPC request a generate body means, against the model's declared inputs (run away
    from the door's event loop)."""
    strict_json.count_values(body, max_values, "generate request body")
    doc = strict_json.loads(body, "generate request body")
    if not isinstance(doc, dict):
        raise invalid("the generate request body must be a JSON object")
    declared = {item.name: item for item in metadata.inputs}
    wire = WireRequest(pb.ModelInferRequest(model_name=model, model_version=version))
    request = wire.message
    for key, value in doc.items():
        if key in BASE64_SWITCHES and key in declared:
            continue
        if key in declared:
            _add_input(wire, declared[key], value)
        elif key == "parameters":
            if not isinstance(value, dict):
                raise invalid("'parameters' must be a JSON object")
            for name, item in value.items():
                set_parameter(request.parameters[name], item, f"parameters.{name[:64]}")
        elif key == "id" and isinstance(value, str):
            request.id = value[:1024]
        else:
            set_parameter(request.parameters[key], value, f"'{key[:64]}'")
    if stream:
        request.parameters["triton_enable_empty_final_response"].bool_param = True
    return wire


def _add_input(wire: WireRequest, spec: Any, value: Any) -> None:
    shape = _shape_of(value, len(spec.shape), spec.name)
    if spec.datatype == "BF16":
        raise invalid(f"input '{spec.name}': BF16 has no JSON form; use the infer route with the binary "
                      "tensor extension, or the model's base64 input where it has one")
    raw = tensors.raw_from_json(value, spec.datatype, shape, spec.name)
    wire.message.inputs.add(name=spec.name, datatype=spec.datatype, shape=shape)
    wire.raws.append(raw)


def generate_response(response: pb.ModelInferResponse) -> dict[str, Any]:
    """One JSON object for one response; images as base64, other text as text."""
    doc: dict[str, Any] = {"model_name": response.model_name, "model_version": response.model_version}
    for out, raw in zip(response.outputs, response.raw_output_contents):
        count = tensors.element_count(list(out.shape))
        if out.datatype == "BYTES":
            items = tensors.deserialize_bytes(raw, count, out.name)
            values: list[Any] = [_text(item, out.name) for item in items]
        else:
            values = tensors.json_from_raw(raw, out.datatype, count)
        doc[out.name] = values[0] if len(values) == 1 else values
    return doc


def _text(item: bytes, name: str) -> str:
    if name in IMAGE_OUTPUTS:
        return base64.b64encode(item).decode()
    try:
        return item.decode()
    except UnicodeDecodeError:
        return base64.b64encode(item).decode()


def is_final(response: pb.ModelInferResponse) -> bool:
    param = response.parameters.get("triton_final_response")
    return param is not None and param.bool_param
