"""Know before you run: each stage's peak memory per process, time and verdict, from the config and the options
alone (`--estimate` on compress, library and run), and the refusal of a run whose stage cannot fit.

`hardware` says what the stages run on (`--hardware h100:8`, `cpu`) and prices their work; `activations` holds
the measured activation model; `stages` estimates each pass. `estimate` walks a pipeline's passes as the pass
manager would run them (a `repeat{n}` body n times, with its steps split as compress splits them).
"""
from __future__ import annotations

from .hardware import GPU_EFFICIENCY, Hardware, Rates, Untimed, parse_hardware
from .choose import CHOSEN, climb, describe
from .outputs import Outputs, outputs as outputs_stage
from .stages import ESTIMATORS, Context, Stage, output

__all__ = ["Estimate", "GPU_EFFICIENCY", "Hardware", "Outputs", "Rates", "Stage", "estimate", "parse_hardware"]

GiB = 2**30
#: a process's start: the interpreter, torch and puzzlekit imported, the model's index read (2-core machine)
STARTUP_SECONDS = 3.0


class Estimate:
    """The stages of one run on one kind of hardware."""

    def __init__(self, stages: list[Stage], hw: Hardware, model: str, budget: int, left_out: str = ""):
        self.stages, self.hw, self.model, self.budget, self.left_out = stages, hw, model, budget, left_out
        #: (the parent's, the planned child's) param_counts when the stages after the search are the child's
        self.child: tuple[dict, dict] | None = None
        #: (pass, {option: value}) that auto chose for the passes it estimated so
        self.chosen: list[tuple[object, dict]] = []

    def choices(self) -> str:
        return describe([(p.pass_name + (" (MTP head)" if getattr(p, "head_only", False) else ""), opts)
                         for p, opts in self.chosen])

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
                **({"planned_child_params": self.child[1]["total"]} if self.child else {}),
                "auto": [{"pass": p.pass_name, "options": opts} for p, opts in self.chosen],
                "stages": [s.as_json() for s in self.stages]}

    def format(self) -> str:
        node = min(self.hw.processes, 8) if self.hw.kind == "gpu" else 1  # processes a node's host memory serves
        host = f"{'host/node' if node > 1 else 'host':>12}" if self.hw.kind == "gpu" else ""
        rows = [f"{'stage':<20} {'peak/process':>14}{host} {'time':>10}  fits", "-" * (52 + len(host))]
        for s in self.stages:
            h = f"{s.host_bytes * (1 if s.alone else node) / GiB:>8.0f} GiB" if host else ""
            rows.append(f"{s.name:<20} {s.peak_memory_bytes / GiB:>10.2f} GiB{h} {_duration(s.seconds):>10}  "
                        f"{'yes' if s.fits else 'NO'}")
        hw = self.hw.describe()
        rates = (f"datasheet bf16 peak and bandwidth x {GPU_EFFICIENCY}" if self.hw.kind == "gpu"
                 else "measured on this machine")
        lines = [f"estimate for {self.model} on {self.hw.name} ({self.hw.memory_bytes / GiB:.1f} GiB per process; "
                 f"rates: {rates})", *rows,
                 f"total {_duration(self.seconds)} (with {STARTUP_SECONDS:g} s to start)"
                 + (f"; not estimated: {self.left_out}" if self.left_out else "")]
        if self.chosen:
            lines.insert(1, self.choices())
        if self.child:
            lines.insert(1, f"the stages after the search at the child it plans for the target: "
                            f"{self.child[1]['total'] / 1e9:,.1f}B parameters (the parent's {self.child[0]['total'] / 1e9:,.1f}B)")
        lines += [f"\n{s.name} does not fit: needs {s.peak_memory_bytes / GiB:.1f} GiB per process, has "
                  f"{hw['memory_bytes'] / GiB:.1f} GiB" + (f" (and {s.host_bytes / GiB:.0f} GiB of host memory per "
                  f"process, has {s.host_capacity / GiB:.0f})" if s.host_bytes > s.host_capacity else "")
                  + "; ways to fit it:\n  - " + "\n  - ".join(s.fixes)
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
                + "; ".join(s.fixes) + ". (--estimate shows every stage" + ("" if self.child else
                "; the estimate is an upper bound at the parent's size") + ".)")


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def estimate(passes: list, prog, hw: Hardware, budget: int, model: str = "", rates: Rates | None = None,
             writes: bool = False, left_out: str = "", plan: bool = False, auto: bool = False,
             outputs: Outputs | None = None) -> Estimate:
    """Every pass with an estimator, in order (a `repeat{n}` body n times; the others are cheap and left out), and
    with `writes` the checkpoint written at the end. With `plan`, the stages after the last round's search are
    estimated at the child it picks (`child.planned_child`: a weightless search, seconds), not at the parent.
    With `auto`, each pass `choose.CHOSEN` names gets the cheapest settings that fit (`choose.climb`, at its first
    run: a repeat's first round is the largest model), estimated so, and listed in `Estimate.chosen` as (the
    pass, the options set) for the caller to apply to the passes it runs. `outputs`: compress's work after the
    child is written (the report, the frontier, the bundle), as one last stage."""
    ctx = parent = Context(prog, hw, budget, rates)
    named = lambda name: [p for p, last in _walk(passes) if getattr(p, "pass_name", "") == name and last]
    child = None
    if plan and named("puzzle"):
        from .child import planned_child

        child = planned_child(prog, named("puzzle")[-1], next(iter(named("library")), None))
    stages, picked = [], {}
    for p, last in _walk(passes):
        name = getattr(p, "pass_name", "")
        if auto and name in CHOSEN and id(p) not in picked:  # memory decides: no block timed on the way
            sizes = Context(ctx.prog, hw, budget, Untimed(hw), teacher=ctx.teacher)
            picked[id(p)] = (p, *climb(p, lambda q: ESTIMATORS[name](sizes, q).fits, hw))
        if name in ESTIMATORS:
            stages.append(ESTIMATORS[name](ctx, picked[id(p)][1] if id(p) in picked else p))
        if name == "puzzle" and last and child is not None:
            ctx = Context(child, hw, budget, parent.rates, teacher=prog)
    if writes:
        stages.append(output(ctx))
    if outputs is not None:
        stages.append(outputs_stage(parent, ctx, outputs))
    est = Estimate(stages, hw, model or str(prog.meta.get("source", "")), budget, left_out)
    if child is not None:
        est.child = (prog.param_counts(), child.param_counts())
    est.chosen = [(p, opts) for p, _, opts in picked.values() if opts]
    return est


def _walk(passes: list, last: bool = True):
    """(pass, whether it is in the last round) in the order the pass manager runs them: a `repeat{n}` body n
    times."""
    for p in passes:
        if getattr(p, "pass_name", "") == "repeat":
            for i in range(p.n):
                yield from _walk(p.body, last and i == p.n - 1)
        else:
            yield p, last
