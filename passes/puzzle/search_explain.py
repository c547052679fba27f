"""Why the search (search.py) found nothing, in the user's terms: the solver's diagnosis in each constraint's
own units (`explain`), how many requests would fit when a concurrency target is out of reach in memory
(`fitting`, found by solving), and what lifts an engine profile's rules (`lifting`). Apart from `Search` because
they only read a failed problem and the constraints, and only run once the branch and bound has failed.
"""
from __future__ import annotations

import dataclasses

from .mip import Infeasible, TimedOut, solve
from .search_types import Constraints, Priced


def explain(e: Infeasible, pr: Priced) -> str:
    """The solver's diagnosis in the constraint's own units (fixed part added back)."""
    lines = []
    for b in e.binding:
        f = pr.fixed.get(b.resource, 0.0)
        best = "nothing" if b.best is None else _fmt(b.resource, b.best + f)
        lines.append(f"{b.resource}: needs {best} at best, {_fmt(b.resource, b.bound + f)} allowed "
                     f"(the parent: {_fmt(b.resource, pr.parent[b.resource])})")
    if e.conflict:
        lines.append("these cannot be met together: " + ", ".join(c.split(" ")[0] for c in e.conflict))
    return "infeasible: no architecture meets the constraints:\n  " + "\n  ".join(lines or [str(e)])


def _fmt(resource: str, v: float) -> str:
    if "layers" in resource:
        return f"{v:.0f} layers"
    if "seconds" in resource:
        return f"{v * 1e3:.4g} ms"
    if "memory" in resource:
        return f"{v / 1e9:.4g} GB"
    return f"{v / 1e9:.4g}B"


def lifting(engine) -> str:
    """Under an engine profile: that its rules are part of what could not be met, and what lifts them."""
    if engine.name == "none":
        return ""
    return (f"\n  (under the engine profile {engine.name!r}, whose rules are part of the constraints: "
            "engine=none lifts them (--engine none, and --extended on compress), for a child no serving engine "
            "loads)")


def fitting(e: Infeasible, constraints: Constraints, roots, problem) -> str:
    """With a concurrency target out of reach in memory: how many requests do fit (found by solving, over the
    layouts and batches `roots()` and the problems `problem(spans, c)`)."""
    if not constraints.concurrency or not any(b.resource.startswith("memory") for b in e.binding):
        return ""
    lo, hi = 0, constraints.concurrency - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        c = dataclasses.replace(constraints, concurrency=mid)
        fits = False
        for spans in roots():
            try:
                solve(problem(tuple((li, b1, b1) for li, b1, _ in spans), c).problem)
                fits = True
                break
            except (Infeasible, TimedOut):
                pass
        lo, hi = (mid, hi) if fits else (lo, mid - 1)
    return f"\n  {lo} requests fit"
