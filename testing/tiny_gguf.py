"""Tiny checkpoints as GGUF files, and the float checkpoint each one stands for.

``write_gguf`` turns a safetensors checkpoint into ``model-<type>.gguf`` beside a copy of its
``config.json`` and tokenizer: every decoder-layer linear of the generation tower in the block
type, every decoder-layer linear of the understanding tower too, the rest in float32 (norms in
float16, so that float type is read too). Q8_0 and Q4_0 are quantized
from the weights by the ``gguf`` package; it has no quantizer for the K types, so their blocks
are random bytes with small finite scales: any valid block must read right.

``dequantized_reference`` reads the file back with the ``gguf`` package's own reader and
dequantizer, not this project's, and writes the floats as a safetensors checkpoint: the image
from the GGUF file must be the image from that checkpoint.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import quants
from safetensors.torch import load_file, save_file

from neopp.model.checkpoint import LM

BLOCK_TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K")
WIDE = {"llm_config": {"hidden_size": 256, "num_attention_heads": 8}}  # every linear's rows whole 256-blocks
QUANTIZABLE = ("Q8_0", "Q4_0")
SCALE_AT = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # float16 scale bytes of a K block
SCALE_RANGE = {"Q4_K": 2e-3, "Q5_K": 1e-3, "Q6_K": 2e-4}  # weights of order 0.1


def random_blocks(kind: str, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    size, nbytes = quants.GGML_QUANT_SIZES[qtype]
    count = shape[0] * shape[1] // size
    blocks = rng.integers(0, 256, size=(count, nbytes), dtype=np.uint8)
    for at in SCALE_AT[kind]:
        scales = rng.uniform(-SCALE_RANGE[kind], SCALE_RANGE[kind], count).astype(np.float16)
        blocks[:, at:at + 2] = scales.view(np.uint8).reshape(count, 2)
    return blocks.reshape(shape[0], -1)


def _copy_beside(source: Path, out: Path) -> None:
    """``config.json`` and the tokenizer files, which a GGUF checkpoint keeps beside its file."""
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (source / name).is_file():
            shutil.copy(source / name, out / name)


def _is_quantized(key: str, tensor: torch.Tensor) -> bool:
    """The decoder-layer linears of both towers (the understanding tower's included)."""
    return tensor.dim() == 2 and key.startswith(LM + "layers.") and key.endswith(("_proj.weight",
                                                                                 "_proj_mot_gen.weight"))


def write_gguf(checkpoint: Path, out: Path, kind: str, seed: int = 0) -> Path:
    """``out/model-<kind>.gguf`` (with ``config.json``) from the tiny checkpoint folder."""
    out.mkdir(parents=True, exist_ok=True)
    _copy_beside(checkpoint, out)
    tensors = {k: v for f in sorted(checkpoint.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    rng = np.random.default_rng(seed)
    path = out / f"model-{kind}.gguf"
    writer = gguf.GGUFWriter(str(path), arch="neopp")
    for key, tensor in sorted(tensors.items()):
        array = tensor.float().numpy()
        if _is_quantized(key, tensor):
            qtype = getattr(gguf.GGMLQuantizationType, kind)
            raw = quants.quantize(array, qtype) if kind in QUANTIZABLE else \
                random_blocks(kind, tuple(array.shape), rng)
            writer.add_tensor(key, raw, raw_shape=raw.shape, raw_dtype=qtype)
        elif "norm" in key and tensor.dim() == 1:
            writer.add_tensor(key, array.astype(np.float16))
        else:
            writer.add_tensor(key, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def dequantized_reference(gguf_file: Path, out: Path) -> Path:
    """A safetensors checkpoint of what the GGUF file's tensors read as, by the ``gguf`` package."""
    out.mkdir(parents=True, exist_ok=True)
    _copy_beside(gguf_file.parent, out)
    floats = {}
    for tensor in gguf.GGUFReader(gguf_file).tensors:
        values = quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        floats[tensor.name] = torch.from_numpy(np.array(values, dtype=np.float32))
    save_file(floats, str(out / "model.safetensors"))
    return out
