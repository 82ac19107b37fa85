"""The door's bounds without a server: JSON that Python reads into trouble, uploads that trickle,
one client's share of the body budget, per-route caps, the parse workers, shared-memory ownership
and naming, and the server's private regions (the e2e tests send the same through a launcher)."""

from __future__ import annotations

import asyncio
import gzip
import os
import subprocess
import sys
import zlib

import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb

from neopp.launcher.admin import restriction_args
from neopp.launcher.door import kserve_infer, parse_jobs, strict_json, tensors
from neopp.launcher.door import openai_images as oa
from neopp.launcher.door.auth import ClientRegions
from neopp.launcher.door.body import BodyReader, ByteBudget
from neopp.launcher.door.bounds import DoorLimits
from neopp.launcher.door.door_error import DoorError
from neopp.launcher.door.parse_jobs import Parser
from neopp.launcher.shm_regions import owner_tag, private_regions, remove_orphans


def _status(call, *args) -> tuple[int, str]:
    with pytest.raises(DoorError) as info:
        call(*args)
    return info.value.status, info.value.message


@pytest.mark.parametrize("body, rule", [
    (b'{"a": ' + b"9" * 5000 + b"}", "longer than the 40 digits"),  # Python itself stops at 4300
    (b'{"a": 1e999}', "beyond the range of a 64-bit float"),
    (b'{"a": [-1e400]}', "beyond the range"),
    (b'{"prompt": "a \\ud800 b"}', "lone UTF-16 surrogate"),
    (b'{"\\udc00": 1}', "lone UTF-16 surrogate"),
    (b'["x", ["\\ud83d"]]', "lone UTF-16 surrogate"),
])
def test_json_that_python_reads_into_trouble_is_a_400_naming_the_rule(body: bytes, rule: str) -> None:
    status, message = _status(strict_json.loads, body)
    assert status == 400 and rule in message


def test_valid_json_still_reads() -> None:
    assert strict_json.loads(b'["\\ud83d\\ude00", 18446744073709551615, 1.5e300]') == ["\U0001f600", 2**64 - 1,
                                                                                      1.5e300]


def test_bad_names_and_bytes_data_are_refused_not_a_fault() -> None:
    for doc in (b'{"inputs":[{"name":"\\ud800","datatype":"INT64","shape":[1],"data":[1]}]}',
                b'{"inputs":[{"name":"S","datatype":"BYTES","shape":[1],"data":["\\udfff"]}]}'):
        assert _status(kserve_infer.parse_header, doc, "m", "", 1000)[0] == 400
    metadata = pb.ModelMetadataResponse(name="m")
    metadata.inputs.add(name="PROMPT", datatype="BYTES", shape=[1])
    assert _status(parse_jobs.generate_request, b'{"PROMPT": "\\ud800"}', "m", "", metadata.SerializeToString(),
                   False, 100)[0] == 400
    assert _status(parse_jobs.control_body, b'{"a": 1e999}', 100)[0] == 400
    status, message = _status(tensors.check_size, 0, "BYTES", [1 << 20], "S")
    assert status == 400 and "at most 65536 elements" in message


def test_json_values_are_counted_before_parsing() -> None:
    body = b"[" + b",".join([b"1"] * 2000) + b"]"
    status, message = _status(strict_json.count_values, body, 1000, "request body")
    assert status == 413 and "over 1000 JSON values" in message
    header = b'{"inputs":[{"name":"X","datatype":"INT64","shape":[2000],"data":' + body + b"}]}"
    assert _status(kserve_infer.parse_header, header, "m", "", 1000)[0] == 413


def _receive(chunks: list[tuple[float, bytes]]):
    """Body pieces, each after its pause (seconds); then silence."""
    pending = list(chunks)

    async def receive() -> dict:
        if not pending:
            await asyncio.sleep(3600)
        pause, data = pending.pop(0)
        await asyncio.sleep(pause)
        return {"type": "http.request", "body": data, "more_body": bool(pending)}
    return receive


def _read(chunks, length: int, limits: DoorLimits, budget: ByteBudget | None = None, client: str = "c",
          route: str = "inference", encoding: str | None = None) -> bytes:
    headers = {"content-length": str(length), **({"content-encoding": encoding} if encoding else {})}

    async def run() -> bytes:
        async with BodyReader(budget or ByteBudget(limits.bodies_in_flight), limits, client,
                              limits.cap(route)) as reader:
            return await reader.read(_receive(chunks), headers)
    return asyncio.run(run())


