"""WeightStore: named tensors that are eager (in memory), lazy (read from safetensors on use) or meta (shape only)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import CheckpointError

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class Deferred:
    """A weight computed when first read (e.g. quantised while a checkpoint streams to disk)."""

    compute: object  # () -> tensor or quantised weight
    shape: tuple
    dtype: torch.dtype
    format: str | None = None
    stored_bytes: int = 0

    def nbytes(self) -> int:
        return self.stored_bytes


@dataclass(frozen=True)
class _LazyQuant:
    """A quantised weight whose parts (values, scales) are still in safetensors files."""

    format: str
    parts: dict  # role -> _Lazy ("data", "scale", "scale_2")
    dtype: torch.dtype

    @property
    def shape(self) -> tuple:
        s = self.parts["data"].shape
        return (*s[:-1], s[-1] * 2) if self.format.startswith("nvfp4") else s


@dataclass(frozen=True)
class _Lazy:
    file: Path
    key: str
    shape: tuple
    dtype: torch.dtype


class WeightStore:
    """Tensors by their stable (Hugging Face) name. Lazy entries are read, memory-mapped, on first use."""

    def __init__(self):
        self._entries: dict[str, torch.Tensor | _Lazy] = {}
        self._handles: dict[Path, object] = {}

    # -- building ---------------------------------------------------------------------------------
    def set(self, name: str, tensor) -> None:
        """A tensor, or a quantised weight (FP8Tensor / NVFP4Tensor from passes.quant)."""
        self._entries[name] = tensor.detach() if isinstance(tensor, torch.Tensor) else tensor

    def group_quantized(self, name: str, fmt: str, dtype: torch.dtype) -> None:
        """Turns `name`, `name_scale` (and `name_scale_2` for NVFP4) into one lazy quantised weight."""
        roles = {"data": name, "scale": name + "_scale"}
        if fmt.startswith("nvfp4"):
            roles["scale_2"] = name + "_scale_2"
        missing = [n for n in roles.values() if n not in self._entries]
        if missing:
            raise CheckpointError(f"quantised weight {name!r} ({fmt}) lacks {missing} in the checkpoint")
        parts = {r: self._entries.pop(n) for r, n in roles.items()}
        self._entries[name] = _LazyQuant(fmt, parts, dtype)

    def set_meta(self, name: str, shape, dtype=torch.bfloat16) -> None:
        self._entries[name] = torch.empty(tuple(shape), dtype=dtype, device="meta")

    def add_safetensors(self, file: Path) -> list[str]:
        """Registers every tensor of a safetensors file lazily; returns their names."""
        try:
            handle = safe_open(str(file), framework="pt")
        except Exception as e:  # safetensors raises its own types for truncated or bad headers
            raise CheckpointError(f"{file}: not a readable safetensors file ({e}); re-save it or re-download it") from None
        self._handles[Path(file)] = handle
        names = list(handle.keys())
        for k in names:
            sl = handle.get_slice(k)
            dtype = _DTYPES.get(sl.get_dtype())
            if dtype is None:
                raise CheckpointError(f"{file}: tensor {k!r} has unsupported dtype {sl.get_dtype()}")
            self._entries[k] = _Lazy(Path(file), k, tuple(sl.get_shape()), dtype)
        return names

    def delete(self, name: str) -> None:
        del self._entries[name]

    def copy(self) -> WeightStore:
        """A shallow copy: tensors are shared (treat them as immutable), the name table is not."""
        w = WeightStore()
        w._entries = dict(self._entries)
        w._handles = self._handles
        return w

    # -- reading ----------------------------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple:
        return tuple(self._entries[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        return self._entries[name].dtype

    def is_meta(self, name: str) -> bool:
        e = self._entries[name]
        return isinstance(e, torch.Tensor) and e.is_meta

    def is_quantized(self, name: str) -> bool:
        return not isinstance(self._entries[name], (torch.Tensor, _Lazy))

    def format(self, name: str) -> str | None:
        return getattr(self._entries[name], "format", None)

    def source(self, name: str) -> Path | None:
        e = self._entries[name]
        if isinstance(e, _LazyQuant):
            return e.parts["data"].file
        return e.file if isinstance(e, _Lazy) else None

    def get(self, name: str):
        """The tensor, or the quantised weight object (read from disk if lazy)."""
        e = self._entries[name]
        if isinstance(e, _Lazy):
            return self._handles[e.file].get_tensor(e.key)
        if isinstance(e, Deferred):
            return e.compute()
        if isinstance(e, _LazyQuant):
            from ..passes.quant.formats import FP8Tensor, NVFP4Tensor

            t = {r: self._handles[p.file].get_tensor(p.key) for r, p in e.parts.items()}
            if e.format.startswith("nvfp4"):
                return NVFP4Tensor(t["data"], t["scale"], t["scale_2"], e.dtype)
            return FP8Tensor(t["data"], t["scale"], e.dtype)
        return e

    def nbytes(self, name: str) -> int:
        e = self._entries[name]
        if isinstance(e, _LazyQuant):
            return sum(math.prod(p.shape) * p.dtype.itemsize for p in e.parts.values())
        if self.is_quantized(name):
            return e.nbytes()
        return math.prod(self.shape(name)) * self.dtype(name).itemsize
