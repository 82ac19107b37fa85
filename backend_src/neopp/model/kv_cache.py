"""KV prefix layouts (online from LightLLM, replay on disk) and their validation."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import InputError

ONLINE, REPLAY = "online", "replay"
LAYOUT_METADATA_KEY = "layout"


def online_to_replay(kv: torch.Tensor) -> torch.Tensor:
    """[NL, 2, S, NKV, HD] -> [NL, 2, NKV, S, HD] (what `torch.save(kv.transpose(2, 3))` wrote)."""
    return kv.transpose(2, 3)


def replay_to_online(kv: torch.Tensor) -> torch.Tensor:
    return kv.transpose(2, 3)


def load_kv_file(path: str | Path, layout: str | None = None) -> torch.Tensor:
    """A KV file as an online-layout tensor.

    `.pt` files are replay layout and read with `weights_only=True` (never arbitrary pickles).
    Safetensors files are replay layout unless their metadata says `layout=online` (or the
    caller says so); the tensor is the file's only tensor, or the one named `kv`.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"KV file {path}: does not exist")
    if path.suffix == ".safetensors":
        with safe_open(str(path), framework="pt") as handle:
            keys = list(handle.keys())
            name = "kv" if "kv" in keys else (keys[0] if len(keys) == 1 else None)
            if name is None:
                raise InputError(f"KV file {path}: expected one tensor or a tensor named 'kv', found {keys}")
            tensor = handle.get_tensor(name)
            file_layout = (handle.metadata() or {}).get(LAYOUT_METADATA_KEY, REPLAY)
    else:
        tensor = torch.load(str(path), map_location="cpu", weights_only=True)
        if not isinstance(tensor, torch.Tensor):
            raise InputError(f"KV file {path}: expected a single tensor, found {type(tensor).__name__}")
        file_layout = REPLAY
    layout = layout or file_layout
    if layout not in (ONLINE, REPLAY):
        raise InputError(f"KV file {path}: unknown layout {layout!r}; expected 'online' or 'replay'")
    if tensor.dim() != 5:
        raise InputError(f"KV file {path}: expected a 5-D tensor, got shape {tuple(tensor.shape)}")
    return replay_to_online(tensor) if layout == REPLAY else tensor


def save_kv_file(kv_online: torch.Tensor, path: str | Path, layout: str = REPLAY) -> Path:
    """Write an online tensor as `.pt` (replay) or `.safetensors` (either layout, tagged)."""
    from safetensors.torch import save_file

    path = Path(path)
    data = online_to_replay(kv_online) if layout == REPLAY else kv_online
    if path.suffix == ".safetensors":
        save_file({"kv": data.contiguous().cpu()}, str(path), metadata={LAYOUT_METADATA_KEY: layout})
    elif layout == REPLAY:
        torch.save(data.contiguous().cpu(), str(path))
    else:
        raise InputError(f"KV file {path}: online layout is only written as .safetensors")
    return path


def validate_kv(kv: torch.Tensor, dims: tuple[int, int, int], name: str,
                max_tokens: int | None = None) -> None:
    """Check an online-layout prefix against the checkpoint; the message names `name` and the rule."""
    layers, kv_heads, head_dim = dims
    if not isinstance(kv, torch.Tensor):
        raise InputError(f"{name}: expected a tensor, got {type(kv).__name__}")
    if kv.dim() != 5:
        raise InputError(f"{name}: must be 5-D [layers, 2, seq, kv_heads, head_dim], got shape {tuple(kv.shape)}")
    if not kv.is_floating_point():
        raise InputError(f"{name}: must be a floating-point tensor, got {kv.dtype}")
    nl, two, seq, nkv, hd = kv.shape
    expected = {"layers": (nl, layers), "dim 1 (K/V)": (two, 2), "kv_heads": (nkv, kv_heads),
                "head_dim": (hd, head_dim)}
    for what, (got, want) in expected.items():
        if got != want:
            raise InputError(f"{name}: {what} must be {want} for this checkpoint, got {got} "
                             f"(shape {tuple(kv.shape)}, layout [layers, 2, seq, kv_heads, head_dim])")
    if seq < 1:
        raise InputError(f"{name}: the prefix must hold at least one token (seq >= 1), got {seq}")
    if max_tokens is not None and seq > max_tokens:
        raise InputError(f"{name}: prefix of {seq} tokens exceeds the limit of {max_tokens}")
    if not bool(torch.isfinite(kv).all()):
        raise InputError(f"{name}: contains NaN or Inf values")
