"""Puzzle's architecture search as a mixed-integer program, solved with HiGHS (`scipy.optimize.milp`).

One binary per option (exactly one per layer) minimises the summed score under budgets on summed costs.
Rows are shifted by each layer's cheapest option and scaled to unit range, so byte counts (~1e11) and
seconds (~1e-3) meet HiGHS's absolute tolerances alike; every returned choice is re-checked against the
unscaled numbers, and one HiGHS accepts only within its tolerances is cut off and the search repeated.
"""
from __future__ import annotations

import ctypes
import math
import os
import sys
import time
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, linprog, milp
from scipy.sparse import csr_array, vstack

from ..core import PassError
from .mip_problem import Binding, Infeasible, Problem, Solution, TimedOut

#: relative slack when checking a choice against a bound: total <= limit * (1 + TOLERANCE)
TOLERANCE = 1e-9
#: largest objective coefficient handed to HiGHS, so its absolute gap (1e-6) is negligible
_OBJECTIVE_SCALE = 1e4
#: how many choices feasible only within HiGHS's tolerances are cut off before giving up
_RETRIES = 100
_STATUS = {0: "optimal", 1: "time limit", 2: "infeasible"}
_LIBC = ctypes.CDLL(None) if os.name == "posix" else None  # for fflush: HiGHS prints through C's stdio


class _Con(NamedTuple):
    """One constraint: kind "<=" / ">=" on a resource's sum, or "same" for a uniform group."""

    kind: str
    name: str


class _Run(NamedTuple):
    choice: np.ndarray | None
    status: str
    gap: float                  # absolute, in objective units
    seconds: float


def solve(problem: Problem, n_solutions: int = 1, min_distance: int = 1, time_limit: float = 60.0,
          mip_rel_gap: float = 1e-9, seconds: float = math.inf, beat: float | None = None) -> list[Solution]:
    """The best choice, then up to n_solutions - 1 next best ones, each differing from every earlier one in
    at least `min_distance` layers (Puzzle's diversity constraint). Fewer come back when no more exist, a
    later run times out without a solution, or the call has run `seconds` (runners-up are only sought
    within that budget). `time_limit` is in seconds per HiGHS run.
    With `beat` (a score found elsewhere, e.g. at another batch), only a first choice scoring below it is sought
    ([] when there is none): options the LP relaxation's reduced costs rule out are fixed first (`_beating`).
    Raises Infeasible (with a diagnosis) or TimedOut when there is no first solution."""
    if n_solutions < 1 or min_distance < 1:
        raise PassError(f"solve needs n_solutions >= 1 and min_distance >= 1, got {n_solutions}, {min_distance}")
    active = _constraints(problem)
    found: list[Solution] = []
    start = time.perf_counter()
    for _ in range(n_solutions):
        if found and time.perf_counter() - start >= seconds:
            break
        cuts = [(s.choice, problem.n_layers - min_distance) for s in found]
        run = _optimise(problem, problem.score, active, cuts, time_limit, mip_rel_gap, prune=not found,
                        beat=None if found else beat)
        if run.choice is None:
            if found or (beat is not None and run.status in ("infeasible", "none better")):
                break
            if run.status == "infeasible":
                raise _diagnose(problem, time_limit)
            raise TimedOut(f"HiGHS found no feasible choice in {time_limit} s ({run.status}); raise time_limit")
        objective = math.fsum(problem.score[run.choice])
        found.append(Solution(run.choice, objective, _totals(problem, run.choice), run.status,
                              float(run.gap / max(abs(objective), 1e-300)), run.seconds))
    return found


def lower_bound(problem: Problem) -> float | None:
    """The LP relaxation's optimum: no choice scores less (None when even the relaxation is infeasible). Used
    to skip problems that cannot beat a choice already found."""
    reduced, base = _reduce(problem, problem.score)
    top = reduced.max() if reduced.max() > 0 else 1.0
    c = np.zeros(problem._n_vars)
    c[:reduced.size] = reduced / top
    with _native_stdout_dropped():
        res = milp(c, integrality=np.zeros(problem._n_vars), bounds=Bounds(0, 1),
                   constraints=_rows(problem, _constraints(problem), []))
    return None if res.x is None else base + max(res.fun, 0.0) * top * (1 - 1e-9) - 1e-12 * abs(base)


