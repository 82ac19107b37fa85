"""The HTTP door's parsing, without a server: what a client writes is read once, strictly, and
the gRPC request is built from the checked values (the e2e tests send the same through a server)."""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import os
import struct
import subprocess
import sys
import zlib

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb

from neopp.launcher.door import generate_json, kserve_infer, strict_json, tensors
from neopp.launcher.door import openai_images as oa
from neopp.launcher.door.body import BodyReader, ByteBudget
from neopp.launcher.door.bounds import DoorLimits
from neopp.launcher.door.door_error import DoorError
from neopp.launcher.door.shm_arena import ShmArena, TensorRegion
from neopp.launcher.door.upstream import grpc_error
from neopp.launcher.shm_regions import owner_tag

MAX_JSON = 1 << 20


def _infer(doc: dict, binary: bytes = b"") -> tuple[pb.ModelInferRequest, kserve_infer.OutputPlan]:
    """The request as Triton receives it: the door's wire bytes parsed back by protobuf."""
    header = json.dumps(doc).encode()
    wire, plan = kserve_infer.parse_infer(header + binary, str(len(header)) if binary else None, "m", "", MAX_JSON)
    return pb.ModelInferRequest.FromString(wire.serialize()), plan


def _refused(match: str, status: int = 400):
    class _Check:
        def __enter__(self):
            self.ctx = pytest.raises(DoorError, match=match)
            self.info = self.ctx.__enter__()
            return self.info

        def __exit__(self, *exc):
            out = self.ctx.__exit__(*exc)
            assert self.info.value.status == status, self.info.value.message
            return out
    return _Check()


