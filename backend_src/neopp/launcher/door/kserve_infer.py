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

from ...contract.inputs import CLASSIFICATION_REFUSED
from . import strict_json, tensors
from .bounds import BYTE_COUNT
from .door_error import DoorError, invalid
from .spliced_request import WireRequest

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
    """Which outputs go back as binary: named ones as asked, the rest by ``binary_data_output``;
    those written into a shared-memory region go back as name, datatype and shape only."""

    binary: dict[str, bool] = field(default_factory=dict)
    default_binary: bool = False
    in_region: set[str] = field(default_factory=set)

    def wants_binary(self, name: str) -> bool:
        return self.binary.get(name, self.default_binary)


@dataclass
class InferHeader:
    """A checked JSON header: the request without its binary parts, and where they go.

    ``slots`` holds, in input order, each input that travels inside the request: its JSON data as
    raw bytes, or the size of its part after the header. ``regions``: the shared-memory regions
    the client named (the door allows only its own registrations).
    """

    message: pb.ModelInferRequest
    slots: list[tuple[int, bytes | int]]
    plan: OutputPlan
    regions: set[str]

    def __reduce__(self):
        """Across processes with the message as bytes (the generated classes do not pickle)."""
        return _header_from, (self.message.SerializeToString(), self.slots, self.plan, self.regions)


def _header_from(message: bytes, slots: list, plan: OutputPlan, regions: set[str]) -> InferHeader:
    return InferHeader(pb.ModelInferRequest.FromString(message), slots, plan, regions)


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


def _shm_parameters(target: Any, params: dict[str, Any], what: str, regions: set[str]) -> bool:
    """Copies shared-memory parameters (the region's name into ``regions``); True when the
    tensor lives in a registered region."""
    for key, kind in SHM_PARAMETERS.items():
        if key in params:
            if type(params[key]) is not kind or (kind is int and params[key] < 0):
                rule = "a string" if kind is str else "a non-negative integer"
                raise invalid(f"{what}: parameters.{key} must be {rule}")
            set_parameter(target.parameters[key], params[key], what)
    if "shared_memory_region" in params:
        regions.add(params["shared_memory_region"])
        return True
    return False


def _input(header: InferHeader, item: Any, names: set[str]) -> None:
    item = _keys(item, INPUT_KEYS, "each input")
    name = _name(item.get("name"), "input")
    if name in names:
        raise invalid(f"input '{name}' appears twice")
    names.add(name)
    shape = tensors.check_shape(item.get("shape"), name)
    datatype = tensors.check_datatype(item.get("datatype"), name)
    params = item.get("parameters") or {}
    params = _keys(params, {"binary_data_size", *SHM_PARAMETERS}, f"input '{name}' parameters")
    tensor = header.message.inputs.add(name=name, datatype=datatype, shape=shape)
    index = len(header.message.inputs) - 1
    sources = [key for key in ("data", "binary_data_size", "shared_memory_region") if key in item or key in params]
    if len(sources) != 1:
        raise invalid(f"input '{name}': give exactly one of 'data', parameters.binary_data_size or "
                      f"parameters.shared_memory_region")
    if _shm_parameters(tensor, params, f"input '{name}'", header.regions):
        return
    if "data" in item:
        header.slots.append((index, tensors.raw_from_json(item["data"], datatype, shape, name)))
        return
    size = params["binary_data_size"]
    if type(size) is not int or size < 0:
        raise invalid(f"input '{name}': parameters.binary_data_size must be a non-negative integer")
    tensors.check_size(size, datatype, shape, name)
    header.slots.append((index, size))


def _outputs(header: InferHeader, outputs: Any) -> None:
    request, plan = header.message, header.plan
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
            raise invalid(f"output '{name}': {CLASSIFICATION_REFUSED}")
        if _shm_parameters(out, params, f"output '{name}'", header.regions):
            plan.in_region.add(name)


def json_part(headers: Any, max_json: int) -> int | None:
    """The JSON part's size as the headers declare it (None: the whole body, however large it
    inflates); a 413 before a byte is read when it is over ``max_json``."""
    declared = headers.get("inference-header-content-length") or (
        None if "content-encoding" in headers else headers.get("content-length"))
    if declared is not None and BYTE_COUNT.match(declared) and int(declared) > max_json:
        raise DoorError(413, f"the JSON part of the request is {declared} bytes, over the {max_json} byte "
                        f"limit for JSON; {JSON_HINT}", reason="json_too_large")
    header = headers.get("inference-header-content-length")
    return int(header) if header is not None and BYTE_COUNT.match(header) else None


