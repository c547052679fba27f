"""Shared by the benchmark scripts: the median wall time of a call after warm-up."""
from __future__ import annotations

import statistics
import time


def median_seconds(fn, repeats: int = 15, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