@pytest.mark.parametrize("body, match", [
    (b'{"inputs":[{"name":"A","datatype":"INT64","shape":[1000000000000],"shape":[1],"data":[1]}]}',
     "duplicate key 'shape'"),
    (b'{"inputs":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests deeper"),
    (b'{"inputs":' + b"[" * 40 + b"]" * 40 + b"}", "nests deeper"),
    (b'{"inputs":[{"name":"A","datatype":"FP32","shape":[1],"data":[NaN]}]}', "'NaN' is not JSON"),
    (b'{"inputs": [', "not valid JSON"),
    (b'\xff\xfe', "not UTF-8"),
])
def test_json_is_read_one_way_only(body: bytes, match: str) -> None:
    with _refused(match):
        kserve_infer.parse_infer(body, None, "m", "", MAX_JSON)


@pytest.mark.parametrize("item, match", [
    ({"name": "A", "datatype": "INT64", "shape": [10**12], "data": [1]}, "holds 1 elements"),
    ({"name": "A", "datatype": "INT64", "shape": [-1], "data": [1]}, "non-negative"),
    ({"name": "A", "datatype": "INT64", "shape": [True], "data": [1]}, "non-negative"),
    ({"name": "A", "datatype": "INT64", "shape": "1", "data": [1]}, "non-negative"),
    ({"name": "A", "datatype": "INT8", "shape": [1], "data": [300]}, "out of range"),
    ({"name": "A", "datatype": "INT64", "shape": [1], "data": [1.5]}, "integers"),
    ({"name": "A", "datatype": "FP32", "shape": [1], "data": [1e300]}, "out of range"),
    ({"name": "A", "datatype": "BOOL", "shape": [1], "data": [1]}, "true or false"),
    ({"name": "A", "datatype": "BF16", "shape": [1], "data": [1.0]}, "binary tensor extension"),
    ({"name": "A", "datatype": "XX", "shape": [1], "data": [1]}, "'datatype'"),
    ({"name": "A", "datatype": "INT64", "shape": [1]}, "exactly one of"),
    ({"name": "A", "datatype": "INT64", "shape": [1], "data": [1], "extra": 1}, "unknown field 'extra'"),
    ({"name": "A", "datatype": "BF16", "shape": [2**40, 2], "parameters": {"binary_data_size": 4}}, "needs 439804"),
])
def test_inputs_are_checked_field_by_field(item: dict, match: str) -> None:
    with _refused(match):
        _infer({"inputs": [item]}, b"\0" * 4 if "parameters" in item else b"")


def test_binary_sizes_must_add_up_to_the_body() -> None:
    item = {"name": "KV", "datatype": "BF16", "shape": [2, 3], "parameters": {"binary_data_size": 12}}
    with _refused("needs 12"):
        _infer({"inputs": [{**item, "parameters": {"binary_data_size": 10}}]}, b"\0" * 12)
    with _refused("after the last binary input"):
        _infer({"inputs": [item]}, b"\0" * 16)
    bad_bytes = {"name": "S", "datatype": "BYTES", "shape": [2], "parameters": {"binary_data_size": 9}}
    with _refused("holds 1 elements"):
        _infer({"inputs": [bad_bytes]}, struct.pack("<I", 5) + b"hello")


def test_the_grpc_request_carries_only_checked_values() -> None:
    kv = np.arange(6, dtype=np.uint16).tobytes()
    doc = {"id": "r1", "inputs": [
        {"name": "KV", "datatype": "BF16", "shape": [2, 3], "parameters": {"binary_data_size": 12}},
        {"name": "N", "datatype": "INT64", "shape": [2, 1], "data": [[7], [-8]]},
        {"name": "F", "datatype": "BYTES", "shape": [1], "data": ["png"]}],
        "outputs": [{"name": "IMAGE", "parameters": {"binary_data": True}}],
        "parameters": {"sequence_id": 5, "sequence_start": True, "binary_data_output": False}}
    request, plan = _infer(doc, kv)
    assert [t.name for t in request.inputs] == ["KV", "N", "F"] and request.id == "r1"
    assert request.raw_input_contents[0] == kv
    assert np.frombuffer(request.raw_input_contents[1], "<i8").tolist() == [7, -8]
    assert request.raw_input_contents[2] == struct.pack("<I", 3) + b"png"
    assert request.parameters["sequence_id"].int64_param == 5 and request.parameters["sequence_start"].bool_param
    assert "binary_data_output" not in request.parameters  # the door's own switch, consumed
    assert plan.wants_binary("IMAGE") and not plan.wants_binary("NEXT_RNG_STATE")


def test_an_outputs_classification_is_refused_before_triton() -> None:
    """Triton 2.51 dies (SIGFPE) classifying a BYTES output, and every output here is a picture."""
    for value in (1, 0):
        with _refused("output 'IMAGE': parameters.classification is not served"):
            _infer({"inputs": [{"name": "N", "datatype": "INT64", "shape": [1], "data": [1]}],
                    "outputs": [{"name": "IMAGE", "parameters": {"classification": value}}]})


def test_responses_are_json_unless_binary_is_asked_or_needed() -> None:
    response = pb.ModelInferResponse(model_name="m", model_version="1")
    response.outputs.add(name="IMAGE", datatype="BYTES", shape=[1])
    response.outputs.add(name="NEXT", datatype="UINT8", shape=[3])
    image = b"\x89PNG\xff\xfe"
    response.raw_output_contents.extend([tensors.serialize_bytes([image]), bytes([1, 2, 3])])
    body, headers = kserve_infer.infer_response(response, kserve_infer.OutputPlan())
    split = int(headers["Inference-Header-Content-Length"])
    header = json.loads(body[:split])
    assert header["outputs"][0]["parameters"]["binary_data_size"] == 4 + len(image)  # not UTF-8: binary
    assert header["outputs"][1]["data"] == [1, 2, 3]
    assert body[split:] == tensors.serialize_bytes([image])
    doc = generate_json.generate_response(response)
    assert base64.b64decode(doc["IMAGE"]) == image and doc["NEXT"] == [1, 2, 3]  # base64, valid JSON


def test_generate_maps_fields_to_declared_inputs() -> None:
    metadata = pb.ModelMetadataResponse(name="m")
    metadata.inputs.add(name="SIZE", datatype="INT64", shape=[2])
    metadata.inputs.add(name="SEED", datatype="INT64", shape=[1])
    metadata.inputs.add(name="KV", datatype="BF16", shape=[-1, 2])
    metadata.inputs.add(name="BASE64_OUTPUT", datatype="INT64", shape=[1])
    body = json.dumps({"SIZE": [64, 32], "SEED": 3, "BASE64_OUTPUT": 1, "MISSPELT": 2}).encode()
    request = generate_json.parse_generate(body, "m", "", metadata, stream=True).to_message()
    assert [(t.name, list(t.shape)) for t in request.inputs] == [("SIZE", [2]), ("SEED", [1])]
    assert request.parameters["MISSPELT"].int64_param == 2  # as Triton: the model decides
    assert request.parameters["triton_enable_empty_final_response"].bool_param
    with _refused("input 'KV': BF16 has no JSON form"):
        generate_json.parse_generate(b'{"KV": [[1.0, 2.0]]}', "m", "", metadata, stream=False)
    with _refused("'nested'"):
        generate_json.parse_generate(b'{"nested": {"a": 1}}', "m", "", metadata, stream=False)


def _receive(chunks: list[bytes], stall: bool = False):
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1 or stall}
                for i, c in enumerate(chunks)]

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        await asyncio.sleep(3600)  # a sender that went quiet
        return {"type": "http.disconnect"}
    return receive


