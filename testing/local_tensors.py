"""Tensors shaped as the Python backend hands them to a model (``pb_utils.Tensor``'s three calls the
engine link makes), for driving the link and the engine's stub without a server."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.dlpack import to_dlpack

from neopp.request import GenerationRequest


class LocalTensor:
    """A named numpy array, or a bfloat16 torch tensor (numpy has no bfloat16: only DLPack reads it)."""

    def __init__(self, name: str, value: np.ndarray | torch.Tensor) -> None:
        self._name, self.value = name, value

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        if isinstance(self.value, torch.Tensor):
            raise TypeError("Tensor dtype is BF16 and cannot be converted to NumPy")
        return self.value

    def to_dlpack(self) -> Any:
        return to_dlpack(self.value)


def request_tensors(req: GenerationRequest, seed: int, output_format: bytes = b"png") -> list[LocalTensor]:
    """The contract inputs of ``req`` (its prefixes, offsets, size, steps) with ``SEED``."""
    values: dict[str, Any] = {"COND_KV": req.cond_kv.contiguous(),
                              "INDEX_OFFSET_COND": np.array([req.index_offset_cond]),
                              "SIZE": np.array([req.height, req.width]),
                              "STEPS": np.array([req.sampling_params.infer_steps]), "SEED": np.array([seed]),
                              "OUTPUT_FORMAT": np.array([output_format], dtype=np.object_)}
    if req.uncond_kv is not None:
        values.update(UNCOND_KV=req.uncond_kv.contiguous(), INDEX_OFFSET_UNCOND=np.array([req.index_offset_uncond]))
    return [LocalTensor(n, v) for n, v in values.items()]
