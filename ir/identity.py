"""A program's identity: one hash that stages, libraries, distillation runs and caches compare to know they
hold the same model.

It is taken about ten times per run, on checkpoints of hundreds of GB, so it must not read the weights:
each tensor counts by its name, dtype, shape and its bytes when small, else a few evenly spaced windows of
them (read straight from the file for checkpoint-backed ones). It depends only on the values, not on how
they are held (in memory, lazy in a checkpoint however sharded, spilled to scratch): a run resumed from a
stage checkpoint must match the in-memory program it saved. A safetensors header cannot serve: two
fine-tunes of one model have the same headers and sizes. The hash is kept per WeightStore and reused while
the program text, the store's entries (and the in-place versions of its tensors) and its files' stat are
unchanged.
"""
from __future__ import annotations

import hashlib
import math
import os
import weakref
from contextlib import ExitStack

import torch

from ..errors import CheckpointError
from .printer import print_program
from .program import Program
from .weights import Deferred, WeightStore, _Lazy, _LazyQuant, stored_tensors

#: tensors of up to this many bytes are hashed whole; larger ones by WINDOWS windows of WINDOW_BYTES
FULL_BYTES = 1 << 20
WINDOWS = 8
WINDOW_BYTES = 4096

#: store -> (state, program text, hash); weak, so a dropped store drops its entry
_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def program_hash(prog: Program) -> str:
    """sha256 of the program text and every non-meta weight's name, dtype, shape and (sampled) bytes; the
    same values give the same hash whether in memory or in a checkpoint. Computed once per store state."""
    text, w = print_program(prog), prog.weights
    state = _state(w)
    memo = _MEMO.get(w)
    if memo is not None and memo[1] == text and _same(memo[0], state):
        return memo[2]
    digest = _digest(text, w)
    _MEMO[w] = (state, text, digest)
    return digest


# -- the memo's key: what a change to the weights changes --------------------------------------------
def _tensors_of(e) -> list:
    """The tensors an in-memory entry holds (a quantised weight holds several)."""
    if isinstance(e, torch.Tensor):
        return [e]
    return [v for v in vars(e).values() if isinstance(v, torch.Tensor)] if hasattr(e, "__dict__") else []


def _state(w: WeightStore) -> tuple:
    """Per entry its name, a weak reference to the object and its tensors' in-place versions; per backing
    file its inode, size and mtime. Weak references, so the memo keeps no replaced tensor alive."""
    entries, files = [], set()
    for name, e in w._entries.items():
        parts = e.parts.values() if isinstance(e, _LazyQuant) else [e] if isinstance(e, _Lazy) else []
        files.update(p.file for p in parts)
        tensors = _tensors_of(e)
        entries.append((name, weakref.ref(e), tuple(weakref.ref(t) for t in tensors),
                        tuple(t._version for t in tensors)))
    return tuple(entries), tuple(sorted((str(f), _stat(f)) for f in files))


def _stat(f) -> tuple | None:
    try:
        s = os.stat(f)
    except OSError:
        return None
    return s.st_ino, s.st_size, s.st_mtime_ns


def _same(old: tuple, new: tuple) -> bool:
    (oe, of), (ne, nf) = old, new
    if of != nf or len(oe) != len(ne):
        return False
    for (n1, r1, ts1, v1), (n2, r2, ts2, v2) in zip(oe, ne):
        if n1 != n2 or v1 != v2 or r1() is None or r1() is not r2() or len(ts1) != len(ts2):
            return False
        if any(a() is None or a() is not b() for a, b in zip(ts1, ts2)):
            return False
    return True


# -- the hash ----------------------------------------------------------------------------------------
def _digest(text: str, w: WeightStore) -> str:
    h = hashlib.sha256(text.encode())
    with ExitStack() as files:
        opened: dict = {}

        def handle(path):
            if path not in opened:
                opened[path] = files.enter_context(open(path, "rb"))
            return opened[path]

        for name in sorted(w.names()):
            if w.is_meta(name):
                continue
            e = w._entries[name]
            if isinstance(e, Deferred):
                e = e.compute()
            if isinstance(e, _Lazy):
                _update(h, name, e.dtype, e.shape, _file_reader(e, handle(e.file)))
            elif isinstance(e, _LazyQuant):
                h.update(f"{name}:quantized:{e.format}:{e.dtype}|".encode())
                for role, suffix in (("data", ""), ("scale", "_scale"), ("scale_2", "_scale_2")):
                    if role in e.parts:
                        p = e.parts[role]
                        _update(h, name + suffix, p.dtype, p.shape, _file_reader(p, handle(p.file)))
            elif isinstance(e, torch.Tensor):
                _update(h, name, e.dtype, e.shape, _memory_reader(e))
            else:  # a quantised weight in memory: its components, as a checkpoint stores (and reloads) them
                h.update(f"{name}:quantized:{e.format}:{e.dtype}|".encode())
                for key, t in stored_tensors(name, e).items():
                    _update(h, key, t.dtype, t.shape, _memory_reader(t))
    return h.hexdigest()


def _update(h, label: str, dtype: torch.dtype, shape, read) -> None:
    """Hashes a tensor's label, dtype, shape and bytes: all of them up to FULL_BYTES, else WINDOWS evenly
    spaced windows (in elements of `dtype`, so a tensor cast on read samples as its in-memory copy does).
    `read(a, b)` gives the bytes of elements [a, b) of the flattened tensor, in `dtype`."""
    n = math.prod(shape)
    h.update(f"{label}:{dtype}:{tuple(shape)}|".encode())
    if n * dtype.itemsize <= FULL_BYTES:
        h.update(read(0, n))
        return
    size = min(n, max(1, WINDOW_BYTES // dtype.itemsize))
    for i in range(WINDOWS):
        a = i * (n - size) // (WINDOWS - 1)
        h.update(read(a, a + size))


def _memory_reader(t: torch.Tensor):
    flat = t.detach().reshape(-1)  # 0-dim tensors too: viewing them as bytes needs a dimension
    return lambda a, b: flat[a:b].contiguous().cpu().view(torch.uint8).numpy().tobytes()


def _file_reader(e: _Lazy, f):
    """Reads elements straight from the open file, as stored, cast to the dtype the tensor is read in."""
    stored = e.stored or e.dtype

    def read(a: int, b: int) -> bytes:
        want = (b - a) * stored.itemsize
        if not want:
            return b""
        f.seek(e.start + a * stored.itemsize)
        buf = f.read(want)
        if len(buf) != want:
            raise CheckpointError(f"{e.file}: tensor {e.key!r} is cut short; the file is truncated")
        if e.stored is None:
            return buf
        return torch.frombuffer(bytearray(buf), dtype=stored).to(e.dtype).view(torch.uint8).numpy().tobytes()

    return read