def _read(chunks: list[bytes], headers: dict[str, str], limits: DoorLimits, budget: ByteBudget | None = None,
          stall: bool = False) -> bytes:
    async def run() -> bytes:
        async with BodyReader(budget or ByteBudget(limits.bodies_in_flight), limits) as reader:
            return await reader.read(_receive(chunks, stall), headers)
    return asyncio.run(run())


def test_bodies_inflate_under_the_limit_and_stalls_are_dropped() -> None:
    limits = DoorLimits(max_body=1 << 20, read_timeout_s=0.2)
    doc = b'{"inputs": []}'
    for coding, packed in (("gzip", gzip.compress(doc)), ("deflate", zlib.compress(doc))):
        assert _read([packed[:5], packed[5:]], {"content-length": str(len(packed)), "content-encoding": coding},
                     limits) == doc
    bomb = gzip.compress(b" " * (8 << 20))
    with _refused("inflates to more than", 413):
        _read([bomb], {"content-length": str(len(bomb)), "content-encoding": "gzip"}, limits)
    with _refused("fell 0.2s behind the minimum rate", 408):
        _read([b"{"], {"content-length": "10"}, limits, stall=True)
    with _refused("chunked", 411):
        _read([b""], {"transfer-encoding": "chunked"}, limits)
    with _refused("over the", 413):
        _read([b""], {"content-length": str(2 << 20)}, limits)
    with _refused("not supported", 415):
        _read([b""], {"content-length": "0", "content-encoding": "br"}, limits)


def test_the_body_budget_refuses_at_once_and_is_given_back() -> None:
    limits = DoorLimits(max_body=1 << 20, bodies_in_flight=1000)
    budget = ByteBudget(1000)
    budget.reserve(900)
    with _refused("does not fit now", 503) as info:
        _read([b"x" * 200], {"content-length": "200"}, limits, budget)
    assert info.value.headers["Retry-After"] == "1"
    budget.release(900)
    assert _read([b"x" * 200], {"content-length": "200"}, limits, budget) == b"x" * 200
    assert budget.used == 0


def test_strict_json_round_trip() -> None:
    assert strict_json.loads(strict_json.dumps({"a": [1, 2.5, "x"]})) == {"a": [1, 2.5, "x"]}