def minimum(problem: Problem, resource: str, drop=(), time_limit: float = 60.0) -> float | None:
    """The least achievable sum of `resource` when every other constraint holds (its own limit is ignored,
    and so are all bounds and uniform groups named in `drop`); None when even that is infeasible."""
    if resource not in problem.costs:
        raise PassError(f"minimum: no costs for {resource!r}; known: {sorted(problem.costs)}")
    active = [c for c in _constraints(problem) if c != _Con("<=", resource) and c.name not in drop]
    return _extreme(problem, _Con("<=", resource), active, time_limit)


def _constraints(p: Problem) -> list[_Con]:
    """Uniform groups first: the conflict search drops earlier ones first, keeping budgets to blame."""
    return ([_Con("same", g) for g in p.uniform] + [_Con("<=", r) for r in p.limits]
            + [_Con(">=", r) for r in p.lower])


def _optimise(p: Problem, objective, active, cuts, time_limit, gap, prune: bool = True,
              beat: float | None = None) -> _Run:
    """Minimise `objective` under `active` and `cuts` (choice, most layers it may share); verified exactly.
    With `prune`, options another option of their layer dominates are fixed to 0 first (`_dominated`): the
    optimum stays, and HiGHS branches over far fewer (runners-up under diversity cuts are sought unpruned).
    With `beat`, so are the options no choice scoring below it can use (status "none better" if none can)."""
    t0 = time.perf_counter()
    cuts = list(cuts)
    reduced, base = _reduce(p, objective)
    top = reduced.max() if reduced.max() > 0 else 1.0
    c = np.zeros(p._n_vars)
    c[:reduced.size] = reduced / top * _OBJECTIVE_SCALE
    upper = np.ones(p._n_vars)
    if prune:
        upper[:reduced.size][_dominated(p, objective, active)] = 0.0
    if beat is not None:
        fixed = _beating(c, upper, _rows(p, active, cuts), (beat - base) / top * _OBJECTIVE_SCALE)
        if fixed is None:
            return _Run(None, "none better", math.inf, time.perf_counter() - t0)
        upper[fixed] = 0.0
    for _ in range(_RETRIES):
        with _native_stdout_dropped():
            res = milp(c, integrality=np.ones(p._n_vars), bounds=Bounds(0, upper), constraints=_rows(p, active, cuts),
                       options={"time_limit": time_limit, "mip_rel_gap": gap})
        status = _STATUS.get(res.status, res.message)
        if res.x is None:
            return _Run(None, status, math.inf, time.perf_counter() - t0)
        choice = np.array([m[np.argmax(res.x[m])] for m in p.members])
        if _meets_all(p, choice, active, cuts):
            gap = max(res.fun - res.mip_dual_bound, 0.0) * top / _OBJECTIVE_SCALE
            return _Run(choice, status, gap, time.perf_counter() - t0)
        cuts.append((choice, p.n_layers - 1))   # feasible only within HiGHS's tolerances: exclude, retry
    raise PassError(f"HiGHS returned {_RETRIES} choices that break the bounds in exact arithmetic; the costs or "
                    "bounds are numerically degenerate (e.g. near-zero cost differences)")


