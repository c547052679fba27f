"""How far a long stage has got and how long it has left. After its first unit (a layer, a step) a line says what
the stage will cost, so the user learns it within a minute, not after it; where no bar is drawn (output to a
file under a scheduler, --json) a line follows now and then, so a run watched in its log is seen to move."""
from __future__ import annotations

import math
import sys
import time

#: a loop's `progress` that asks for lines only, never a bar (a pipeline run with the bars off)
LINES = "lines"
#: where lines are drawn: a line every `SHARE` of the units or every `MOST` seconds, whichever comes first, but
#: never two within `LEAST` seconds (a log stays readable)
SHARE, MOST, LEAST = 0.1, 180.0, 30.0


def duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def bars(progress) -> bool:
    """Whether a loop draws a tqdm bar: asked for (`progress` True) and stderr a terminal, where a bar redraws
    in place; in a file it would pile up carriage returns."""
    isatty = getattr(sys.stderr, "isatty", None)
    return progress is True and bool(isatty and isatty())


class Remaining:
    """Counts a stage's units as they finish and says so on stderr.

    After the first unit: "STAGE: 1 of N UNITs in T; about R left" (R from the time per unit so far). Where a
    bar shows the rest (`progress` True and `bars`) that is all; elsewhere (True, or `LINES`) it goes on with
    "STAGE: k of N UNITs, T so far; about R left" at the interval rule (SHARE, MOST, LEAST) and
    "STAGE: N of N UNITs in T" at the end. False: silent; so is a single unit (the pass's own lines say it).
    `clock` is for tests."""

    def __init__(self, stage: str, total: int, unit: str = "layer", progress: bool | str = True, stream=None,
                 clock=time.monotonic):
        self.stage, self.total, self.unit, self.stream, self.clock = stage, total, unit, stream, clock
        self.lines = progress == LINES or (progress is True and not bars(progress))
        self.enabled = bool(progress) and total > 1
        self.count, self.start = 0, clock()
        self.said_at = self.said_count = None  # when the last line was said, and at which count

    def done(self, n: int = 1) -> None:
        """`n` more units finished (0: none, e.g. a node of a sweep that is not a layer)."""
        if n <= 0:
            return
        self.count += n
        if not self.enabled:
            return
        now = self.clock()
        spent = now - self.start
        left = spent / self.count * max(0, self.total - self.count)
        head = f"{self.stage}: {self.count} of {self.total} {self.unit}s"
        if self.said_at is None and self.count < self.total:
            self._say(now, f"{head} in {duration(spent)}; about {duration(left)} left")
        elif not self.lines:
            return
        elif self.count >= self.total:
            if self.said_count != self.count:
                self._say(now, f"{head} in {duration(spent)}")
        elif self._due(now):
            self._say(now, f"{head}, {duration(spent)} so far; about {duration(left)} left")

    def _due(self, now: float) -> bool:
        quiet = now - self.said_at
        return quiet >= LEAST and (self.count - self.said_count >= math.ceil(SHARE * self.total) or quiet >= MOST)

    def _say(self, now: float, line: str) -> None:
        self.said_at, self.said_count = now, self.count
        print(line, file=self.stream or sys.stderr, flush=True)