def split_header(header_length: str | None, length: int, max_json: int) -> int:
    """Where the JSON header ends (the whole body when there is no binary part)."""
    if header_length is None:
        split = length
    elif not BYTE_COUNT.match(header_length) or not 0 < int(header_length) <= length:
        raise invalid(f"Inference-Header-Content-Length must be a byte count within the body's {length}")
    else:
        split = int(header_length)
    if split > max_json:
        raise DoorError(413, f"the JSON part of the request is {split} bytes, over the {max_json} byte "
                        f"limit for JSON; {JSON_HINT}", reason="json_too_large")
    return split


def parse_header(header_bytes: bytes, model: str, version: str, max_values: int) -> InferHeader:
    """The checked JSON header of an infer request (run away from the door's event loop)."""
    strict_json.count_values(header_bytes, max_values, "inference request header", JSON_HINT)
    doc = _keys(strict_json.loads(header_bytes, "inference request header"), REQUEST_KEYS,
                "the inference request header")
    header = InferHeader(pb.ModelInferRequest(model_name=model, model_version=version), [], OutputPlan(), set())
    request = header.message
    if "id" in doc:
        if not isinstance(doc["id"], str) or len(doc["id"]) > MAX_TEXT_PARAMETER:
            raise invalid(f"'id' must be a string of at most {MAX_TEXT_PARAMETER} characters")
        request.id = doc["id"]
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or not 0 < len(inputs) <= MAX_TENSORS:
        raise invalid(f"'inputs' must be a list of 1-{MAX_TENSORS} objects")
    names: set[str] = set()
    for item in inputs:
        _input(header, item, names)
    _request_parameters(request, doc.get("parameters"), header.plan)
    _outputs(header, doc.get("outputs"))
    return header


def with_binary(header: InferHeader, rest: memoryview, region: tuple[str, int] | None = None) -> WireRequest:
    """The gRPC request: the header's inputs with their binary parts from ``rest`` (views, copied
    once onto the wire), or, with ``region`` (name, offset), where ``rest`` lies in a registered
    shared-memory region, so that Triton reads them in place (an empty one: inline)."""
    wire, pos = WireRequest(header.message), 0
    for index, source in header.slots:
        if isinstance(source, bytes):
            wire.raws.append(source)
            continue
        tensor = header.message.inputs[index]
        if pos + source > len(rest):
            raise invalid(f"input '{tensor.name}': binary_data_size {source} runs past the end of the body")
        if tensor.datatype == "BYTES":
            tensors.check_bytes(rest[pos:pos + source], list(tensor.shape), tensor.name)
        if region is not None and source:
            for key, value in (("shared_memory_region", region[0]), ("shared_memory_offset", region[1] + pos),
                               ("shared_memory_byte_size", source)):
                set_parameter(tensor.parameters[key], value, tensor.name)
        else:
            wire.raws.append(rest[pos:pos + source])
        pos += source
    if pos != len(rest):
        raise invalid(f"the body has {len(rest) - pos} bytes after the last binary input")
    return wire


def parse_infer(body: bytes, header_length: str | None, model: str, version: str,
                max_json: int, max_values: int = 65_536) -> tuple[WireRequest, OutputPlan]:
    """The gRPC request this HTTP infer request means, and how to send its outputs back (in one
    step: the door itself parses the header away from its loop and joins the parts there)."""
    split = split_header(header_length, len(body), max_json)
    header = parse_header(body[:split], model, version, max_values)
    return with_binary(header, memoryview(body)[split:]), header.plan


def _parameters_json(params: Any) -> dict[str, Any]:
    return {key: parameter_value(value) for key, value in params.items()}


def infer_response(response: pb.ModelInferResponse, plan: OutputPlan) -> tuple[bytes, dict[str, str]]:
    """The HTTP body and headers of a gRPC response, binary parts after the JSON header. An output
    written into a region has an empty raw entry (they stay aligned with the outputs) and goes
    back as name, datatype and shape, as Triton's own HTTP answers it."""
    outputs, blobs, raws = [], [], response.raw_output_contents
    for index, out in enumerate(response.outputs):
        entry: dict[str, Any] = {"name": out.name, "datatype": out.datatype, "shape": list(out.shape)}
        params = _parameters_json(out.parameters)
        if out.name not in plan.in_region and "shared_memory_region" not in params:
            raw = raws[index]
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