def test_an_upload_that_falls_behind_the_minimum_rate_is_dropped() -> None:
    limits = DoorLimits(min_upload_rate=1000.0, read_timeout_s=0.3)
    # a pause within the grace, then fast again: fine
    assert _read([(0.0, b"x" * 100), (0.2, b"y" * 100)], 200, limits) == b"x" * 100 + b"y" * 100
    # a trickle: a byte now and then never keeps up with 1000 B/s once the grace is spent
    trickle = [(0.1, b"x")] * 50
    status, message = _status(_read, trickle, 10_000, limits)
    assert status == 408 and "behind the minimum rate of 0.976562 KiB/s" in message


def test_no_client_holds_more_than_its_share_of_the_body_budget() -> None:
    budget = ByteBudget(1000, per_client=400)
    budget.reserve(400, "a")
    status, message = _status(budget.reserve, 1, "a")
    assert status == 503 and "its share (400)" in message
    budget.reserve(400, "b")  # another client still fits
    assert _status(budget.reserve, 300, "c")[0] == 503  # the whole budget: 800 + 300 > 1000
    budget.release(400, "a")
    budget.reserve(300, "c")
    assert budget.held == {"b": 400, "c": 300} and budget.used == 700
    assert _status(budget.check_size, 401)[0] == 413  # over one client's share: never fits


def test_each_route_reads_only_what_it_needs() -> None:
    limits = DoorLimits(openai_body=1000, control_body=2000)
    status, message = _status(_read, [(0, b"x" * 1001)], 1001, limits, None, "c", "openai")
    assert status == 413 and "1000 byte limit of openai requests" in message
    packed = gzip.compress(b" " * 5000)  # small on the wire, over the cap inflated
    status, message = _status(_read, [(0, packed)], len(packed), limits, None, "c", "control", "gzip")
    assert status == 413 and "inflates to more than the 2000 byte limit" in message


def test_compressed_bodies_hold_one_stream_and_nothing_after_it() -> None:
    limits = DoorLimits()
    doc = b'{"inputs": []}'
    for coding, packed in (("gzip", gzip.compress(doc)), ("deflate", zlib.compress(doc))):
        assert _read([(0, packed)], len(packed), limits, encoding=coding) == doc
        junk = packed + b"junk"
        status, message = _status(_read, [(0, junk)], len(junk), limits, None, "c", "inference", coding)
        assert status == 400 and "after the end of its" in message
    twice = gzip.compress(doc) + gzip.compress(doc)  # a second member is more than one stream too
    assert _status(_read, [(0, twice)], len(twice), limits, None, "c", "inference", "gzip")[0] == 400


def test_a_large_inflation_gives_the_loop_turns() -> None:
    """8 MiB inflated from one chunk: the reader yields between 1 MiB steps, so a ticker runs."""
    limits = DoorLimits()
    packed = gzip.compress(b"a" * (8 << 20))
    ticks = 0

    async def run() -> bytes:
        nonlocal ticks
        done = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0)
        task = asyncio.ensure_future(ticker())
        async with BodyReader(ByteBudget(limits.bodies_in_flight), limits, "c") as reader:
            data = await reader.read(_receive([(0, packed)]), {"content-length": str(len(packed)),
                                                              "content-encoding": "gzip"})
        done.set()
        await task
        return data
    assert len(asyncio.run(run())) == 8 << 20 and ticks >= 7


def test_openai_fields_that_change_nothing_are_still_bounded() -> None:
    for doc, param in (({"prompt": "x", "user": ["u"] * 10}, "user"), ({"prompt": "x", "user": "u" * 300}, "user"),
                       ({"prompt": "x", "quality": "x" * 50}, "quality"), ({"prompt": "x", "style": 1}, "style"),
                       ({"prompt": "x", "output_compression": 101}, "output_compression")):
        with pytest.raises(oa.OpenAIError) as info:
            oa.parse_images_request(doc)
        assert info.value.status == 400 and info.value.param == param
    assert oa.parse_images_request({"prompt": "x", "user": "u1", "quality": "auto", "output_compression": 50})
    for status in (408, 411, 413, 415):  # the door's own refusals keep their status on /v1
        assert oa.refusal(status, "x", {}).status == status


def test_documents_parsed_in_a_worker_come_back_as_parsed_in_a_thread() -> None:
    text = "p" * 100_000  # over INLINE_BYTES: a worker's
    body = b'{"inputs":[{"name":"N","datatype":"INT64","shape":[2],"data":[7,-8]},' \
           b'{"name":"KV","datatype":"BF16","shape":[2],"parameters":{"binary_data_size":4}},' \
           b'{"name":"P","datatype":"BYTES","shape":[1],"data":["' + text.encode() + b'"]}],' \
           b'"outputs":[{"name":"IMAGE","parameters":{"shared_memory_region":"r1","shared_memory_byte_size":64}}]}'
    parser = Parser(workers=1)

    async def run():
        big = await parser.run(len(body), parse_jobs.infer_header, body, "m", "", 1000)
        small = await parser.run(0, parse_jobs.infer_header, body, "m", "", 1000)
        with pytest.raises(DoorError) as info:  # a refusal crosses the process whole
            await parser.run(len(body), parse_jobs.infer_header, b"[" * 100 + b"]" * 100, "m", "", 1000)
        return big, small, info.value
    try:
        big, small, error = asyncio.run(run())
    finally:
        parser.close()
    assert big.message == small.message and big.slots == small.slots == [
        (0, np.array([7, -8], "<i8").tobytes()), (1, 4), (2, tensors.serialize_bytes([text.encode()]))]
    assert big.regions == {"r1"} and big.plan.in_region == {"IMAGE"}
    assert error.status == 400 and "nests deeper" in error.message


