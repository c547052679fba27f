"""Shared by the benchmark scripts: the median wall time of a call after warm-up (backends.torch.device's, the
one way puzzlekit times work)."""
from __future__ import annotations

from puzzlekit.backends.torch.device import CPU, median_seconds as _median


def median_seconds(fn, repeats: int = 15, warmup: int = 3) -> float:
    return _median(fn, CPU, repeats, warmup)
