"""The one random draw of a generation, as a stream that can be exported and resumed."""

from __future__ import annotations

import numpy as np
import torch

from ..errors import InputError

STATE_NBYTES = torch.Generator().get_state().numel()


class NoiseStream:
    """A CPU generator: the same seed means the same noise on every device and in every mode."""

    def __init__(self, seed: int | None = None) -> None:
        self._gen = torch.Generator(device="cpu")
        if seed is None:
            self._gen.seed()
        else:
            self.reseed(seed)

    def reseed(self, seed: int) -> None:
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
            raise InputError(f"SEED: must be an integer, got {seed!r}")
        if not -(2**63) <= int(seed) < 2**64:
            raise InputError(f"SEED: {seed} is out of the 64-bit range")
        self._gen.manual_seed(int(seed) % 2**64)

    @classmethod
    def from_state(cls, state: bytes | np.ndarray | torch.Tensor) -> NoiseStream:
        raw = _state_tensor(state)
        stream = cls(seed=0)
        try:
            stream._gen.set_state(raw)
        except RuntimeError as exc:
            raise InputError(f"RNG_STATE: not a valid generator state ({exc})") from exc
        return stream

    def draw(self, height: int, width: int) -> torch.Tensor:
        """Unscaled standard-normal noise [1, 3, H, W] in float32, advancing the stream."""
        return torch.randn(1, 3, height, width, generator=self._gen, dtype=torch.float32)

    def state(self) -> bytes:
        return bytes(self._gen.get_state().numpy().tobytes())


def _state_tensor(state: bytes | np.ndarray | torch.Tensor) -> torch.Tensor:
    if isinstance(state, torch.Tensor):
        arr = state.detach().cpu().numpy()
    elif isinstance(state, (bytes, bytearray, memoryview)):
        arr = np.frombuffer(bytes(state), dtype=np.uint8)
    else:
        arr = np.asarray(state)
    if arr.dtype != np.uint8:
        raise InputError(f"RNG_STATE: must be UINT8 bytes, got dtype {arr.dtype}")
    arr = arr.reshape(-1)
    if arr.size != STATE_NBYTES:
        raise InputError(f"RNG_STATE: must be exactly {STATE_NBYTES} bytes (a NEXT_RNG_STATE output), got {arr.size}")
    return torch.from_numpy(arr.copy())