def _dominated(p: Problem, objective: np.ndarray, active) -> np.ndarray:
    """Options that another option of the same layer, with the same label in every active uniform group,
    matches or beats on the objective and on every active bound (less of a "<=" resource, more of a ">="
    one), strictly on one or, when equal on all, at a lower index: some optimum never needs them."""
    cols = [objective] + [p.costs[c.name] * (1.0 if c.kind == "<=" else -1.0) for c in active if c.kind != "same"]
    values = np.stack(cols, axis=1)
    labels = np.stack([p._codes[c.name] for c in active if c.kind == "same"] or [np.zeros(p.layer.size, np.int64)],
                      axis=1)
    out = np.zeros(p.layer.size, dtype=bool)
    for m in p.members:
        v, lab = values[m], labels[m]
        le = (v[:, None, :] <= v[None, :, :]).all(2) & (lab[:, None, :] == lab[None, :, :]).all(2)  # i beats j
        lt = (v[:, None, :] < v[None, :, :]).any(2) | np.tri(len(m), k=-1, dtype=bool).T
        np.fill_diagonal(le, False)
        out[m] = (le & lt).any(0)
    return out


def _beating(c: np.ndarray, upper: np.ndarray, rows: LinearConstraint, beat: float) -> np.ndarray | None:
    """Reduced-cost fixing: the LP relaxation's optimum z and each variable's reduced cost d_j at 0 bound every
    choice using j from below by z + d_j, so where that is not below `beat` j is of no use (a margin of 1e-7 of
    the objective's range against rounding keeps every doubtful j). None when even z is not below `beat`."""
    A = csr_array(rows.A)
    eq = rows.lb == rows.ub
    up, lo = ~eq & np.isfinite(rows.ub), ~eq & np.isfinite(rows.lb)
    with _native_stdout_dropped():
        res = linprog(c, A_ub=vstack([A[up], -A[lo]]) if (up | lo).any() else None,
                      b_ub=np.concatenate([rows.ub[up], -rows.lb[lo]]) if (up | lo).any() else None,
                      A_eq=A[eq] if eq.any() else None, b_eq=rows.ub[eq] if eq.any() else None,
                      bounds=np.stack([np.zeros_like(upper), upper], axis=1), method="highs")
    if res.status == 2:  # the relaxation is infeasible: so is every choice
        return None
    if res.status != 0:
        return np.zeros(c.size, dtype=bool)  # no reduced costs to trust: fix nothing
    margin = 1e-7 * max(_OBJECTIVE_SCALE, abs(beat))
    if res.fun >= beat + margin:
        return None
    return res.fun + res.lower.marginals >= beat + margin


@contextmanager
def _native_stdout_dropped():
    """HiGHS prints its own debugging lines (`HighsMipSolverData::...tmpSolver.run();`) to file descriptor 1
    itself, past sys.stdout: they would break a command's `--json` output and mean nothing to a user (the solve's
    outcome comes back in its result). During a solve, descriptor 1 points at the null device (C's buffers
    flushed first)."""
    sys.stdout.flush()
    saved, null = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.close(null)
        yield
    finally:
        if _LIBC is not None:
            _LIBC.fflush(None)
        os.dup2(saved, 1)
        os.close(saved)


def _extreme(p: Problem, con: _Con, active, time_limit) -> float | None:
    """The least ("<=") or most (">=") reachable sum of con's resource under `active`; None if infeasible."""
    sign = 1.0 if con.kind == "<=" else -1.0
    run = _optimise(p, sign * p.costs[con.name], active, (), time_limit, 1e-9)
    if run.choice is None:
        if run.status == "infeasible":
            return None
        raise TimedOut(f"HiGHS could not bound {con.name} in {time_limit} s ({run.status}); raise time_limit")
    return math.fsum(p.costs[con.name][run.choice])


def _feasible(p: Problem, active, time_limit) -> bool:
    run = _optimise(p, np.zeros(p.layer.size), active, (), time_limit, 1e-9)
    if run.choice is None and run.status != "infeasible":
        raise TimedOut(f"HiGHS could not decide feasibility in {time_limit} s ({run.status}); raise time_limit")
    return run.choice is not None


