"""The gRPC front's rules without a server: which of Triton's errors a client is told to retry,
what it refuses before Triton, and that it relays every method of the service."""

from __future__ import annotations

import time

import grpc
import pytest
from tritonclient.grpc import service_pb2 as pb

from neopp.launcher.door.grpc_front import Relay, _ends_a_request, _stream_error, peer_host
from neopp.launcher.health import ServerHealth

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
    assert relay._status(gone, MODEL, _now()) == grpc.StatusCode.UNAVAILABLE
    assert relay._status(_error(grpc.StatusCode.INTERNAL, "internal error: a bug"), MODEL, _now()) \
        == grpc.StatusCode.INTERNAL
    planted = _error(grpc.StatusCode.INVALID_ARGUMENT, f"unexpected inference input 'Stub process '{MODEL}_0_0' "
                                                       "is not healthy.'")
    assert relay._status(planted, MODEL, _now()) == grpc.StatusCode.INVALID_ARGUMENT
    for code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE):
        assert relay._status(_error(code, "x"), MODEL, _now()) == code


def test_an_internal_error_while_the_launcher_knew_of_a_recovery_is_unavailable(health):
    relay = Relay("unix:/nowhere", health)
    sent = _now() - 10.0  # before the server came up: it was recovering while the request ran
    assert relay._status(_error(grpc.StatusCode.INTERNAL, "x"), "another_model", sent) == grpc.StatusCode.UNAVAILABLE
    bug = _error(grpc.StatusCode.INTERNAL, "internal error: the pipe broke")
    assert relay._status(bug, MODEL, _now()) == grpc.StatusCode.INTERNAL
    health.model_broken(MODEL, "no live stub")
    assert relay._status(bug, MODEL, _now()) == grpc.StatusCode.UNAVAILABLE
    assert relay._status(bug, "another_model", _now()) == grpc.StatusCode.UNAVAILABLE  # the replica is unready
    health.model_serving(MODEL)
    assert relay._status(bug, MODEL, _now()) == grpc.StatusCode.INTERNAL
    assert Relay("unix:/nowhere", None)._status(bug, MODEL, _now()) == grpc.StatusCode.INTERNAL


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
    answer = pb.ModelStreamInferResponse.FromString(_stream_error(request, "not serving now"))
    assert answer.error_message == "not serving now"
    assert (answer.infer_response.id, answer.infer_response.model_name) == ("r-7", MODEL)


def test_every_method_of_the_service_is_relayed():
    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    handler = Relay("unix:/nowhere", None).handler()
    for method in service.methods:
        details = _CallDetails(f"/inference.GRPCInferenceService/{method.name}")
        relayed = handler.service(details)
        assert relayed is not None, method.name
        assert relayed.request_streaming == method.client_streaming, method.name
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
    assert not _ends_a_request(preview.SerializeToString())
    assert _ends_a_request(last.SerializeToString())
    assert _ends_a_request(pb.ModelStreamInferResponse(error_message="x").SerializeToString())
    assert _ends_a_request(pb.ModelStreamInferResponse().SerializeToString())  # a model that sends one answer


def test_a_client_is_its_address_as_the_http_door_names_it():
    assert peer_host("ipv4:127.0.0.1:5000") == "127.0.0.1"
    assert peer_host("ipv6:[::1]:5000") == "::1"
    assert peer_host("ipv6:%5B::1%5D:41066") == "::1"  # how grpcio writes it: one client, whatever its port
