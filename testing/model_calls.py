"""One gRPC call of a model with numpy inputs: what the prompt-to-image tests send and read."""

from __future__ import annotations

import numpy as np
import tritonclient.grpc as grpcclient

DATATYPES = {np.dtype(np.int64): "INT64", np.dtype(np.float32): "FP32", np.dtype(np.object_): "BYTES",
             np.dtype(np.bool_): "BOOL"}


def text(value: str | bytes) -> np.ndarray:
    """A STRING [1] input."""
    return np.array([value.encode() if isinstance(value, str) else value], dtype=np.object_)


class ModelCalls:
    """A gRPC client whose ``infer`` takes inputs as arrays (or ``(array, datatype)`` for BF16)."""

    def __init__(self, url: str) -> None:
        self.grpc = grpcclient.InferenceServerClient(url)

    def infer(self, model: str, outputs: tuple[str, ...] = ("IMAGE",), **inputs: np.ndarray | tuple) -> dict:
        tensors = []
        for name, value in inputs.items():
            arr, dtype = value if isinstance(value, tuple) else (value, DATATYPES[value.dtype])
            tensor = grpcclient.InferInput(name, list(arr.shape), dtype)
            tensor.set_data_from_numpy(arr)
            tensors.append(tensor)
        result = self.grpc.infer(model, tensors, outputs=[grpcclient.InferRequestedOutput(n) for n in outputs],
                                 client_timeout=120)
        return {name: result.as_numpy(name) for name in outputs}

    def close(self) -> None:
        self.grpc.close()
