"""FP8 E4M3 and NVFP4 number formats: quantise, dequantise, pack and unpack (vectorised torch).

FP8: q = saturate(x / s), s = amax / 448 per tensor or per channel; x ~ q * s.
NVFP4: E2M1 values in blocks of 16 along the last (input) dimension, one E4M3 scale per block and
one FP32 scale per tensor: s2 = amax / (6 * 448); sb = e4m3(clamp(amax_block / (6 * s2), 2^-9, 448))
(1 for an all-zero block); q = round_half_even_e2m1(x / (sb * s2)); x ~ q * sb * s2. Two values per
byte, the first in the low nibble. The arithmetic follows NVIDIA Model Optimizer bit for bit.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ...errors import PuzzlekitError

#: quantization formats a block's weights are recorded in: name -> (weight format, activation format or None)
QUANT_FORMATS = {"fp8": ("fp8", "fp8"), "fp8-weight": ("fp8", None), "nvfp4": ("nvfp4", "nvfp4"),
                 "nvfp4-weight": ("nvfp4", None)}

FP8_MAX = 448.0
E2M1_MAX = 6.0
NVFP4_BLOCK = 16
CHUNK_ELEMENTS = 1 << 21  # elements rounded at a time (keeps temporaries small for huge tensors)
#: E2M1 code -> value (bit 3 is the sign)
E2M1_VALUES = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
#: midpoints between magnitudes after the first, and whether a tie rounds up to the even neighbour
_E2M1_MIDPOINTS = ((0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


class QuantError(PuzzlekitError):
    """A tensor cannot be quantised as asked."""


def _check(w: torch.Tensor, name: str) -> None:
    if not w.dtype.is_floating_point:
        raise QuantError(f"{name}: only floating-point tensors can be quantised, got {w.dtype}")
    if not bool(torch.isfinite(w).all()):
        bad = (~torch.isfinite(w)).sum().item()
        raise QuantError(f"{name}: has {bad} NaN/inf value(s); fix the weights before quantising")


@dataclass
class FP8Tensor:
    """float8_e4m3fn values and their FP32 scale (a scalar, or one per output channel: [rows, 1])."""

    data: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype = torch.float32  # the dtype it dequantises to
    format = "fp8"

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.dtype
        return self.data.to(dtype) * self.scale.to(dtype)

    def nbytes(self) -> int:
        return self.data.numel() + 4 * self.scale.numel()


def fp8_scale(w: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """amax / 448 (per tensor, or keeping `axis`), computed in w's dtype; zero amax gives scale 1."""
    if axis is None:
        amax = w.abs().amax()
    else:
        dims = [d for d in range(w.dim()) if d != axis % w.dim()]
        amax = w.abs().amax(dim=dims, keepdim=True)
    scale = amax / FP8_MAX
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def quantize_fp8(w: torch.Tensor, axis: int | None = None, scale: torch.Tensor | None = None,
                 name: str = "tensor") -> FP8Tensor:
    """FP8 E4M3 with a per-tensor (axis=None) or per-channel (axis=0: one scale per row) scale; saturating."""
    _check(w, name)
    s = fp8_scale(w, axis) if scale is None else scale.to(w.dtype)
    q = (w / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return FP8Tensor(q, s.float(), w.dtype)


# -- E2M1 -------------------------------------------------------------------------------------------------------
def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Rounds to the nearest E2M1 value (ties to even, saturating at 6) and returns 4-bit codes (uint8)."""
    mag = x.abs()
    idx = (mag > 0.25).to(torch.uint8)  # count the midpoints below: ">" rounds a tie down, ">=" up (to even)
    for bound, up in _E2M1_MIDPOINTS:
        idx += (mag >= bound) if up else (mag > bound)
    return idx | ((x < 0).to(torch.uint8) << 3)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte along the last dimension, the first in the low nibble."""
    return (codes[..., 1::2] << 4) | codes[..., 0::2]


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


@dataclass
class NVFP4Tensor:
    """Packed E2M1 codes [.., n/2] (uint8), E4M3 block scales [.., n/16] and the FP32 global scale."""

    data: torch.Tensor
    block_scale: torch.Tensor
    global_scale: torch.Tensor
    dtype: torch.dtype = torch.float32
    format = "nvfp4"

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.data.shape[:-1], self.data.shape[-1] * 2))

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        vals = E2M1_VALUES[unpack_fp4(self.data).long()]
        scale = self.block_scale.float() * self.global_scale.float()
        blocks = vals.reshape(*vals.shape[:-1], -1, NVFP4_BLOCK) * scale.unsqueeze(-1)
        return blocks.reshape(vals.shape).to(dtype or self.dtype)

    def nbytes(self) -> int:
        return self.data.numel() + self.block_scale.numel() + 4


