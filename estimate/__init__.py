"""Know before you run: each stage's peak memory per process, time and verdict, from the config and the options
alone (`--estimate` on compress, library and run), and the refusal of a run whose stage cannot fit.

`hardware` says what the stages run on (`--hardware h100:8`, `cpu`) and prices their work; `activations` holds
the measured activation model; `stages` estimates each pass. `estimate` walks a pipeline's passes as the pass
manager would run them (a `repeat{n}` body n times, with its steps split as compress splits them).
"""
from __future__ import annotations

from .hardware import GPU_EFFICIENCY, Hardware, Rates, parse_hardware
from .stages import ESTIMATORS, Context, Stage, output

__all__ = ["Estimate", "GPU_EFFICIENCY", "Hardware", "Rates", "Stage", "estimate", "parse_hardware"]

GiB = 2**30
#: a process's start: the interpreter, torch and puzzlekit imported, the model's index read (2-core machine)
STARTUP_SECONDS = 3.0


class Estimate:
    """The stages of one run on one kind of hardware."""

    def __init__(self, stages: list[Stage], hw: Hardware, model: str, budget: int, left_out: str = ""):
        self.stages, self.hw, self.model, self.budget, self.left_out = stages, hw, model, budget, left_out

    @property
    def seconds(self) -> float:
        """The stages and the process's start."""
        return STARTUP_SECONDS + sum(s.seconds for s in self.stages)

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.stages)

    def as_json(self) -> dict:
        return {"model": self.model, "hardware": self.hw.describe(), "budget_bytes": self.budget,
                "fits": self.fits, "seconds": self.seconds, "not_estimated": self.left_out,
                "stages": [s.as_json() for s in self.stages]}

    def format(self) -> str:
        rows = [f"{'stage':<20} {'peak/process':>14} {'time':>10}  fits", "-" * 52]
        for s in self.stages:
            rows.append(f"{s.name:<20} {s.peak_memory_bytes / GiB:>10.2f} GiB {_duration(s.seconds):>10}  "
                        f"{'yes' if s.fits else 'NO'}")
        hw = self.hw.describe()
        rates = (f"datasheet bf16 peak and bandwidth x {GPU_EFFICIENCY}" if self.hw.kind == "gpu"
                 else "measured on this machine")
        lines = [f"estimate for {self.model} on {self.hw.name} ({self.hw.memory_bytes / GiB:.1f} GiB per process; "
                 f"rates: {rates})", *rows,
                 f"total {_duration(self.seconds)} (with {STARTUP_SECONDS:g} s to start)"
                 + (f"; not estimated: {self.left_out}" if self.left_out else "")]
        lines += [f"\n{s.name} does not fit: needs {s.peak_memory_bytes / GiB:.1f} GiB per process, has "
                  f"{hw['memory_bytes'] / GiB:.1f} GiB; ways to fit it:\n  - " + "\n  - ".join(s.fixes)
                  for s in self.stages if not s.fits]
        return "\n".join(lines) + "\n"

    def refusal(self) -> str:
        """The message a run that cannot fit stops with (empty when every stage fits)."""
        s = next((s for s in self.stages if not s.fits), None)
        if s is None:
            return ""
        parts = ", ".join(f"{k} {v / GiB:.1f} GiB" for k, v in s.memory.items() if v >= 0.05 * GiB)
        return (f"stage {s.name} would not fit on {self.hw.name}: it needs {s.peak_memory_bytes / GiB:.1f} GiB per "
                f"process ({parts}), and {self.hw.memory_bytes / GiB:.1f} GiB is there. Ways to fit it: "
                + "; ".join(s.fixes) + ". (--estimate shows every stage; the estimate is an upper bound at the "
                "parent's size.)")


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def estimate(passes: list, prog, hw: Hardware, budget: int, model: str = "", rates: Rates | None = None,
             writes: bool = False, left_out: str = "") -> Estimate:
    """Every pass with an estimator, in order (a `repeat{n}` body n times; the others are cheap and left out), and
    with `writes` the checkpoint written at the end."""
    ctx = Context(prog, hw, budget, rates)
    stages = []

    def walk(ps):
        for p in ps:
            if getattr(p, "pass_name", "") == "repeat":
                for _ in range(p.n):
                    walk(p.body)
            elif getattr(p, "pass_name", "") in ESTIMATORS:
                stages.append(ESTIMATORS[p.pass_name](ctx, p))

    walk(passes)
    if writes:
        stages.append(output(ctx))
    return Estimate(stages, hw, model or str(prog.meta.get("source", "")), budget, left_out)
