"""FP8 (e4m3) weights with one float32 scale per output channel (the `fp8-sgl` scheme).

Decoder-layer linears (attention projections, dense and expert MLPs; not the router, not
the embedders or the head) are held as float8_e4m3fn plus a float32 scale per output row,
about half the bytes of bf16. On GPUs with FP8 tensor cores (sm90+) a layer runs one
`torch._scaled_mm` with per-token activation scales; everywhere else it dequantises only
its own weight for the duration of the call, so no full-precision copy of all weights lives.
"""

from __future__ import annotations

import functools
import logging

import torch

from ..errors import ConfigError
from .checkpoint import FP8_DTYPE, LM
from .kernel_choices import check_activation_quant, kernel_choices
from .layers import Linear, adapters_active, add_adapter_rows, linear_rows
from .transformer import LinearFactory

log = logging.getLogger(__name__)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
KERNELS = ("auto", "scaled_mm", "dequant")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (per-token) FP8 quantisation of a float32 [rows, in] activation: the values as
    float8_e4m3fn and the scale of each row (its absmax / 448)."""
    scale = (x.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


class CompiledOrEager:
    """`quantize_rows` compiled once per process (any row count: dynamic shapes). Where compiling
    fails (a machine without a C compiler or Python's headers), it says so once and runs eagerly:
    the same bytes, only slower, instead of failing every FP8 request."""

    def __init__(self) -> None:
        self.run = torch.compile(quantize_rows, dynamic=True, fullgraph=True)
        self.compiled = True

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.compiled:
            try:
                return self.run(x)
            except Exception as exc:  # noqa: BLE001 - any compiler failure; the eager function is exact
                if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                    raise  # a CUDA graph capture reports it and runs this step eagerly
                log.warning("FP8 activation quantisation: torch.compile failed (%s: %s); running it eagerly",
                            type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
                self.compiled, self.run = False, quantize_rows
        return self.run(x)


@functools.cache
def compiled_quantize_rows() -> CompiledOrEager:
    return CompiledOrEager()


def activation_quantizer(device: torch.device, mode: str | None = None) -> object:
    """The activations' quantisation before each FP8 product (kernel_choices().fp8_activation_quant):
    "compiled" (torch.compile fuses the absmax, the scale and the cast into one kernel; the CUDA
    default), "eager" (separate kernels, the CPU default: nothing to fuse for there), or "auto".
    Both give the same bytes (tests)."""
    mode = check_activation_quant(mode or kernel_choices().fp8_activation_quant)
    compiled = mode == "compiled" or (mode == "auto" and device.type == "cuda")
    return compiled_quantize_rows() if compiled else quantize_rows


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """absmax / 448 per output row; returns (float8 weight, float32 scale [out])."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 `weight * scale[:, None]` (the value the FP8 weight stands for)."""
    return weight.to(torch.float32) * scale.to(device=weight.device, dtype=torch.float32).view(-1, 1)


def is_layer_linear(key: str) -> bool:
    """Decoder-layer projection weights: the ones the FP8 mode quantises (router excluded)."""
    return (key.startswith(LM + "layers.") and key.endswith("_proj_mot_gen.weight")) or (
        key.startswith(LM + "layers.") and ".mlp_mot_gen." in key and key.endswith("_proj.weight"))


def quantize_checkpoint_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A pre-quantised checkpoint: layer linears in FP8 plus `<name>.weight_scale`."""
    out = dict(tensors)
    for key, w in tensors.items():
        if is_layer_linear(key) and "mot_gen" in key:
            out[key], out[key + "_scale"] = quantize_fp8(w)
    return out


def quantize_layer_linears_(tensors: dict[str, torch.Tensor]) -> int:
    """In place: every layer linear without a scale becomes FP8 + `_scale`; returns how many.

    Done key by key so each full-precision original can be freed as soon as it is replaced:
    peak memory stays near the checkpoint's own size instead of original + quantised. The
    tensors left as they are get copied out of the checkpoint's memory map: safetensors backs
    them all with one mapping of the file, and while any of them lives, every page of the
    full-precision originals read here would stay resident.
    """
    done = 0
    linears = {k for k in tensors if is_layer_linear(k) and "mot_gen" in k}
    for key in linears:
        if key + "_scale" in tensors and tensors[key].dtype == FP8_DTYPE:
            continue
        full = tensors[key].float()
        if key + "_scale" in tensors:  # a scaled weight not stored as FP8: expand, then requantise
            full = full * tensors.pop(key + "_scale").float().view(-1, 1)
        tensors[key], tensors[key + "_scale"] = quantize_fp8(full)
        done += 1
    for key in [k for k in tensors if k not in linears and not k.endswith("_scale")]:
        tensors[key] = tensors[key].clone()
    return done


def scaled_mm_supported(device: torch.device) -> bool:
    """Row-wise scaled FP8 matmul needs CUDA compute capability 9.0+ (Hopper and later)."""
    return (device.type == "cuda" and hasattr(torch, "_scaled_mm") and FP8_DTYPE is not None
            and torch.cuda.get_device_capability(device) >= (9, 0))


class FP8Linear(Linear):
    """`y = x (scale * W_fp8)^T + b`, same call as `layers.Linear`.

    `weight` is float8_e4m3fn [out, in]; `scale` float32 [out].
    """

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 kernel: str = "auto") -> None:
        if weight.dtype != FP8_DTYPE or weight.dim() != 2:
            raise ConfigError(f"FP8Linear: weight must be a 2-D {FP8_DTYPE} tensor, "
                              f"got {weight.dtype} {tuple(weight.shape)}")
        if scale.numel() != weight.shape[0]:
            raise ConfigError(f"FP8Linear: {scale.numel()} scales for {weight.shape[0]} output channels")
        if kernel not in KERNELS:
            raise ConfigError(f"FP8Linear: kernel {kernel!r} is not one of {KERNELS}")
        super().__init__(weight, bias)
        self.scale = scale.to(device=weight.device, dtype=torch.float32).contiguous()
        out_f, in_f = weight.shape
        fits = out_f % 16 == 0 and in_f % 16 == 0  # _scaled_mm's shape rule
        if kernel == "scaled_mm" and not (fits and scaled_mm_supported(weight.device)):
            raise ConfigError(f"FP8Linear: scaled_mm unavailable on {weight.device} for shape {(out_f, in_f)}")
        self.use_scaled_mm = kernel != "dequant" and fits and scaled_mm_supported(weight.device)
        self._scale_row = self.scale.view(1, -1)
        self._quantize = activation_quantizer(weight.device) if self.use_scaled_mm else quantize_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self._base(x)
        return add_adapter_rows(self, x, y) if adapters_active() else y

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_scaled_mm:
            return self._scaled(x)
        # FP8 values are exact in bf16/fp32; the per-row scale applies to the output columns, so
        # only this layer's converted weight exists, for the duration of the call.
        y = (linear_rows(x, self.weight.to(x.dtype)).float() * self._scale_row).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token activation scale (absmax/448 of each row of x), one FP8 GEMM, bf16 out."""
        shape = x.shape
        xq, x_scale = self._quantize(x.reshape(-1, shape[-1]).float())
        y = torch._scaled_mm(xq, self.weight.t(), scale_a=x_scale, scale_b=self._scale_row,
                             out_dtype=torch.bfloat16)
        y = y.to(x.dtype).view(*shape[:-1], -1)
        return y if self.bias is None else y + self.bias

    def nbytes(self) -> int:
        return super().nbytes() + self.scale.numel() * self.scale.element_size()


def fp8_layer_linear(device: torch.device | str, kernel: str = "auto") -> LinearFactory:
    """The `layer_linear` factory for `NeoPPTransformer.from_tensors` in the FP8 mode.

    Uses the checkpoint's `<name>.weight_scale` when present, else quantises at load.
    """
    dev = torch.device(device)

    def make(key: str, weight: torch.Tensor, bias: torch.Tensor | None, tensors: dict) -> Linear:
        scale = tensors.get(key + "_scale")
        if scale is None or weight.dtype != FP8_DTYPE:
            full = weight.float() if scale is None else dequantize_fp8(weight, scale)
            weight, scale = quantize_fp8(full)
        b = None if bias is None else bias.to(dev)
        return FP8Linear(weight.to(dev), scale.to(dev), b, kernel)

    return make


def weight_bytes(linears: list[Linear]) -> int:
    """Resident bytes of the given linears' tensors (weights, scales, biases)."""
    return sum(lin.nbytes() for lin in linears)
