"""Streamed text-to-image over gRPC: a progress bar while the server denoises, optional JPEG
previews (--preview-every, --preview-dir), then the image file. Ctrl-C cancels the request on
the server (it stops between two steps). A refused request is one line on stderr and exit code 1."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable

import numpy as np
import tritonclient.grpc as grpcclient
from stream_common import save_preview, show_progress, stream_parser
from t2i_common import GRPC_URL, api_headers, request_inputs, run_client, save_result
from tritonclient.utils import InferenceServerException


def stream_inputs(args) -> list[grpcclient.InferInput]:
    """The t2i request plus PREVIEW_EVERY and, if given, PREVIEW_SIZE."""
    inputs = request_inputs(args) + [("PREVIEW_EVERY", np.array([args.preview_every], np.int64), "INT64")]
    if args.preview_size:
        inputs.append(("PREVIEW_SIZE", np.array(args.preview_size, np.int64), "INT64"))
    tensors = []
    for name, array, datatype in inputs:
        tensors.append(grpcclient.InferInput(name, list(array.shape), datatype))
        tensors[-1].set_data_from_numpy(array)
    return tensors


def stream_to_image(client: grpcclient.InferenceServerClient, model: str, inputs: list[grpcclient.InferInput],
                    timeout_s: float, on_preview: Callable[[int, bytes], None] | None = None) -> grpcclient.InferResult:
    """Stream one request with a progress bar; the last response (it carries IMAGE). Ctrl-C
    cancels the request on the server."""
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)), headers=api_headers())
    try:
        client.async_stream_infer(model, inputs)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                result, error = answers.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise InferenceServerException(f"no answer within --timeout {timeout_s:g}s") from None
            if error is not None:
                raise error
            step, total = int(result.as_numpy("STEP")[0]), int(result.as_numpy("TOTAL_STEPS")[0])
            show_progress(step, total)
            if result.as_numpy("IMAGE") is not None:  # the last step's response carries the image
                return result
            preview = result.as_numpy("PREVIEW")
            if preview is not None and on_preview is not None:
                on_preview(step, preview[0])
    except KeyboardInterrupt:
        client.stop_stream(cancel_requests=True)
        raise InferenceServerException("cancelled by the user") from None
    finally:
        client.stop_stream()


def main() -> None:
    args = stream_parser(__doc__, GRPC_URL, "stream_grpc.py").parse_args()
    client = grpcclient.InferenceServerClient(args.url)
    try:
        result = stream_to_image(client, args.model, stream_inputs(args), args.timeout,
                                 lambda step, jpeg: save_preview(args, step, jpeg))
        save_result(args, result)
    finally:
        client.close()


if __name__ == "__main__":
    raise SystemExit(run_client(main))