def _rows(p: Problem, active, cuts) -> LinearConstraint:
    """The constraint matrix, a block of rows at a time (arrays throughout: 88 layers x 32 options x a few
    uniform labels make thousands of rows, built for every problem of a batch search)."""
    blocks, n = [], 0

    def add(row, col, val, lb, ub):  # rows numbered from 0 within the block
        nonlocal n
        blocks.append((np.asarray(row, dtype=np.int64) + n, np.asarray(col, dtype=np.int64),
                       np.broadcast_to(np.asarray(val, dtype=np.float64), len(col)),
                       np.asarray(lb, dtype=np.float64), np.asarray(ub, dtype=np.float64)))
        n += len(blocks[-1][3])

    ones = np.ones(p.n_layers)
    add(p.layer, np.arange(p.layer.size), 1.0, ones, ones)  # exactly one option per layer
    for con in active:
        if con.kind == "same":
            _uniform_rows(p, con.name, add)
        else:
            _bound_row(p, con, add)
    for chosen, most in cuts:                            # share at most `most` layers with `chosen`
        add(np.zeros(len(chosen)), chosen, 1.0, [-np.inf], [most])
    rows, cols, vals, lo, hi = (np.concatenate(x) for x in zip(*blocks))
    return LinearConstraint(csr_array((vals, (rows, cols)), shape=(n, p._n_vars)), lo, hi)


def _bound_row(p: Problem, con: _Con, add):
    """sum cost <= / >= bound, shifted by the per-layer minima and scaled to a unit coefficient range, so
    the row's activity lies in [0, L]; clipping the right-hand side to [-1, L + 1] keeps its meaning."""
    reduced, base = _reduce(p, p.costs[con.name])
    scale = reduced.max() if reduced.max() > 0 else 1.0
    bound, slack = _bounds(p, con), TOLERANCE * abs(_bounds(p, con))
    with np.errstate(over="ignore"):                     # a tiny scale: +-inf, clipped just below
        rhs = np.float64(bound + slack - base if con.kind == "<=" else bound - slack - base) / scale
    rhs = float(np.clip(rhs, -1.0, p.n_layers + 1.0))
    nz = np.flatnonzero(reduced)
    add(np.zeros(nz.size), nz, reduced[nz] / scale, [-np.inf if con.kind == "<=" else rhs],
        [rhs if con.kind == "<=" else np.inf])


def _uniform_rows(p: Problem, g: str, add):
    """One binary y per label, sum y = 1; a layer's options with label k sum to y_k (at most y_k when the
    layer also has options outside the group, and every label gets its row in a layer wholly inside it)."""
    codes, y0, k = p._codes[g], p._y_start[g], len(p._labels[g])
    if k == 0:
        return
    add(np.zeros(k), np.arange(y0, y0 + k), 1.0, [1.0], [1.0])
    on = np.flatnonzero(codes >= 0)
    count = np.zeros((p.n_layers, k), dtype=np.int64)
    np.add.at(count, (p.layer[on], codes[on]), 1)
    inside = count.sum(1)
    full = inside == np.bincount(p.layer, minlength=p.n_layers)
    keep = (inside > 0)[:, None] & (full[:, None] | (count > 0))  # the (layer, label) rows, layer by layer
    number = np.full(keep.shape, -1)
    number[keep] = np.arange(int(keep.sum()))
    layers, labels = np.nonzero(keep)
    add(np.concatenate([number[p.layer[on], codes[on]], number[keep]]), np.concatenate([on, y0 + labels]),
        np.concatenate([np.ones(on.size), -np.ones(labels.size)]), np.where(full[layers], 0.0, -np.inf),
        np.zeros(labels.size))


def _reduce(p: Problem, values: np.ndarray) -> tuple[np.ndarray, float]:
    """values minus their layer's minimum, and the sum of those minima (exactly one option per layer)."""
    mins = np.full(p.n_layers, np.inf)
    np.minimum.at(mins, p.layer, values)
    return values - mins[p.layer], math.fsum(mins)


def _bounds(p: Problem, con: _Con) -> float:
    return p.limits[con.name] if con.kind == "<=" else p.lower[con.name]


def _meets(p: Problem, con: _Con, total: float) -> bool:
    bound = _bounds(p, con)
    slack = TOLERANCE * abs(bound)
    return total <= bound + slack if con.kind == "<=" else total >= bound - slack


