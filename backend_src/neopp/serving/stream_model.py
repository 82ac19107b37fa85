"""What a streaming (decoupled) NeoPP model's ``model.py`` does: progress, previews, final image.

A streamed twin loads no weights: its requests run on its plain twin's engine (its config's
``engine_model``), which parses each one (with the streaming inputs: previews, base64 KV) and
answers every step. ``execute`` hands each request over and returns; the engine's messages
become responses on the request's sender from a delivery thread, which also encodes the JPEG
previews: one per step (``STEP``/``TOTAL_STEPS``, sometimes ``PREVIEW``), the last one carrying
``IMAGE`` and ``NEXT_RNG_STATE`` with the final flag. A refused, failed or cancelled request gets
one error response with the final flag instead.
"""

from __future__ import annotations

import base64
import time
from typing import Any

import numpy as np

from ..contract.inputs import STREAM_INPUT_SPECS, STREAM_OUTPUT_SPECS
from ..image_io import encode_image
from .stream_delivery import Delivery
from .triton_model import Call, NeoPPTritonModel

PREVIEW_QUALITY = 85


class NeoPPStreamModel(NeoPPTritonModel):
    """Decoupled Triton Python-backend model streaming one NeoPP mode."""

    INPUTS = STREAM_INPUT_SPECS
    OUTPUTS = STREAM_OUTPUT_SPECS
    KIND = "stream"

    @classmethod
    def auto_complete_config(cls, auto_complete_model_config: Any) -> Any:
        auto_complete_model_config.set_model_transaction_policy({"decoupled": True})
        return super().auto_complete_config(auto_complete_model_config)

    def initialize(self, args: dict[str, str]) -> None:
        super().initialize(args)
        self.delivery = Delivery(self._deliver)

    def finalize(self) -> None:
        super().finalize()
        self.delivery.close()  # after the link: its last errors are answered too

    def execute(self, requests: list[Any]) -> None:
        """Hand each request over and return at once; its responses follow from the delivery thread."""
        for request in requests:
            call = Call(request.get_response_sender(), time.perf_counter())
            self._submit(request, call, lambda item: self.delivery.put(item[2], item), final_only=False)
        return None

    def _deliver(self, call: Call, item: tuple[dict[str, Any], list[bytes], Call]) -> None:
        header, blobs, _ = item
        response, header = self._answer_of(header, blobs, call)
        if response is not None:
            self._send(call.sender, response, final=header.get("type") in ("final", "error"))

    def _progress(self, header: dict[str, Any], blobs: list[bytes], call: Call) -> Any:
        tensors = self._step_tensors(header)
        if header.get("preview"):
            pixels = np.frombuffer(blobs[0], dtype=np.uint8).reshape(header["preview"])
            jpeg = encode_image(pixels, "jpeg", tuple(call.options["preview_size"]), quality=PREVIEW_QUALITY,
                                record=call.options.get("record"))
            tensors.append(self.pb.Tensor("PREVIEW", self._bytes(call, jpeg)))
        return self.pb.InferenceResponse(output_tensors=tensors)

    def _final_tensors(self, header: dict[str, Any], call: Call, image: bytes, rng_state: np.ndarray) -> list[Any]:
        return [self.pb.Tensor("IMAGE", self._bytes(call, image)), self.pb.Tensor("NEXT_RNG_STATE", rng_state),
                *self._step_tensors(header)]

    def _step_tensors(self, header: dict[str, Any]) -> list[Any]:
        return [self.pb.Tensor("STEP", np.array([int(header["step"])], dtype=np.int64)),
                self.pb.Tensor("TOTAL_STEPS", np.array([int(header["total"])], dtype=np.int64))]

    @staticmethod
    def _bytes(call: Call, data: bytes) -> np.ndarray:
        """A BYTES [1] tensor: the encoded bytes, or their base64 text when the request asked."""
        return np.array([base64.b64encode(data) if call.options.get("base64_output") else data], dtype=np.object_)

    def _send(self, sender: Any, response: Any, final: bool) -> None:
        flags = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        try:
            sender.send(response, flags=flags)
        except Exception as exc:  # noqa: BLE001 - a stream the client closed; nothing left to tell it
            self.logger.log_warn(f"{self.model_name}: response not delivered: {exc}")
