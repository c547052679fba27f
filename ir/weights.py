"""WeightStore: named tensors that are eager (in memory), lazy (read from safetensors on use) or meta (shape only)."""
from __future__ import annotations

import dataclasses
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
    dtype: torch.dtype  # as read (after `stored` is cast to it)
    start: int  # byte range in the file
    end: int
    stored: torch.dtype | None = None  # the file's dtype, when it differs from `dtype`

    def read(self) -> torch.Tensor:
        """Reads just this tensor with plain file IO: no memory map, so memory is bounded by the tensor."""
        buf = bytearray(self.end - self.start)
        if not buf:
            return torch.empty(self.shape, dtype=self.dtype)
        with open(self.file, "rb") as f:
            f.seek(self.start)
            if f.readinto(buf) != len(buf):
                raise CheckpointError(f"{self.file}: tensor {self.key!r} is cut short; the file is truncated")
        t = torch.frombuffer(buf, dtype=self.stored or self.dtype).reshape(self.shape)
        return t if self.stored is None else t.to(self.dtype)

    def chunks(self, size: int = 1 << 24):
        """The stored bytes in pieces of at most `size` (to compare big tensors in bounded memory)."""
        with open(self.file, "rb") as f:
            f.seek(self.start)
            for pos in range(self.start, self.end, size):
                yield f.read(min(size, self.end - pos))


#: the safetensors library's own limit on the header length
MAX_HEADER_BYTES = 100_000_000


def _unique_keys(pairs: list) -> dict:
    """A JSON object hook: a repeated key is an error (json.loads would silently keep the last one)."""
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {k!r} appears twice")
        out[k] = v
    return out


def loads_strict(text: str):
    """json.loads that refuses repeated keys; ValueError (or RecursionError on absurd nesting) otherwise."""
    return json.loads(text, object_pairs_hook=_unique_keys)