def test_triton_errors_keep_their_meaning_over_http() -> None:
    def error(code: grpc.StatusCode, details: str) -> DoorError:
        return grpc_error(grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details))

    full = error(grpc.StatusCode.UNAVAILABLE, "[request id: <id_unknown>] Exceeds maximum queue size")
    assert full.status == 429 and full.headers == {"Retry-After": "1"}
    assert error(grpc.StatusCode.INVALID_ARGUMENT, "COND_KV: bad").status == 400
    gone = error(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses")  # the server is restarting
    assert gone.status == 503 and gone.headers == {"Retry-After": "2"}
    assert error(grpc.StatusCode.NOT_FOUND, "unknown session").status == 404


def test_the_tensor_region_lends_disjoint_slices_and_takes_them_back(tmp_path) -> None:
    arena = ShmArena(1024, directory=tmp_path)
    try:
        assert (tmp_path / arena.name).stat().st_mode & 0o777 == 0o600
        with arena.lend(100) as a, arena.lend(500) as b, arena.lend(500) as c:
            assert a.offset == 0 and b.offset == 128 and c is None  # 64-byte aligned, first fit
            a.view[:3] = b"abc"
            with arena.lend(300) as d:
                assert d.offset == 640
        assert arena.free_bytes() == 1024
        with arena.lend(1024) as whole:
            assert whole.offset == 0 and bytes(whole.view[:3]) == b"abc"
    finally:
        arena.close()
    assert not (tmp_path / arena.name).exists()


def test_regions_of_doors_that_died_are_removed_and_no_other(tmp_path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = tmp_path / f"neopp_door_{int(dead.stdout)}-1_00112233aabbccdd"
    alive = tmp_path / f"neopp_door_{owner_tag(os.getppid())}_00112233aabbccdd"  # a live process: another server's
    reused = tmp_path / f"neopp_door_{os.getppid()}-1_00112233aabbccdd"  # its pid, another start time: dead
    old_form, foreign = tmp_path / f"neopp_door_{int(dead.stdout)}_0011", tmp_path / "neopp_kv_0011"
    for path in (orphan, alive, reused, old_form, foreign):
        path.write_bytes(b"x")
    arena = ShmArena(1024, directory=tmp_path)
    arena.close()
    assert not orphan.exists() and not reused.exists()
    assert alive.exists() and old_form.exists() and foreign.exists()


def test_binary_inputs_of_a_plain_body_are_written_into_the_region(tmp_path) -> None:
    async def register(name: str, key: str, size: int) -> None:
        registered.append((name, key, size))

    registered: list = []
    region = TensorRegion(ShmArena(1 << 16, directory=tmp_path), register, 1024, 4096, print)
    header = {"content-length": "5000", "inference-header-content-length": "200"}
    try:
        assert region.wants(header) == 4800
        assert region.wants({**header, "content-encoding": "gzip"}) == 0  # inflated: no fixed place
        assert region.wants({**header, "inference-header-content-length": "4500"}) == 0  # tail under 1024
        assert region.wants({**header, "inference-header-content-length": "6000"}) == 0  # header past the body
        kv = np.arange(2400, dtype=np.uint16).tobytes()
        doc = json.dumps({"inputs": [{"name": "KV", "datatype": "BF16", "shape": [2400],
                                      "parameters": {"binary_data_size": len(kv)}}]}).encode()
        headers = {"content-length": str(len(doc) + len(kv)), "inference-header-content-length": str(len(doc))}

        async def run() -> pb.ModelInferRequest:
            async with BodyReader(ByteBudget(1 << 20), DoorLimits()) as reader, region.slot(headers) as slot:
                head = await reader.read(_receive([doc[:10], doc[10:] + kv[:7], kv[7:]]), headers, tail=slot.view)
                header = kserve_infer.parse_header(bytes(head), "m", "", 1000)
                wire = kserve_infer.with_binary(header, slot.view, (region.name, slot.offset))
                assert bytes(slot.view) == kv
                return pb.ModelInferRequest.FromString(wire.serialize())

        request = asyncio.run(run())
        assert registered == [(region.name, "/" + region.arena.name, 1 << 16)]
        assert region.arena.name not in region.name  # Triton's name for it is not the file's
        params = {k: kserve_infer.parameter_value(v) for k, v in request.inputs[0].parameters.items()}
        assert params == {"shared_memory_region": region.name, "shared_memory_offset": 0,
                          "shared_memory_byte_size": len(kv)}
        assert not request.raw_input_contents
        assert not region.lost(f"Invalid offset + byte size for shared memory region: '{region.name}'")
        assert region.lost(f"Unable to find shared memory region: '{region.name}'") and not region.registered
    finally:
        region.close()


def test_openai_images_requests_are_checked_and_mapped_onto_the_prompt_model() -> None:
    req, stream = oa.parse_images_request({"prompt": "a red circle", "size": "96x64", "n": 2, "seed": 5,
                                           "num_inference_steps": 3, "guidance_scale": 2, "quality": "auto"})
    assert not stream and req.size == (64, 96) and req.size_text == "96x64" and req.model == "neopp_dense"
    second = pb.ModelInferRequest.FromString(oa.prompt_model_request(req, 1).serialize())
    raw = dict(zip((t.name for t in second.inputs), second.raw_input_contents))
    assert second.model_name == "neopp_t2i" and raw["PROMPT"] == struct.pack("<I", 12) + b"a red circle"
    assert np.frombuffer(raw["SEED"], "<i8").tolist() == [6]  # image i: seed + i
    assert np.frombuffer(raw["SIZE"], "<i8").tolist() == [64, 96] and raw["OUTPUT_FORMAT"].endswith(b"png")
    assert oa.parse_images_request({"prompt": "x"})[0].seed >= 0  # drawn, then reported
    for doc, param in (({"prompt": ""}, "prompt"), ({"prompt": "x", "response_format": "url"}, "response_format"),
                       ({"prompt": "x", "size": "64"}, "size"), ({"prompt": "x", "n": 0}, "n"),
                       ({"prompt": "x", "n": True}, "n"), ({"prompt": "x", "colour": "red"}, "colour"),
                       ({"prompt": "x", "partial_images": 2}, "partial_images"),
                       ({"prompt": "x", "guidance_scale": "high"}, "guidance_scale")):
        with pytest.raises(oa.OpenAIError) as info:
            oa.parse_images_request(doc)
        assert info.value.status == 400 and info.value.param == param
    assert "THINK" not in raw  # think mode only when asked
    thinking, _ = oa.parse_images_request({"prompt": "x", "think": True, "think_max_tokens": 12})
    asked = pb.ModelInferRequest.FromString(oa.prompt_model_request(thinking, 0).serialize())
    think_raw = dict(zip((t.name for t in asked.inputs), asked.raw_input_contents))
    assert think_raw["THINK"] == b"\x01" and np.frombuffer(think_raw["THINK_MAX_TOKENS"], "<i8").tolist() == [12]
    encoder = pb.ModelInferRequest.FromString(oa.encoder_request(thinking).serialize())
    assert [t.name for t in encoder.inputs] == ["PROMPT", "THINK", "THINK_MAX_TOKENS"]
    for doc, param in (({"prompt": "x", "think": 1}, "think"),
                       ({"prompt": "x", "think_max_tokens": 5}, "think_max_tokens"),
                       ({"prompt": "x", "think": True, "think_max_tokens": 5000}, "think_max_tokens")):
        with pytest.raises(oa.OpenAIError) as info:
            oa.parse_images_request(doc)
        assert info.value.status == 400 and info.value.param == param
    assert oa.refusal(400, "THINK: this checkpoint has no think mode", {}).param == "think"
    assert oa.refusal(400, "SIZE: width must be a positive multiple of 32", {}).param == "size"
    assert oa.refusal(429, "Exceeds maximum queue size", {"Retry-After": "1"}).kind == "rate_limit_error"


def test_the_guidance_norm_and_the_time_shift_reach_the_model_which_checks_them() -> None:
    req, _ = oa.parse_images_request({"prompt": "x", "cfg_norm": "channel", "timestep_shift": 2})
    message = pb.ModelInferRequest.FromString(oa.prompt_model_request(req, 0).serialize())
    raw = dict(zip((t.name for t in message.inputs), message.raw_input_contents))
    assert raw["CFG_NORM"] == struct.pack("<I", 7) + b"channel"
    assert np.frombuffer(raw["TIMESTEP_SHIFT"], "<f4").tolist() == [2.0]
    plain = pb.ModelInferRequest.FromString(oa.prompt_model_request(oa.parse_images_request({"prompt": "x"})[0],
                                                                     0).serialize())
    assert not {"CFG_NORM", "TIMESTEP_SHIFT"} & {t.name for t in plain.inputs}  # the mode's own by default
    for doc in ({"timestep_shift": 0}, {"timestep_shift": "3"}, {"timestep_shift": True}, {"cfg_norm": 1}):
        with pytest.raises(oa.OpenAIError) as info:
            oa.parse_images_request({"prompt": "x", **doc})
        assert info.value.status == 400 and info.value.param == next(iter(doc))
    assert oa.refusal(400, "CFG_NORM: unknown normalisation 'l2'", {}).param == "cfg_norm"
    assert oa.refusal(400, "TIMESTEP_SHIFT: must be in 0.001..1000", {}).param == "timestep_shift"


def test_partial_images_are_spread_over_the_steps() -> None:
    assert oa.preview_plan(2, 6) == 2 and oa.preview_plan(3, None) == 1
    sent, picked = 0, []
    for step in range(1, 21):  # previews every step of 20 (steps unknown up front)
        if oa.wanted_preview(step, 20, sent, 3):
            picked.append(step)
            sent += 1
    assert picked == [5, 10, 15]
    assert not oa.wanted_preview(20, 20, 0, 1)  # the last step carries the image, not a preview