def test_outputs_written_into_a_region_answer_with_their_shape_only() -> None:
    response = pb.ModelInferResponse(model_name="m", model_version="1")
    response.outputs.add(name="IMAGE", datatype="BYTES", shape=[1])
    response.outputs.add(name="NEXT", datatype="UINT8", shape=[2])
    response.raw_output_contents.extend([b"", bytes([1, 2])])  # Triton leaves the region's entry empty
    plan = kserve_infer.OutputPlan(in_region={"IMAGE"})
    body, _ = kserve_infer.infer_response(response, plan)
    assert strict_json.loads(body)["outputs"] == [{"name": "IMAGE", "datatype": "BYTES", "shape": [1]},
                                                  {"name": "NEXT", "datatype": "UINT8", "shape": [2], "data": [1, 2]}]


def test_a_request_names_only_regions_its_client_registered_through_the_door() -> None:
    regions = ClientRegions()
    regions.registered("systemsharedmemory", "mine", "10.0.0.1")
    regions.check({"mine"}, "10.0.0.1", with_key=True)
    for names, client, key, rule in (({"mine"}, "10.0.0.2", True, "not registered through this port"),
                                     ({"mine"}, "10.0.0.1", False, "need the operator key"),
                                     ({"door-0123"}, "10.0.0.1", True, "not registered"),
                                     ({"neopp_kv_0011"}, "10.0.0.1", True, "not registered")):
        status, message = _status(regions.check, names, client, key)
        assert status == 403 and rule in message
    regions.unregistered("systemsharedmemory", None)
    assert _status(regions.check, {"mine"}, "10.0.0.1", True)[0] == 403


def test_orphaned_server_regions_are_removed_and_no_other(tmp_path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = tmp_path / f"neopp_shm_{int(dead.stdout)}-7_0011aabb_uuid"
    live = tmp_path / f"neopp_shm_{owner_tag()}_0011aabb_uuid"
    old_form = tmp_path / "neopp_shm_00112233aabbccdd_uuid"  # no owner in the name: not ours to judge
    for path in (orphan, live, old_form):
        path.write_bytes(b"x")
    assert remove_orphans(("neopp_shm_",), tmp_path) == [orphan.name]
    assert live.exists() and old_form.exists()


def test_regions_a_dead_owner_left_stay_while_a_process_maps_them(tmp_path) -> None:
    """A server that outlives its launcher still uses its regions: they are not removed."""
    shm = tmp_path / "shm"
    shm.mkdir()
    region = shm / "neopp_shm_1-1_0011aabb_uuid"
    region.write_bytes(b"x" * 4096)
    holder = subprocess.Popen([sys.executable, "-c", f"import mmap,sys; f=open({str(region)!r},'r+b'); "
                               "m=mmap.mmap(f.fileno(), 0); print('mapped', flush=True); sys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "mapped"
        assert remove_orphans(("neopp_shm_",), shm) == [] and region.exists()
    finally:
        holder.communicate("")
    assert remove_orphans(("neopp_shm_",), shm) == [region.name]


def test_the_server_child_creates_its_regions_0600() -> None:
    """What boost does to a region it creates (create 0644, then fchmod 0644), under the child's setup."""
    path = f"/dev/shm/neopp_test_private_{os.getpid()}"
    code = f"import os; fd = os.open({path!r}, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)\n" \
           "try:\n    os.fchmod(fd, 0o644)\nexcept PermissionError:\n    pass\n"
    try:
        subprocess.run([sys.executable, "-c", code], preexec_fn=private_regions(), check=True)
        assert os.stat(path).st_mode & 0o777 == 0o600
    finally:
        if os.path.exists(path):
            os.unlink(path)


def test_grpc_inference_wants_the_api_key_as_triton_reads_it() -> None:
    args = restriction_args("admin-key-0123456789", "front", "api-key-0123456789abc")
    assert "--grpc-restricted-protocol=inference:authorization=Bearer api-key-0123456789abc" in args
    assert not any("inference:" in a for a in restriction_args("admin-key-0123456789", "front"))
