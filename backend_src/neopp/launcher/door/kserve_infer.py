"""The KServe v2 ``infer`` request and response over HTTP, to and from Triton's gRPC messages.

A request is a JSON header, optionally followed by the binary tensor extension's bytes
(``Inference-Header-Content-Length`` says where the header ends). Every field is checked here and
the gRPC ``ModelInferRequest`` is built from the checked values; nothing of the client's text
travels on. Responses come back the same way: JSON data, or binary where the client asked for it
(and always for a BYTES output that is not UTF-8 text, such as an encoded image: JSON cannot carry it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tritonclient.grpc import service_pb2 as pb

from . import strict_json, tensors
from .errors import DoorError, invalid
from .wire import WireRequest

REQUEST_KEYS = {"id", "parameters", "inputs", "outputs"}
INPUT_KEYS = {"name", "shape", "datatype", "parameters", "data"}
OUTPUT_KEYS = {"name", "parameters"}
SHM_PARAMETERS = {"shared_memory_region": str, "shared_memory_byte_size": int, "shared_memory_offset": int}
MAX_TENSORS = 64
MAX_NAME = 128
MAX_TEXT_PARAMETER = 1024
JSON_HINT = ("send tensors with the binary tensor extension (parameters.binary_data_size and the "
             "Inference-Header-Content-Length header; tritonclient.http does it with binary_data=True)")


@dataclass
class OutputPlan:
    """Which outputs go back as binary: named ones as asked, the rest by ``binary_data_output``."""

    binary: dict[str, bool] = field(default_factory=dict)
    default_binary: bool = False

    def wants_binary(self, name: str) -> bool:
        return self.binary.get(name, self.default_binary)


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME:
        raise invalid(f"{what} 'name' must be a string of 1-{MAX_NAME} characters")
    return value


def _keys(obj: Any, allowed: set[str], what: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise invalid(f"{what} must be a JSON object")
    extra = sorted(set(obj) - allowed)
    if extra:
        raise invalid(f"{what}: unknown field '{extra[0][:64]}' (allowed: {', '.join(sorted(allowed))})")
    return obj


def set_parameter(target: pb.InferParameter, value: Any, what: str) -> None:
    """A JSON scalar as a gRPC parameter; objects, lists and long strings are refused."""
    if type(value) is bool:
        target.bool_param = value
    elif type(value) is int:
        if not -(1 << 63) <= value < (1 << 63):
            raise invalid(f"{what}: integer out of range")
        target.int64_param = value
    elif type(value) is float:
        target.double_param = value
    elif isinstance(value, str) and len(value) <= MAX_TEXT_PARAMETER:
        target.string_param = value
    else:
        raise invalid(f"{what}: a parameter must be a boolean, a number or a string of at most "
                      f"{MAX_TEXT_PARAMETER} characters")


def parameter_value(param: pb.InferParameter) -> Any:
    kind = param.WhichOneof("parameter_choice")
    return getattr(param, kind) if kind else None


def _request_parameters(request: pb.ModelInferRequest, params: Any, plan: OutputPlan) -> None:
    if params is None:
        return
    if not isinstance(params, dict):
        raise invalid("'parameters' must be a JSON object")
    for key, value in params.items():
        if key == "binary_data_output":
            if type(value) is not bool:
                raise invalid("parameters.binary_data_output must be true or false")
            plan.default_binary = value
            continue
        if key in ("sequence_start", "sequence_end") and type(value) is not bool:
            raise invalid(f"parameters.{key} must be true or false")
        if key == "sequence_id" and not (isinstance(value, str) or (type(value) is int and value >= 0)):
            raise invalid("parameters.sequence_id must be a non-negative integer or a string")
        if key in ("priority", "timeout") and not (type(value) is int and value >= 0):
            raise invalid(f"parameters.{key} must be a non-negative integer")
        set_parameter(request.parameters[key], value, f"parameters.{key[:64]}")


def _shm_parameters(target: Any, params: dict[str, Any], what: str) -> bool:
    """Copies shared-memory parameters; True when the tensor lives in a registered region."""
    for key, kind in SHM_PARAMETERS.items():
        if key in params:
            if type(params[key]) is not kind or (kind is int and params[key] < 0):
                rule = "a string" if kind is str else "a non-negative integer"
                raise invalid(f"{what}: parameters.{key} must be {rule}")
            set_parameter(target.parameters[key], params[key], what)
    return "shared_memory_region" in params


class _Binary:
    """The bytes after the JSON header, handed out in input order; ``region`` (name, offset):
    where they lie in a shared-memory region Triton has registered, if they do."""

    def __init__(self, data: memoryview, region: tuple[str, int] | None = None) -> None:
        self.data, self.pos, self.region = data, 0, region

    def take(self, size: int, name: str) -> memoryview:
        if self.pos + size > len(self.data):
            raise invalid(f"input '{name}': binary_data_size {size} runs past the end of the body")
        chunk = self.data[self.pos:self.pos + size]  # a view: the bytes are copied once, onto the wire
        self.pos += size
        return chunk

    def check_used(self) -> None:
        if self.pos != len(self.data):
            raise invalid(f"the body has {len(self.data) - self.pos} bytes after the last binary input")


def _input(wire: WireRequest, item: Any, binary: _Binary, names: set[str]) -> None:
    item = _keys(item, INPUT_KEYS, "each input")
    name = _name(item.get("name"), "input")
    if name in names:
        raise invalid(f"input '{name}' appears twice")
    names.add(name)
    shape = tensors.check_shape(item.get("shape"), name)
    datatype = tensors.check_datatype(item.get("datatype"), name)
    params = item.get("parameters") or {}
    params = _keys(params, {"binary_data_size", *SHM_PARAMETERS}, f"input '{name}' parameters")
    tensor = wire.message.inputs.add(name=name, datatype=datatype, shape=shape)
    sources = [key for key in ("data", "binary_data_size", "shared_memory_region") if key in item or key in params]
    if len(sources) != 1:
        raise invalid(f"input '{name}': give exactly one of 'data', parameters.binary_data_size or "
                      f"parameters.shared_memory_region")
    if _shm_parameters(tensor, params, f"input '{name}'"):
        return
    if "data" in item:
        raw = tensors.raw_from_json(item["data"], datatype, shape, name)
    else:
        size = params["binary_data_size"]
        if type(size) is not int or size < 0:
            raise invalid(f"input '{name}': parameters.binary_data_size must be a non-negative integer")
        start = binary.pos
        raw = binary.take(size, name)
        tensors.check_raw_size(raw, datatype, shape, name)
        if binary.region is not None and size:  # Triton reads it where it lies (an empty one: inline)
            region, base = binary.region
            for key, value in (("shared_memory_region", region), ("shared_memory_offset", base + start),
                               ("shared_memory_byte_size", size)):
                set_parameter(tensor.parameters[key], value, name)
            return
    wire.raws.append(raw)


def _outputs(request: pb.ModelInferRequest, outputs: Any, plan: OutputPlan) -> None:
    if outputs is None:
        return
    if not isinstance(outputs, list) or len(outputs) > MAX_TENSORS:
        raise invalid(f"'outputs' must be a list of at most {MAX_TENSORS} objects")
    for item in outputs:
        item = _keys(item, OUTPUT_KEYS, "each output")
        name = _name(item.get("name"), "output")
        params = _keys(item.get("parameters") or {}, {"binary_data", "classification", *SHM_PARAMETERS},
                       f"output '{name}' parameters")
        out = request.outputs.add(name=name)
        if "binary_data" in params:
            if type(params["binary_data"]) is not bool:
                raise invalid(f"output '{name}': parameters.binary_data must be true or false")
            plan.binary[name] = params["binary_data"]
        if "classification" in params:
            if type(params["classification"]) is not int or params["classification"] < 0:
                raise invalid(f"output '{name}': parameters.classification must be a non-negative integer")
            set_parameter(out.parameters["classification"], params["classification"], name)
        _shm_parameters(out, params, f"output '{name}'")


def split_header(body: bytes, header_length: str | None, max_json: int) -> tuple[bytes, memoryview]:
    """The JSON header and the binary part that follows it."""
    if header_length is None:
        header, rest = body, memoryview(b"")
    else:
        if not header_length.isdigit() or not 0 < int(header_length) <= len(body):
            raise invalid(f"Inference-Header-Content-Length must be a byte count within the body's {len(body)}")
        split = int(header_length)
        header, rest = body[:split], memoryview(body)[split:]
    if len(header) > max_json:
        raise DoorError(413, f"the JSON part of the request is {len(header)} bytes, over the {max_json} byte "
                        f"limit for JSON; {JSON_HINT}", reason="json_too_large")
    return header, rest


def parse_infer(body: bytes, header_length: str | None, model: str, version: str,
                max_json: int) -> tuple[WireRequest, OutputPlan]:
    """The gRPC request this HTTP infer request means, and how to send its outputs back."""
    header_bytes, rest = split_header(body, header_length, max_json)
    return parse_infer_parts(header_bytes, rest, model, version)


def parse_infer_parts(header_bytes: bytes, rest: memoryview, model: str, version: str,
                      region: tuple[str, int] | None = None) -> tuple[WireRequest, OutputPlan]:
    """``parse_infer`` with the header and the binary part apart (the latter maybe in a region)."""
    header = _keys(strict_json.loads(header_bytes, "inference request header"), REQUEST_KEYS,
                   "the inference request header")
    wire, plan = WireRequest(pb.ModelInferRequest(model_name=model, model_version=version)), OutputPlan()
    request = wire.message
    if "id" in header:
        if not isinstance(header["id"], str) or len(header["id"]) > MAX_TEXT_PARAMETER:
            raise invalid(f"'id' must be a string of at most {MAX_TEXT_PARAMETER} characters")
        request.id = header["id"]
    inputs = header.get("inputs")
    if not isinstance(inputs, list) or not 0 < len(inputs) <= MAX_TENSORS:
        raise invalid(f"'inputs' must be a list of 1-{MAX_TENSORS} objects")
    binary, names = _Binary(rest, region), set()
    for item in inputs:
        _input(wire, item, binary, names)
    binary.check_used()
    _request_parameters(request, header.get("parameters"), plan)
    _outputs(request, header.get("outputs"), plan)
    return wire, plan


def _parameters_json(params: Any) -> dict[str, Any]:
    return {key: parameter_value(value) for key, value in params.items()}


def infer_response(response: pb.ModelInferResponse, plan: OutputPlan) -> tuple[bytes, dict[str, str]]:
    """The HTTP body and headers of a gRPC response, binary parts after the JSON header."""
    outputs, blobs, raw_index = [], [], 0
    for out in response.outputs:
        entry: dict[str, Any] = {"name": out.name, "datatype": out.datatype, "shape": list(out.shape)}
        params = _parameters_json(out.parameters)
        if "shared_memory_region" not in params:
            raw = response.raw_output_contents[raw_index]
            raw_index += 1
            values = None if plan.wants_binary(out.name) else tensors.json_from_raw(
                raw, out.datatype, tensors.element_count(list(out.shape)))
            if values is None:
                params["binary_data_size"] = len(raw)
                blobs.append(raw)
            else:
                entry["data"] = values
        if params:
            entry["parameters"] = params
        outputs.append(entry)
    header: dict[str, Any] = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id:
        header["id"] = response.id
    if response.parameters:
        header["parameters"] = _parameters_json(response.parameters)
    header["outputs"] = outputs
    text = strict_json.dumps(header)
    if not blobs:
        return text, {"Content-Type": "application/json"}
    return b"".join([text, *blobs]), {"Content-Type": "application/octet-stream",
                                      "Inference-Header-Content-Length": str(len(text))}
