"""WeightStore: named tensors that are eager (in memory), lazy (read from safetensors on use) or meta (shape only)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

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
    start: int  # byte range in the file
    end: int

    def read(self) -> torch.Tensor:
        """Reads just this tensor with plain file IO: no memory map, so memory is bounded by the tensor."""
        buf = bytearray(self.end - self.start)
        if not buf:
            return torch.empty(self.shape, dtype=self.dtype)
        with open(self.file, "rb") as f:
            f.seek(self.start)
            if f.readinto(buf) != len(buf):
                raise CheckpointError(f"{self.file}: tensor {self.key!r} is cut short; the file is truncated")
        return torch.frombuffer(buf, dtype=self.dtype).reshape(self.shape)


def read_safetensors_header(file: Path) -> tuple[dict, int]:
    """The header (name -> dtype, shape, data_offsets) and where the data starts."""
    try:
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            size = file.stat().st_size
            if not 2 <= n <= size - 8:
                raise ValueError(f"header length {n} does not fit a file of {size} bytes")
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({e}); re-save it or re-download it") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: the safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    return header, 8 + n


class WeightStore:
    """Tensors by their stable (Hugging Face) name. Lazy entries are read from their file on each use
    (plain reads of just their bytes, so memory stays bounded by the tensors in use)."""

    def __init__(self):
        self._entries: dict[str, torch.Tensor | _Lazy] = {}

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
        file = Path(file)
        header, base = read_safetensors_header(file)
        size = file.stat().st_size
        for k, info in header.items():
            try:
                dtype, shape, (start, end) = _DTYPES.get(info["dtype"]), tuple(info["shape"]), info["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{file}: header entry {k!r} is malformed") from None
            if dtype is None:
                raise CheckpointError(f"{file}: tensor {k!r} has unsupported dtype {info['dtype']}")
            if end - start != math.prod(shape) * dtype.itemsize or base + end > size:
                raise CheckpointError(f"{file}: tensor {k!r} ({info['dtype']} {list(shape)}) does not fit its byte "
                                      f"range; the file is truncated or corrupt")
            self._entries[k] = _Lazy(file, k, shape, dtype, base + start, base + end)
        return list(header)

    def delete(self, name: str) -> None:
        del self._entries[name]

    def copy(self) -> WeightStore:
        """A shallow copy: tensors are shared (treat them as immutable), the name table is not."""
        w = WeightStore()
        w._entries = dict(self._entries)
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
            return e.read()
        if isinstance(e, Deferred):
            return e.compute()
        if isinstance(e, _LazyQuant):
            from ..passes.quant.formats import FP8Tensor, NVFP4Tensor

            t = {r: p.read() for r, p in e.parts.items()}
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
