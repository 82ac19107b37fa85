"""How the LightLLM client moves BF16 KV prefixes to the server without needless copies.

Two transports, both sending exactly the bytes of the bfloat16 prefix: a POSIX shared-memory
segment registered with the server (client and server on one host), and a gRPC ModelInfer
request with the KV bytes appended to the serialized message (over the network). Kept apart
from ``lightllm_client.py``, which holds LightLLM's calls.
"""

from __future__ import annotations

import time
import uuid
from multiprocessing import shared_memory
from typing import Any

import grpc
import numpy as np
import torch
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2
from tritonclient.grpc._utils import _get_inference_request
from tritonclient.utils import InferenceServerException

GRPC_KEY_HEADER = "triton-grpc-protocol-neopp-admin-key"  # the header neopp-admin-key, as Triton's gRPC wants it


def key_headers(admin_key: str | None) -> dict[str, str] | None:
    return {GRPC_KEY_HEADER: admin_key} if admin_key else None


def refused_for_key(exc: InferenceServerException) -> bool:
    """Triton's answer to a restricted call without (or with a wrong) key."""
    return "restricted" in (exc.message() or "")


def as_bf16(kv: Any) -> torch.Tensor:
    """Online-layout KV as contiguous bfloat16 on the CPU (rounded once, here, for both transports)."""
    t = kv if isinstance(kv, torch.Tensor) else torch.from_numpy(np.asarray(kv))
    return t.detach().to("cpu", torch.bfloat16).contiguous()


class KVSharedMemory:
    """One POSIX shared-memory segment holding the request's prefixes, registered with the server.

    The segment is 0600, and the server knows it by a name of its own: 128 random bits that appear
    neither in /dev/shm nor anywhere else another client could read, so no other request can name
    the region and read or overwrite these prefixes through the server.
    """

    def __init__(self, client: grpcclient.InferenceServerClient, tensors: list[torch.Tensor],
                 admin_key: str | None = None) -> None:
        """Create, register (with the operator key: the server restricts registration) and fill."""
        self.client, self.headers = client, key_headers(admin_key)
        self.name = f"neopp_kv_{uuid.uuid4().hex[:16]}"  # the file in /dev/shm, which anyone may list
        self.region = uuid.uuid4().hex  # what requests name: never shown
        self.segment = shared_memory.SharedMemory(name=self.name, create=True, size=max(self._layout(tensors), 64))
        try:
            client.register_system_shared_memory(self.region, "/" + self.name, self.segment.size,
                                                 headers=self.headers)
        except BaseException:
            self.segment.close()
            self.segment.unlink()
            raise
        self.write(tensors)

    @staticmethod
    def _spans(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
        spans, offset = [], 0
        for t in tensors:
            size = t.numel() * 2
            spans.append((offset, size))
            offset += (size + 63) // 64 * 64
        return spans

    def _layout(self, tensors: list[torch.Tensor]) -> int:
        start, size = self._spans(tensors)[-1]
        return start + size

    def fits(self, tensors: list[torch.Tensor]) -> bool:
        return self._layout(tensors) <= self.segment.size

    def write(self, tensors: list[torch.Tensor]) -> None:
        """Copy the bf16 bits in place; the registration stays (a new turn costs one copy)."""
        self.spans = self._spans(tensors)
        view = np.frombuffer(self.segment.buf, dtype=np.int16)
        for (start, size), t in zip(self.spans, tensors):
            view[start // 2:(start + size) // 2] = t.view(torch.int16).numpy().reshape(-1)
        del view  # the segment cannot close while a numpy view holds its buffer

    def attach(self, infer_input: grpcclient.InferInput, index: int) -> None:
        start, size = self.spans[index]
        infer_input.set_shared_memory(self.region, size, offset=start)

    def close(self, wait_s: float = 10.0) -> None:
        """Unregister (the server may still hold the region for a moment after a response), then unlink."""
        from tritonclient.utils import InferenceServerException

        deadline = time.monotonic() + wait_s
        try:
            while True:
                try:
                    self.client.unregister_system_shared_memory(self.region, headers=self.headers)
                    break
                except InferenceServerException as exc:
                    if "in use" not in str(exc) or time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        finally:
            self.segment.close()
            self.segment.unlink()


class SplicedInfer:
    """ModelInfer with the KV bytes appended to the serialized request.

    tritonclient copies a 44 MB prefix three times per request (``tobytes``, into the protobuf
    message, serialization), which costs more than the server's whole ingest. Here the request
    is serialized without the KV (the KV inputs last, with no content) and the KV bytes follow
    as ``raw_input_contents`` entries: repeated fields may be appended to a serialized message,
    and Triton pairs raw contents with inputs in order, so the server reads exactly the request
    tritonclient would have built. The KV is copied once, by ``bytes.join``.
    """

    FIELD = service_pb2.ModelInferRequest.DESCRIPTOR.fields_by_name["raw_input_contents"].number

    def __init__(self, url: str) -> None:
        options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
        self.channel = grpc.insecure_channel(url, options=options)
        self.call = self.channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                             request_serializer=None,  # the request is bytes already
                                             response_deserializer=service_pb2.ModelInferResponse.FromString)

    def infer(self, model: str, inputs: list[grpcclient.InferInput], kv: list[torch.Tensor], sequence_id: int,
              sequence_start: bool, timeout_s: float, headers: dict[str, str] | None = None) -> grpcclient.InferResult:
        kv_inputs, others = inputs[:len(kv)], inputs[len(kv):]
        request = _get_inference_request(model, others + kv_inputs, "", "", None, sequence_id, sequence_start,
                                         False, 0, None, None)
        parts = [request.SerializeToString()]
        for t in kv:
            raw = memoryview(t.view(torch.int16).numpy()).cast("B")
            parts += [_varint(self.FIELD << 3 | 2) + _varint(raw.nbytes), raw]
        try:
            return grpcclient.InferResult(self.call(b"".join(parts), timeout=timeout_s,
                                                    metadata=list((headers or {}).items())))
        except grpc.RpcError as exc:
            raise InferenceServerException(msg=exc.details(), status=str(exc.code())) from None

    def close(self) -> None:
        self.channel.close()


def _varint(value: int) -> bytes:
    """Protobuf's base-128 varint (field tags and lengths of the appended entries)."""
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def set_bf16(tensor: grpcclient.InferInput, kv: torch.Tensor, raw: bool) -> None:
    """Put bf16 data in a request through tritonclient (the path SplicedInfer replaces).

    tritonclient 2.51 serializes BF16 one element at a time in Python (seconds for a 44 MB
    prefix); the raw path hands over the same bytes directly (``_raw_content``, the field
    ``set_data_from_numpy`` fills). Both send identical bytes: the values are bf16 already.
    """
    if raw and hasattr(tensor, "_raw_content"):
        tensor._raw_content = kv.view(torch.int16).numpy().tobytes()
    else:
        tensor.set_data_from_numpy(kv.float().numpy())
