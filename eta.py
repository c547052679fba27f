"""How long a stage has left, said once after its first unit (a layer, a step): on a large model the user
learns within a minute what a stage will cost, not after it."""
from __future__ import annotations

import sys
import time


def _human(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


class Remaining:
    """Counts a stage's units as they finish; after the first, prints "STAGE: 1 of N UNITs in T; about R left"
    (R from the time per unit so far) to stderr, once. Silent when `enabled` is false or a single unit is left."""

    def __init__(self, stage: str, total: int, unit: str = "layer", enabled: bool = True, stream=None):
        self.stage, self.total, self.unit, self.enabled = stage, total, unit, enabled
        self.stream, self.count, self.said, self.start = stream, 0, False, time.perf_counter()

    def done(self, n: int = 1) -> None:
        self.count += n
        if self.said or not self.enabled or not 0 < self.count < self.total:
            return
        self.said = True
        spent = time.perf_counter() - self.start
        left = spent / self.count * (self.total - self.count)
        print(f"{self.stage}: {self.count} of {self.total} {self.unit}s in {_human(spent)}; about {_human(left)} left",
              file=self.stream or sys.stderr, flush=True)