def _meets_all(p: Problem, choice: np.ndarray, active, cuts) -> bool:
    """Whether the choice meets every constraint, checked on the unscaled numbers."""
    for con in active:
        if con.kind == "same":
            if len({c for c in p._codes[con.name][choice] if c >= 0}) > 1:
                return False
        elif not _meets(p, con, math.fsum(p.costs[con.name][choice])):
            return False
    return all(np.count_nonzero(choice == chosen) <= most for chosen, most in cuts)


def _totals(p: Problem, choice: np.ndarray) -> dict[str, float]:
    return {r: math.fsum(c[choice]) for r, c in p.costs.items()}


def _describe(p: Problem, con: _Con) -> str:
    return f"uniform {con.name}" if con.kind == "same" else f"{con.name} {con.kind} {_bounds(p, con):.6g}"


def _diagnose(p: Problem, time_limit: float) -> Infeasible:
    """Why nothing is feasible: uniform groups that cannot agree, bounds out of reach alone, or else a
    smallest set of constraints that conflict, with each bound's best value while the rest of the set holds."""
    groups = [c for c in _constraints(p) if c.kind == "same"]
    if not _feasible(p, groups, time_limit):
        conflict = _smallest_conflict(p, groups, time_limit)
        if len(conflict) == 1:
            message = f"no label of {_uniform_detail(p, conflict[0].name)}"
        else:
            message = f"uniform groups {', '.join(c.name for c in conflict)} cannot hold together (each can alone)"
        return Infeasible(message, conflict=[_describe(p, c) for c in conflict])
    budgets = [c for c in _constraints(p) if c.kind != "same"]
    alone = [b for b in (_binding(p, c, groups, time_limit) for c in budgets) if b]
    if alone:
        return Infeasible("no choice meets " + "; ".join(_say(b) for b in alone), binding=alone,
                          conflict=[_describe(p, _Con(b.sense, b.resource)) for b in alone])
    conflict = _smallest_conflict(p, _constraints(p), time_limit)
    binding = [b for c in conflict if c.kind != "same"
               if (b := _binding(p, c, [o for o in conflict if o != c], time_limit))]
    names = " and ".join(_describe(p, c) for c in conflict)
    return Infeasible(f"{names} cannot hold together (each can alone); with the others held, "
                      + "; ".join(_say(b) for b in binding), binding=binding,
                      conflict=[_describe(p, c) for c in conflict])


def _binding(p: Problem, con: _Con, active, time_limit) -> Binding | None:
    """The bound's best reachable value under `active`, when that value breaks it."""
    best = _extreme(p, con, active, time_limit)
    if best is not None and _meets(p, con, best):
        return None
    return Binding(con.name, best, _bounds(p, con), con.kind)


def _smallest_conflict(p: Problem, cons, time_limit) -> list[_Con]:
    """Deletion filter: drop each constraint whose removal leaves the rest infeasible; what stays conflicts
    and every proper subset of it is feasible."""
    keep = list(cons)
    for con in list(cons):
        rest = [c for c in keep if c != con]
        if not _feasible(p, rest, time_limit):
            keep = rest
    return keep


def _say(b: Binding) -> str:
    if b.best is None:
        return f"{b.resource}: unreachable with the other constraints"
    if b.sense == "<=":
        return f"{b.resource}: needs {b.best:.6g} at best, {b.bound:.6g} allowed"
    return f"{b.resource}: reaches {b.best:.6g} at most, {b.bound:.6g} required"


def _uniform_detail(p: Problem, g: str) -> str:
    """The labels offered by the layers that must take one of the group's labels."""
    codes, labels = p._codes[g], p._labels[g]
    offered = [f"layer {l}: {[labels[c] for c in np.unique(codes[m])]}" for l, m in enumerate(p.members)
               if (codes[m] >= 0).all()]
    shown = ", ".join(offered[:6]) + (", ..." if len(offered) > 6 else "")
    return f"uniform group {g} is offered by every layer that must take one ({shown})"