def meta_quantized(fmt: str, shape, dtype: torch.dtype = torch.bfloat16):
    """A quantised weight of `shape` in `fmt` (QUANT_FORMATS) with meta tensors only: what a config that declares
    its checkpoint's quantisation describes, planned and priced without reading a weight."""
    meta = lambda s, d: torch.empty(tuple(s), dtype=d, device="meta")  # noqa: E731
    shape = tuple(shape)
    if QUANT_FORMATS[fmt][0] == "fp8":
        return FP8Tensor(meta(shape, torch.float8_e4m3fn), meta((), torch.float32), dtype)
    return NVFP4Tensor(meta((*shape[:-1], shape[-1] // 2), torch.uint8),
                       meta((*shape[:-1], shape[-1] // NVFP4_BLOCK), torch.float8_e4m3fn), meta((), torch.float32), dtype)


def _block_amax(w: torch.Tensor) -> torch.Tensor:
    return w.reshape(*w.shape[:-1], -1, NVFP4_BLOCK).abs().amax(-1)


def nvfp4_global_scale(w: torch.Tensor, block_amax: torch.Tensor | None = None, dims=None) -> torch.Tensor:
    """amax / (6 * 448) over the whole tensor, or over `dims` (kept: one scale per stacked weight)."""
    a = w.abs() if block_amax is None else block_amax
    amax = (a.amax() if dims is None else a.amax(dim=dims, keepdim=True)).float()
    s2 = amax / (E2M1_MAX * FP8_MAX)
    return torch.where(s2 == 0, torch.ones_like(s2), s2)


def nvfp4_block_scale(w: torch.Tensor, s2: torch.Tensor, ratio: torch.Tensor | float = 1.0,
                      block_amax: torch.Tensor | None = None) -> torch.Tensor:
    """E4M3 block scales: amax(block) / (6 * s2) (times `ratio`, for calibration), clamped to [2^-9, 448]."""
    amax = (_block_amax(w) if block_amax is None else block_amax).float()
    sb = amax / (E2M1_MAX * s2)
    if not isinstance(ratio, float) or ratio != 1.0:
        sb = sb * ratio
    sb = torch.where(sb == 0, torch.ones_like(sb), sb)
    return sb.clamp(min=2.0**-9, max=FP8_MAX).to(torch.float8_e4m3fn)


def quantize_nvfp4(w: torch.Tensor, block_scale: torch.Tensor | None = None, global_scale: torch.Tensor | None = None,
                   name: str = "tensor") -> NVFP4Tensor:
    """NVFP4 along the last dimension, which must be a multiple of 16."""
    if not w.dtype.is_floating_point:
        _check(w, name)
    if w.shape[-1] % NVFP4_BLOCK:
        raise QuantError(f"{name}: its input dimension {w.shape[-1]} is not a multiple of {NVFP4_BLOCK}; "
                         "NVFP4 needs whole blocks of 16 (keep this tensor in FP8 or BF16)")
    bamax = _block_amax(w)
    if not bool(torch.isfinite(bamax).all()):  # NaN and inf survive amax: one cheap check
        _check(w, name)
    s2 = nvfp4_global_scale(w, bamax) if global_scale is None else global_scale.float()
    sb = nvfp4_block_scale(w, s2, block_amax=bamax) if block_scale is None else block_scale
    rows = w.reshape(-1, w.shape[-1])
    scale = (sb.float() * s2).reshape(rows.shape[0], -1, 1)
    step = max(1, CHUNK_ELEMENTS // rows.shape[1])  # rows per chunk: bounds the temporaries of rounding
    packed = torch.cat([pack_fp4(e2m1_codes((rows[i:i + step].reshape(-1, rows.shape[1] // NVFP4_BLOCK, NVFP4_BLOCK)
                                             / scale[i:i + step]).reshape(-1, rows.shape[1])))
                        for i in range(0, rows.shape[0], step)])
    return NVFP4Tensor(packed.reshape(*w.shape[:-1], -1), sb, s2, w.dtype)


def fake_quantize(x: torch.Tensor, fmt: str, scale: torch.Tensor) -> torch.Tensor:
    """Quantise-dequantise activations at run time: FP8 with a static scale, NVFP4 with dynamic block
    scales under a calibrated global scale. Plain tensor ops with no checks or loops, so it exports;
    the arithmetic is that of quantize_fp8 / quantize_nvfp4 followed by dequantize."""
    if fmt == "fp8":
        s = scale.to(x.dtype)
        return (x / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(x.dtype) * s
    if fmt != "nvfp4":
        raise QuantError(f"unknown format {fmt!r}")
    return _NVFP4_ACTIVATIONS(x, scale)


@contextmanager
def nvfp4_activations_as(op):
    """While active, NVFP4 activation fake-quantization calls `op(x, global_scale)` instead of tracing its
    arithmetic: the ONNX exporter passes its one custom op, which it lowers to TensorRT's dynamic quantizer."""
    global _NVFP4_ACTIVATIONS
    before, _NVFP4_ACTIVATIONS = _NVFP4_ACTIVATIONS, op
    try:
        yield
    finally:
        _NVFP4_ACTIVATIONS = before


def nvfp4_qdq(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """NVFP4 quantise-dequantise of activations with dynamic block scales under the global scale `scale`."""
    s2 = scale.float()
    blocks = x.reshape(*x.shape[:-1], -1, NVFP4_BLOCK)
    sb = blocks.abs().amax(-1, keepdim=True).float() / (E2M1_MAX * s2)
    sb = torch.where(sb == 0, torch.ones_like(sb), sb).clamp(min=2.0**-9, max=FP8_MAX)
    sb = sb.to(torch.float8_e4m3fn).float()
    vals = E2M1_VALUES.to(x.device)[e2m1_codes(blocks / (sb * s2)).long()]
    return (vals * (sb * s2)).reshape(x.shape).to(x.dtype)


_NVFP4_ACTIVATIONS = nvfp4_qdq
