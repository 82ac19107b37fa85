"""The gRPC front's rules without a server: which of Triton's errors a client is told to retry,
what it refuses before Triton, and that it relays every method of the service."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from tritonclient.grpc import service_pb2 as pb

from neopp.contract.statuses import status_of_message
from neopp.launcher.door.body import ByteBudget
from neopp.launcher.door.client_load import ClientLoad
from neopp.launcher.door.door_error import DoorError
from neopp.launcher.door.grpc_calls import OpenCalls
from neopp.launcher.door.grpc_front import Relay, peer_host
from neopp.launcher.door.grpc_stream import ends_a_request, stream_error
from neopp.launcher.door.message_fields import (
    MAX_FIELDS,
    MAX_NAME_BYTES,
    MAX_PACKED,
    BadMessage,
    TooManyFields,
    check_fields,
    inference_problem,
    parse_request,
)
from neopp.launcher.health import ServerHealth, recovering

MODEL = "neopp_dense"


def _now() -> float:
    """A request sent now: after the server came up, so no recovery ran while it did."""
    return time.monotonic()


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@pytest.fixture
def health() -> ServerHealth:
    health = ServerHealth()
    health.server_up()
    return health


def test_a_gone_instance_is_unavailable_and_other_errors_keep_their_status(health):
    relay = Relay("unix:/nowhere", health)
    gone = _error(grpc.StatusCode.INTERNAL, f"Stub process '{MODEL}_0_0' is not healthy.")
    assert relay.status_of(gone, MODEL, _now()) == grpc.StatusCode.UNAVAILABLE
    assert relay.status_of(_error(grpc.StatusCode.INTERNAL, "internal error: a bug"), MODEL, _now()) \
        == grpc.StatusCode.INTERNAL
    planted = _error(grpc.StatusCode.INVALID_ARGUMENT, f"unexpected inference input 'Stub process '{MODEL}_0_0' "
                                                       "is not healthy.'")
    assert relay.status_of(planted, MODEL, _now()) == grpc.StatusCode.INVALID_ARGUMENT
    for code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE):
        assert relay.status_of(_error(code, "x"), MODEL, _now()) == code


def test_an_internal_error_while_the_launcher_knew_of_a_recovery_is_unavailable(health):
    relay = Relay("unix:/nowhere", health)
    sent = _now() - 10.0  # before the server came up: it was recovering while the request ran
    assert relay.status_of(_error(grpc.StatusCode.INTERNAL, "x"), "another_model", sent) == grpc.StatusCode.UNAVAILABLE
    bug = _error(grpc.StatusCode.INTERNAL, "internal error: the pipe broke")
    assert relay.status_of(bug, MODEL, _now()) == grpc.StatusCode.INTERNAL
    health.model_broken(MODEL, "no live stub")
    assert relay.status_of(bug, MODEL, _now()) == grpc.StatusCode.UNAVAILABLE
    assert relay.status_of(bug, "another_model", _now()) == grpc.StatusCode.UNAVAILABLE  # the replica is unready
    health.model_serving(MODEL)
    assert relay.status_of(bug, MODEL, _now()) == grpc.StatusCode.INTERNAL
    assert Relay("unix:/nowhere", None).status_of(bug, MODEL, _now()) == grpc.StatusCode.INTERNAL


def test_what_the_launcher_knows_is_refused_before_triton(health):
    relay = Relay("unix:/nowhere", health)
    assert relay.refusal(MODEL) is None
    health.model_broken(MODEL, "reloading")
    assert relay.refusal(MODEL) == f"not serving now, try again shortly: {MODEL}: reloading"
    assert relay.refusal("another_model") is None
    health.server_down("tritonserver is restarting")
    assert "tritonserver is restarting" in relay.refusal("another_model")
    assert Relay("unix:/nowhere", None).refusal(MODEL) is None


def test_a_refused_stream_request_is_answered_in_the_stream():
    request = pb.ModelInferRequest(model_name=MODEL, id="r-7")
    answer = pb.ModelStreamInferResponse.FromString(stream_error(request, recovering("reloading")))
    assert answer.error_message == "not serving now, try again shortly: reloading"  # said once
    assert (answer.infer_response.id, answer.infer_response.model_name) == ("r-7", MODEL)
    # the text alone tells the client to retry: a stream's error has no status
    share = ClientLoad(1)
    share.take("c")
    budget = ByteBudget(10, 5)
    for refusal in (_refusal(lambda: share.take("c")), _refusal(lambda: budget.reserve(11, "c")),
                    _refusal(lambda: budget.reserve(6, "c"))):
        text = pb.ModelStreamInferResponse.FromString(stream_error(request, refusal)).error_message
        assert text.endswith(refusal) and status_of_message(text) == "UNAVAILABLE", text


def _refusal(call) -> str:
    with pytest.raises(DoorError) as refused:
        call()
    return refused.value.message


def test_every_method_of_the_service_is_relayed():
    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    handler = Relay("unix:/nowhere", None).handler()
    for method in service.methods:
        details = _CallDetails(f"/inference.GRPCInferenceService/{method.name}")
        relayed = handler.service(details)
        assert relayed is not None, method.name
        # read as bytes, whatever the method's kind, so a call of no message or of garbage is answered
        assert relayed.request_streaming and relayed.request_deserializer is None, method.name
    assert handler.service(_CallDetails("/inference.GRPCInferenceService/NoSuchMethod")) is None


class _CallDetails(grpc.HandlerCallDetails):
    def __init__(self, method: str) -> None:
        self.method, self.invocation_metadata = method, ()


class _Context:
    def __init__(self, *metadata: tuple[str, str]) -> None:
        self.metadata = metadata

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata


def test_inference_without_the_api_key_is_refused_as_triton_refuses_it():
    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    infer, stream, live = (service.methods_by_name[name] for name in ("ModelInfer", "ModelStreamInfer", "ServerLive"))
    relay, key = Relay("unix:/nowhere", None, api_key="k" * 20), "triton-grpc-protocol-authorization"
    for method in (infer, stream):
        assert relay.unkeyed(method, _Context())
        assert relay.unkeyed(method, _Context((key, "Bearer " + "x" * 20)))
        assert relay.unkeyed(method, _Context((key, "Bearer " + "k" * 20), (key, "Bearer " + "k" * 20)))
        assert not relay.unkeyed(method, _Context((key, "Bearer " + "k" * 20), ("other", "v")))
    assert not relay.unkeyed(live, _Context())  # health stays open
    assert not Relay("unix:/nowhere", None).unkeyed(infer, _Context())


def test_a_stream_request_counts_until_its_last_answer():
    preview = pb.ModelStreamInferResponse()
    preview.infer_response.parameters["triton_final_response"].bool_param = False
    last = pb.ModelStreamInferResponse()
    last.infer_response.parameters["triton_final_response"].bool_param = True
    assert not ends_a_request(preview.SerializeToString())
    assert ends_a_request(last.SerializeToString())
    assert ends_a_request(pb.ModelStreamInferResponse(error_message="x").SerializeToString())
    assert ends_a_request(pb.ModelStreamInferResponse().SerializeToString())  # a model that sends one answer


def test_a_client_is_its_address_as_the_http_door_names_it():
    assert peer_host("ipv4:127.0.0.1:5000") == "127.0.0.1"
    assert peer_host("ipv6:[::1]:5000") == "::1"
    assert peer_host("ipv6:%5B::1%5D:41066") == "::1"  # how grpcio writes it: one client, whatever its port


def _infer_request(outputs: int = 0, tensor_bytes: int = 16) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=MODEL, id="r")
    tensor = request.inputs.add(name="COND_KV", datatype="BF16", shape=[tensor_bytes // 2])
    tensor.parameters["x"].int64_param = 1
    request.raw_input_contents.append(b"\0" * tensor_bytes)
    for _ in range(outputs):
        request.outputs.add()
    return request


def test_a_request_is_counted_to_its_sub_messages_before_it_is_parsed():
    check_fields(_infer_request(tensor_bytes=8 << 20).SerializeToString(), pb.ModelInferRequest.DESCRIPTOR)
    check_fields(_infer_request(outputs=MAX_FIELDS - 16).SerializeToString(), pb.ModelInferRequest.DESCRIPTOR)
    many = _infer_request(outputs=MAX_FIELDS).SerializeToString()  # two bytes each on the wire
    with pytest.raises(TooManyFields, match=f"ModelInferRequest of at most {MAX_FIELDS} fields"):
        check_fields(many, pb.ModelInferRequest.DESCRIPTOR)
    nested = pb.ModelInferRequest(model_name=MODEL)  # inside an input, in its parameters map
    for index in range(MAX_FIELDS // 2):
        nested.inputs.add(name="X").parameters[str(index)].bool_param = True
    with pytest.raises(TooManyFields):
        check_fields(nested.SerializeToString(), pb.ModelInferRequest.DESCRIPTOR)
    with pytest.raises(BadMessage, match="over the bound of a ModelInferRequest of at most"):
        parse_request(many, pb.ModelInferRequest)


def test_bytes_that_are_not_the_message_are_named_and_unknown_fields_dropped():
    for garbage in (b"\xff\xff\xff", b"\x0a\x05ab", b"\x0a\x80"):
        check_fields(garbage, pb.ModelInferRequest.DESCRIPTOR)  # the count leaves malformed bytes to the parser
        with pytest.raises(BadMessage, match="the request is not a ModelInferRequest"):
            parse_request(garbage, pb.ModelInferRequest)
    known = _infer_request().SerializeToString()
    parsed = parse_request(known + b"\xa8\x1f\x01", pb.ModelInferRequest)  # field 501, a varint
    assert parsed.SerializeToString() == known


def test_an_admitted_inference_holds_its_bytes_and_its_clients_turn():
    budget, clients = ByteBudget(1000, 600), ClientLoad(2)
    relay = Relay("unix:/nowhere", None, clients=clients, budget=budget)
    request = _infer_request()
    assert relay.admit(request, "10.0.0.1", 500) is None
    assert request.parameters["priority"].uint64_param == 1
    assert request.parameters["neopp_client"].string_param == clients.lane("10.0.0.1")
    assert "share" in relay.admit(_infer_request(), "10.0.0.1", 200)  # over the client's bytes
    assert "does not fit now" in relay.admit(_infer_request(), "10.0.0.2", 501)  # over all bytes
    assert relay.admit(_infer_request(), "10.0.0.1", 100) is None
    assert relay.admit(_infer_request(), "10.0.0.1", 0).startswith("this client has 2 generation(s)")
    assert (budget.used, clients.held) == (600, {"10.0.0.1": 2})  # a refusal holds nothing
    relay.done("10.0.0.1", 2, 600)
    assert (budget.used, budget.held, clients.held) == (0, {}, {})


def test_a_group_cannot_hide_fields_from_the_count():
    """A parser keeps an unknown group; the count stopped at one, so what followed went uncounted."""
    group = bytes([0x9B, 0x06, 0x9C, 0x06])  # field 99: a group's start and end
    hidden = group + b"\x0a\x01m" + b"\x32\x00" * (MAX_FIELDS + 1)
    with pytest.raises(BadMessage, match="the request is not a ModelInferRequest"):
        parse_request(hidden, pb.ModelInferRequest)
    assert parse_request(group, pb.ModelInferRequest) == pb.ModelInferRequest()  # too short to hide much: dropped


def test_packed_integers_have_a_bound_of_their_own():
    """A byte on the wire each, eight once parsed: counted apart from the fields."""
    wide = pb.ModelInferRequest(model_name=MODEL)
    wide.inputs.add(name="X", datatype="INT64", shape=[1] * (MAX_PACKED + 1))
    with pytest.raises(BadMessage, match=f"at most {MAX_FIELDS} fields and {MAX_PACKED} packed integers"):
        parse_request(wide.SerializeToString(), pb.ModelInferRequest)
    fits = pb.ModelInferRequest(model_name=MODEL)
    tensor = fits.inputs.add(name="X", datatype="INT64", shape=[MAX_PACKED])
    tensor.contents.int64_contents.extend([1] * (MAX_PACKED // 2))
    fits.inputs.add(name="Y", datatype="FP32").contents.fp32_contents.extend([1.0] * (2 * MAX_PACKED))  # no growth
    assert parse_request(fits.SerializeToString(), pb.ModelInferRequest) == fits


def test_an_id_or_model_name_every_answer_would_echo_is_bounded():
    assert inference_problem(pb.ModelInferRequest(model_name=MODEL, id="r" * MAX_NAME_BYTES)) is None
    assert inference_problem(pb.ModelInferRequest(model_name=MODEL, id="r" * (MAX_NAME_BYTES + 1))) == \
        f"id: at most {MAX_NAME_BYTES} bytes, got {MAX_NAME_BYTES + 1}"
    assert inference_problem(pb.ModelInferRequest(model_name="é" * MAX_NAME_BYTES)).startswith("model_name: at most")
    long_id = pb.ModelInferRequest(model_name=MODEL, id="r" * (MAX_NAME_BYTES + 1))
    answer = pb.ModelStreamInferResponse.FromString(stream_error(long_id, "id: too long", retry=False))
    assert (answer.error_message, answer.infer_response.id) == ("id: too long", "")  # refused, not echoed


def test_an_outputs_classification_is_refused_on_the_grpc_port_too():
    request = pb.ModelInferRequest(model_name=MODEL)
    request.outputs.add(name="IMAGE").parameters["classification"].int64_param = 1
    assert inference_problem(request) == ("output 'IMAGE': parameters.classification is not served: the outputs "
                                          "of this server are pictures, not scores")


def test_a_call_over_a_cap_replaces_the_call_idle_longest():
    async def scenario() -> None:
        calls = OpenCalls(total=3, per_client=2)
        waiting = [asyncio.ensure_future(asyncio.sleep(60)) for _ in range(3)]

        def enter(client: str, task: asyncio.Task) -> tuple[int, object] | str:
            entered = calls.enter(client)
            if not isinstance(entered, str):
                entered[1].task = task
            return entered

        first = enter("a", waiting[0])
        second = enter("a", waiting[1])
        second[1].busy()  # its request came: not given up
        third = enter("a", waiting[2])  # a's cap: a's idle call goes
        assert not isinstance(third, str) and len(calls) == 2
        await asyncio.sleep(0)
        assert waiting[0].cancelled() and not waiting[1].cancelled()
        calls.leave(first[0])  # the given-up call's own ending counts nothing twice
        assert len(calls) == 2
        third[1].busy()
        assert calls.enter("a").startswith("this client has 2 gRPC calls open")  # none idle
        other = calls.enter("b")
        assert not isinstance(other, str) and len(calls) == 3
        other[1].busy()
        assert calls.enter("c").startswith("the server has 3 gRPC calls open")
        for key in (second[0], third[0], other[0]):
            calls.leave(key)
        assert len(calls) == 0 and not isinstance(calls.enter("c"), str)
        for task in waiting:
            task.cancel()

    asyncio.run(scenario())