def _read_header(file: Path) -> tuple[dict, int, int]:
    """The raw header object, where the data starts and the file size; the length checks come first."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            prefix = f.read(8)
            n = int.from_bytes(prefix, "little")
            if len(prefix) < 8 or not 2 <= n <= min(MAX_HEADER_BYTES, size - 8):
                raise ValueError(f"header length {n if len(prefix) == 8 else '?'} does not fit a file of {size} "
                                 f"bytes within the {MAX_HEADER_BYTES}-byte limit")
            header = loads_strict(f.read(n).decode("utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CheckpointError(f"{file}: not a readable safetensors file ({e}); re-save it or re-download it") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: the safetensors header is not a JSON object; re-save or re-download it")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise CheckpointError(f"{file}: the header's __metadata__ must map strings to strings; re-save the file")
    return header, 8 + n, size


def _is_count(v) -> bool:
    return type(v) is int and v >= 0  # JSON integers only: not bool, not float


def _entry(file: Path, key: str, info, base: int) -> _Lazy:
    """One header entry, checked field by field (dtype, shape, data_offsets and their agreement)."""
    bad = lambda what: CheckpointError(f"{file}: tensor {key!r}: {what}; the header is corrupt, "
                                       "re-save the file or re-download it")
    if not isinstance(info, dict):
        raise bad("the entry is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str):
        raise bad(f"dtype {dtype!r} is not a string")
    if dtype not in _DTYPES:
        raise CheckpointError(f"{file}: tensor {key!r} has dtype {dtype!r}, which puzzlekit does not read (it reads "
                              f"{', '.join(_DTYPES)}); convert the tensor")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise bad(f"shape {shape!r} is not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise bad(f"data_offsets {offsets!r} is not two non-negative integers")
    start, end = offsets
    nbytes = math.prod(shape) * _DTYPES[dtype].itemsize
    if end < start or end - start != nbytes:
        raise bad(f"data_offsets {offsets} span {end - start} bytes, but {dtype} {shape} needs {nbytes}")
    return _Lazy(file, key, tuple(shape), _DTYPES[dtype], base + start, base + end)


def _check_tiling(file: Path, entries: dict[str, _Lazy], base: int, size: int) -> None:
    """Like the safetensors library: sorted by offset, the tensors cover the data region exactly, with no
    overlap and no gap, from its first byte to the end of the file."""
    pos, prev = base, None
    for t in sorted(entries.values(), key=lambda t: (t.start, t.end)):
        if t.start != pos:
            how = f"overlaps {prev!r}" if t.start < pos else f"leaves {t.start - pos} unused bytes before it"
            raise CheckpointError(f"{file}: tensor {t.key!r} starts at data byte {t.start - base}, expected "
                                  f"{pos - base}: it {how}; the file is corrupt, re-save or re-download it")
        pos, prev = t.end, t.key
    if pos != size:
        how = "the file is truncated" if pos > size else f"{size - pos} trailing bytes belong to no tensor"
        raise CheckpointError(f"{file}: the tensors' data ends at byte {pos} but the file has {size} bytes: "
                              f"{how}; re-save or re-download it")


def lazy_tensors(file: Path) -> dict[str, _Lazy]:
    """Every tensor of a safetensors file, unread, after validating its header."""
    file = Path(file)
    header, base, size = _read_header(file)
    entries = {k: _entry(file, k, info, base) for k, info in header.items()}
    _check_tiling(file, entries, base, size)
    return entries


def stored_tensors(name: str, value) -> dict:
    """A weight as a checkpoint stores it: quantised ones as values + `_scale` (+ `_scale_2`)."""
    if isinstance(value, torch.Tensor):
        return {name: value.contiguous()}
    if value.format == "fp8":
        return {name: value.data.contiguous(), name + "_scale": value.scale.contiguous()}
    return {name: value.data.contiguous(), name + "_scale": value.block_scale.contiguous(),
            name + "_scale_2": value.global_scale.reshape(()).contiguous()}


def _held(entry) -> bool:
    """Whether an entry is held in memory: a tensor or a quantised weight, not one read from a file on use, a
    deferred one or a meta tensor (or no entry)."""
    return entry is not None and not isinstance(entry, (_Lazy, _LazyQuant, Deferred)) and \
        not (isinstance(entry, torch.Tensor) and entry.is_meta)


def _held_bytes(entry) -> int:
    if not _held(entry):
        return 0
    return entry.numel() * entry.element_size() if isinstance(entry, torch.Tensor) else entry.nbytes()


class WeightStore:
    """Tensors by their stable (Hugging Face) name. Lazy entries are read from their file on each use
    (plain reads of just their bytes, so memory stays bounded by the tensors in use)."""

    def __init__(self):
        self._entries: dict[str, torch.Tensor | _Lazy] = {}
        self._resident = 0  # bytes the entries hold in memory, kept as they change (`resident_bytes`)

    def _put(self, name: str, entry) -> None:
        """Every change of an entry goes through here (None: removed), keeping the resident bytes."""
        self._resident -= _held_bytes(self._entries.get(name))
        if entry is None:
            self._entries.pop(name, None)
        else:
            self._entries[name] = entry
            self._resident += _held_bytes(entry)

    # -- building ---------------------------------------------------------------------------------
    def set(self, name: str, tensor) -> None:
        """A tensor, or a quantised weight (FP8Tensor / NVFP4Tensor from passes.quant)."""
        self._put(name, tensor.detach() if isinstance(tensor, torch.Tensor) else tensor)

    def group_quantized(self, name: str, fmt: str, dtype: torch.dtype) -> None:
        """Turns `name`, `name_scale` (and `name_scale_2` for NVFP4) into one lazy quantised weight."""
        roles = {"data": name, "scale": name + "_scale"}
        if fmt.startswith("nvfp4"):
            roles["scale_2"] = name + "_scale_2"
        missing = [n for n in roles.values() if n not in self._entries]
        if missing:
            raise CheckpointError(f"quantised weight {name!r} ({fmt}) lacks {missing} in the checkpoint")
        parts = {r: self._entries[n] for r, n in roles.items()}
        for n in roles.values():
            self._put(n, None)
        self._put(name, _LazyQuant(fmt, parts, dtype))

    def set_meta(self, name: str, shape, dtype=torch.bfloat16) -> None:
        self._put(name, torch.empty(tuple(shape), dtype=dtype, device="meta"))

    def update(self, entries: dict) -> None:
        """Adds entries as they are: tensors, quantised weights or lazy tensors (from `lazy_tensors`)."""
        for name, entry in entries.items():
            self._put(name, entry)

    def cast_on_read(self, name: str, dtype: torch.dtype) -> None:
        """Makes a lazy tensor read as `dtype` (a stored dtype that differs from the model's)."""
        e = self._entries[name]
        if not isinstance(e, _Lazy):
            raise TypeError(f"{name!r} is not a lazy tensor")
        self._put(name, dataclasses.replace(e, dtype=dtype, stored=e.stored or e.dtype))

    def resident_bytes(self) -> int:
        """Bytes of the weights held in memory (new tensors, quantised or trained ones; not lazy or meta): kept
        as entries change, so checking it after every new tensor costs nothing (42,000 weights at Super's counts)."""
        return self._resident

    def _in_memory(self) -> list[str]:
        return [k for k, e in self._entries.items() if _held(e)]

    def spill_over(self, limit: int) -> None:
        """When the weights held in memory pass `limit` bytes, writes them to one scratch safetensors file
        (puzzlekit.memory) and reads them from there from now on, as a checkpoint's are."""
        if self.resident_bytes() <= limit:
            return
        names = self._in_memory()
        from safetensors.torch import save_file

        from ..memory import scratch_file

        f, tensors = scratch_file(".safetensors"), {}
        for k in names:
            tensors.update(stored_tensors(k, self._entries[k]))
        save_file(tensors, str(f))
        formats = {k: (self._entries[k].format, self._entries[k].dtype) for k in names if self.is_quantized(k)}
        self.update(lazy_tensors(f))
        for k, (fmt, dtype) in formats.items():
            self.group_quantized(k, fmt, dtype)

    def delete(self, name: str) -> None:
        if name not in self._entries:
            raise KeyError(name)
        self._put(name, None)

    def copy(self) -> WeightStore:
        """A shallow copy: tensors are shared (treat them as immutable), the name table is not."""
        w = WeightStore()
        w._entries, w._resident = dict(self._entries), self._resident
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
        """Shape and dtype only: a meta tensor, or a quantised weight of meta tensors (a config's declared format)."""
        e = self._entries[name]
        data = e if isinstance(e, torch.Tensor) else getattr(e, "data", None)
        return isinstance(data, torch.Tensor) and data.is_meta

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
            from .quant.formats import FP8Tensor, NVFP4Tensor

            t = {r: p.read() for r, p in e.parts.items()}
            if e.format.startswith("nvfp4"):
                return NVFP4Tensor(t["data"], t["scale"], t["scale_2"], e.dtype)
            return FP8Tensor(t["data"], t["scale"], e.dtype)
        return e

    def get_many(self, names: list[str]) -> list:
        """`get` of each name, with the plain lazy ones read in as few reads as their files allow: entries of
        one file whose bytes follow each other (a layer's experts, as checkpoints store them) come in one read
        of their whole span, and each tensor is a view of it (or a cast, where the store casts on read)."""
        out = [None] * len(names)
        runs: dict[Path, list] = {}
        for i, n in enumerate(names):
            e = self._entries[n]
            if isinstance(e, _Lazy) and e.end > e.start:
                runs.setdefault(e.file, []).append((e.start, i, e))
            else:
                out[i] = self.get(n)
        for file, items in runs.items():
            items.sort(key=lambda x: x[0])
            start = 0
            while start < len(items):
                end = start + 1  # extend the run while the next entry starts where this one ends
                while end < len(items) and items[end][2].start == items[end - 1][2].end:
                    end += 1
                run = items[start:end]
                first, last = run[0][2], run[-1][2]
                buf = _Lazy(file, first.key, (last.end - first.start,), torch.uint8, first.start, last.end).read()
                for _, i, e in run:
                    raw = buf[e.start - first.start:e.end - first.start]
                    t = raw.view(e.stored or e.dtype).reshape(e.shape)
                    out[i] = t if e.stored is None else t.to(e.dtype)
                start = end
        return out

    def equal(self, a: str, b: str) -> bool:
        """Whether two weights hold the same values; lazy ones stored alike compare bytes in bounded chunks."""
        x, y = self._entries[a], self._entries[b]
        if tuple(x.shape) != tuple(y.shape):
            return False
        if isinstance(x, _Lazy) and isinstance(y, _Lazy) and (x.stored or x.dtype) == (y.stored or y.dtype):
            return all(p == q for p, q in zip(x.chunks(), y.chunks()))
        tx, ty = self.get(a), self.get(b)
        return tx.dtype == ty.dtype and torch.equal(tx, ty)

    def nbytes(self, name: str) -> int:
        e = self._entries[name]
        if isinstance(e, _LazyQuant):
            return sum(math.prod(p.shape) * p.dtype.itemsize for p in e.parts.values())
        if self.is_quantized(name):
            return e.nbytes()
        return math.prod(self.shape(name)) * self.dtype(name).itemsize
