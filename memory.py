"""The memory budget (`--max-memory`): how many bytes of weights and activations a command may keep resident.

A model larger than the budget still runs: its layers are read from the checkpoint when they run and
released after, activations past their share go to scratch files, and new weights (quantised, sliced,
trained) are spilled there too. The default is half of what the machine has available when the command
starts, shared by the processes torchrun starts on it (LOCAL_WORLD_SIZE). Scratch files live in one temporary
directory per process (under `PUZZLEKIT_SCRATCH` when set), removed when the process ends.
"""
from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from .errors import UsageError

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
#: the least budget accepted: below it not even a small layer and its batch fit
MIN_BYTES = 16 * 2**20


def parse_size(text: str | int) -> int:
    """Bytes from `12GB`, `512MiB`, `3e9` or a plain integer."""
    if isinstance(text, int):
        n = text
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
        if not m or m.group(2) not in _UNITS:
            raise UsageError(f"--max-memory {text!r} is not a size; write it like 24GB, 512MiB or 3e9 (bytes)")
        n = int(float(m.group(1)) * _UNITS[m.group(2)])
    if n < MIN_BYTES:
        raise UsageError(f"--max-memory {text!r} is below the least budget puzzlekit runs in "
                         f"({MIN_BYTES // 2**20} MiB); give more")
    return n


def available() -> int:
    """Bytes this process could still allocate: MemAvailable (Linux), else the physical memory."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def budget(max_memory: str | int | None = None) -> int:
    """The budget in bytes: `max_memory` when given (an int is taken as it is), else half of what is
    available now, divided among this node's torchrun processes (each takes its own budget)."""
    if isinstance(max_memory, int) and max_memory > 0:
        return max_memory
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return parse_size(max_memory) if max_memory else max(MIN_BYTES, available() // 2 // local)


def return_freed_memory() -> None:
    """Makes glibc give large freed blocks back to the system at once (a fixed 1 MiB mmap threshold, as
    MALLOC_MMAP_THRESHOLD_ would): by default its threshold grows with every large free, after which the
    layers read, used and released one after another stay in the heap and resident memory only grows."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


_scratch: tempfile.TemporaryDirectory | None = None


def scratch_dir() -> Path:
    """This process's scratch directory (spilled activations and weights), created on first use."""
    global _scratch
    if _scratch is None:
        root = os.environ.get("PUZZLEKIT_SCRATCH") or None
        if root:
            Path(root).mkdir(parents=True, exist_ok=True)
        _scratch = tempfile.TemporaryDirectory(prefix="puzzlekit-scratch-", dir=root)
    return Path(_scratch.name)


def scratch_file(suffix: str) -> Path:
    """A new, unique file name in the scratch directory."""
    fd, name = tempfile.mkstemp(suffix=suffix, dir=scratch_dir())
    os.close(fd)
    return Path(name)
