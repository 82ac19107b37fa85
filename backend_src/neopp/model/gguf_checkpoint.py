"""A checkpoint whose weights are one GGUF file, beside its ``config.json`` and tokenizer.

The file's tensors carry the checkpoint's own state-dict names. Float tensors (F32, F16, BF16)
are read as they are. Block-quantized ones (``gguf_blocks``) stay as their bytes, a quarter to
a half of bf16: a decoder-layer linear dequantizes its weight each time it runs (``GGUFLinear``),
and any other quantized weight is dequantized once, at load. The file is read with the ``gguf``
package; a tensor of a type this server does not read, a quantized tensor that is not 2-D or
whose rows are not whole blocks, and a file cut short are refused at load, naming the tensor.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError
from .gguf_blocks import BLOCK_TYPES, dequantize, stored_bytes
from .layers import Linear, adapters_active, add_adapter_rows, linear_rows

FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
READ_TYPES = (*BLOCK_TYPES, *FLOATS)


class GGUFWeight:
    """A block-quantized 2-D weight held as its bytes; ``to`` gives it in floats."""

    def __init__(self, raw: torch.Tensor, kind: str, shape: tuple[int, int]) -> None:
        self.raw, self.kind, self.shape = raw, kind, torch.Size(shape)

    @property
    def device(self) -> torch.device:
        return self.raw.device

    @property
    def is_cuda(self) -> bool:
        return self.raw.is_cuda

    def numel(self) -> int:
        return self.shape.numel()

    def dim(self) -> int:
        return len(self.shape)

    def dequantize(self) -> torch.Tensor:
        """The weight in float32, on the device its bytes are on."""
        return dequantize(self.raw, self.kind, tuple(self.shape))

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight in floats (float32 unless ``dtype``), as a tensor's ``to`` would give it."""
        return self.dequantize().to(device=device, dtype=dtype or torch.float32)

    def moved(self, device: torch.device) -> GGUFWeight:
        return GGUFWeight(self.raw.to(device), self.kind, tuple(self.shape))


class GGUFLinear(Linear):
    """A decoder-layer linear whose weight stays in GGUF blocks; each call dequantizes it to the
    input's dtype, then runs as a full-precision ``Linear`` would, so its rows are the bytes of
    one holding the dequantized weight."""

    def __init__(self, weight: GGUFWeight, device: torch.device) -> None:
        super().__init__(weight.moved(device))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = linear_rows(x, self.weight.dequantize().to(x.dtype), None)
        return add_adapter_rows(self, x, y) if adapters_active() else y

    def nbytes(self) -> int:
        return self.weight.raw.numel()


def _reader(path: Path):  # noqa: ANN202 - the gguf package's reader
    try:
        import gguf
    except ImportError:
        raise ConfigError(f"checkpoint {path.name}: reading a GGUF file needs the gguf package "
                          "(pip install gguf)") from None
    if not path.is_file():
        raise ConfigError(f"checkpoint {path}: no such GGUF file")
    try:
        return gguf.GGUFReader(path, "r")
    except (ValueError, OSError, IndexError, KeyError) as exc:
        raise ConfigError(f"checkpoint {path.name}: not a readable GGUF file ({exc})") from None


def _kind_and_shape(path: Path, tensor) -> tuple[str, tuple[int, ...]]:  # noqa: ANN001
    kind = tensor.tensor_type.name
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists the fastest dimension first
    if kind not in READ_TYPES:
        raise ConfigError(f"checkpoint {path.name}: tensor '{tensor.name}' is stored as {kind}; this server reads "
                          f"{', '.join(READ_TYPES)}")
    if kind in BLOCK_TYPES and (len(shape) != 2 or shape[1] % BLOCK_TYPES[kind].size):
        raise ConfigError(f"checkpoint {path.name}: tensor '{tensor.name}' is {kind} with shape {list(shape)}; "
                          f"only 2-D weights whose rows are whole blocks of {BLOCK_TYPES[kind].size} are read")
    return kind, shape


def gguf_shapes(path: str | Path, wanted) -> dict[str, tuple[int, ...]]:  # noqa: ANN001 - a KeyFilter
    """The shape of every ``wanted`` tensor, from the file's header alone."""
    path = Path(path)
    return {t.name: _kind_and_shape(path, t)[1] for t in _reader(path).tensors if wanted(t.name)}


def read_gguf_tensors(path: str | Path, wanted) -> dict[str, torch.Tensor | GGUFWeight]:  # noqa: ANN001
    """The ``wanted`` tensors: floats as tensors, block-quantized weights as ``GGUFWeight``."""
    path = Path(path)
    out: dict[str, torch.Tensor | GGUFWeight] = {}
    for tensor in _reader(path).tensors:
        if not wanted(tensor.name):
            continue
        kind, shape = _kind_and_shape(path, tensor)
        data = np.asarray(tensor.data)
        need = stored_bytes(kind, shape) if kind in BLOCK_TYPES else \
            int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=FLOATS[kind]).element_size()
        if data.nbytes != need:
            raise ConfigError(f"checkpoint {path.name}: tensor '{tensor.name}' holds {data.nbytes} bytes, its type "
                              f"{kind} and shape {list(shape)} need {need} (a file cut short?)")
        raw = torch.from_numpy(data.view(np.uint8).copy()).reshape(-1)
        if kind in BLOCK_TYPES:
            out[tensor.name] = GGUFWeight(raw.reshape(shape[0], -1), kind, shape)
        else:
            out[tensor.name] = raw.view(FLOATS[kind]).reshape(shape)
    return out
