"""The hardware-costed search: given a library, targets and a scenario, one variant per layer.

The deployment target comes first: every constraint becomes a budget on a sum of per-variant costs from
the cost model (decode step at a batch, prefill, weight and state bytes, parameters), minus the fixed part
outside the blocks (embedding, LM head, MTP head, per-step overhead). The MIP (passes/puzzle/mip.py)
minimises the summed replacement score. A throughput target X at the scenario's rate floor becomes a
decode-step budget at the batch that throughput needs: the parent serves B requests at step T (its
largest batch meeting the floor), so a child serving b requests needs a step of at most
min(b T / (X B), 1 / floor) with b requests in memory; b = ceil(X B) and b = B are both tried.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

import numpy as np

from ...backends.cost import CostModel, get_scenario
from ...ir import Program
from ..core import PassError
from .library import Library, variant_label
from .mip import Infeasible, Problem, Solution, TimedOut, solve

#: prior score weights per block kind, for weightless libraries (see `prior_score`)
PRIOR_WEIGHT = {"attention": 4.0, "mamba2": 2.0, "moe": 1.0, "mlp": 1.0}


@dataclass
class Constraints:
    """Deployment constraints; 0 or empty means "not constrained"."""

    speedup: float = 0.0  # server throughput >= speedup x the parent's, at the scenario's rate floor
    decode_ms: float = 0.0  # decode-step latency at batch 1
    prefill_s: float = 0.0  # prefill of the scenario's input at batch 1
    concurrency: int = 0  # requests that must fit in memory at `context` tokens each
    context: int = 0  # 0: the scenario's context length
    max_params: float = 0.0
    max_active: float = 0.0
    keep: tuple = ()  # block kinds kept intact, e.g. ("attention",)
    uniform: tuple = ()  # "kind.axis" sizes equal in every layer of that kind, e.g. ("mamba2.state",)


@dataclass
class Plan:
    """A chosen architecture with its predicted figures next to the parent's."""

    feasible: bool
    layers: list  # per layer: {"layer", "path", "id", "spec"}
    predicted: dict  # constraint -> the child's figure
    parent: dict  # constraint -> the parent's figure
    limits: dict  # constraint -> the bound it must meet
    params_total: int
    params_active: int
    objective: float
    score_source: str  # "measured <metric>" or "prior"
    status: str
    gap: float
    solve_seconds: float
    batch: int = 0  # the decode batch the throughput constraint was met at
    alternatives: list = field(default_factory=list)

    def to_json(self) -> dict:
        from dataclasses import asdict

        return asdict(self)


def prior_score(row: dict, parent_row: dict, layer: int, layers: int) -> float:
    """A stand-in score for weightless libraries: the squared share of the block removed (parameters and
    active parameters, half each), weighted per kind and more at the ends of the stack (the first and last
    layers are the most sensitive). Squared because measured KL grows about quadratically with the cut."""
    if row["id"] == "parent":
        return 0.0
    removed = 0.5 * (1 - row["params"] / parent_row["params"]) + \
        0.5 * (1 - row["active_params"] / max(parent_row["active_params"], 1))
    edge = abs(2 * layer / max(layers - 1, 1) - 1)
    return PRIOR_WEIGHT.get(parent_row["kind"], 1.0) * (1 + edge) * removed ** 2


class PlanError(PassError):
    """No architecture meets the constraints (the message names the binding one and the best reachable)."""


@dataclass
class Priced:
    """The MIP of one candidate batch: per constraint its per-option costs, bound, fixed part and the parent's
    figure (bounds and figures include the fixed part; the MIP's limits are net of it)."""

    costs: dict = field(default_factory=dict)
    bound: dict = field(default_factory=dict)
    fixed: dict = field(default_factory=dict)
    parent: dict = field(default_factory=dict)
    problem: Problem | None = None

    def add(self, name: str, per_option, fixed: float, bound: float, parent: float) -> None:
        self.costs[name], self.fixed[name], self.bound[name], self.parent[name] = per_option, fixed, bound, parent


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
    if "seconds" in resource:
        return f"{v * 1e3:.4g} ms"
    if "memory" in resource:
        return f"{v / 1e9:.4g} GB"
    return f"{v / 1e9:.4g}B"


class Search:
    """The options of a library priced on targets, ready for the MIP and the baselines."""

    def __init__(self, lib: Library, parent: Program, targets: list[tuple[str, str]], recipe: str = "",
                 metric: str = "kl", constraints: Constraints | None = None, provider=None,
                 scores: dict | None = None, fraction: float = 1.0, schedule: str = "geometric"):
        """`scores` ({(layer, id): scores}) restricts the options to those variants, scored anew (a later
        round of Iterative Puzzle); `fraction` < 1 moves every constraint only that part of the way from the
        parent's figure to its bound, on a `geometric` or `linear` schedule."""
        if schedule not in ("geometric", "linear"):
            raise PassError(f"schedule={schedule!r}: use geometric or linear")
        self.lib, self.parent, self.c = lib, parent, constraints or Constraints()
        self.fraction, self.schedule = fraction, schedule
        kind_of = {r["layer"]: r["kind"] for r in lib.rows if r["id"] == "parent"}
        rows = lib.rows if scores is None else \
            [{**r, "scores": scores[r["layer"], r["id"]]} for r in lib.rows if (r["layer"], r["id"]) in scores]
        self.rows = [r for r in rows if not (kind_of[r["layer"]] in self.c.keep and r["id"] != "parent")]
        unknown = [k for k in self.c.keep if k not in kind_of.values()]
        if unknown:
            raise PassError(f"keep={list(unknown)}: no layer of the library is of that kind")
        self.layer = np.array([r["layer"] for r in self.rows])
        self.specs = [lib.spec(r) for r in self.rows]
        self.parent_counts = parent.param_counts()
        self.parents = {r["layer"]: r for r in lib.rows if r["id"] == "parent"}
        self.score, self.score_source = self._scores(metric)
        self.uniform = {u: self._labels(u) for u in self.c.uniform}
        self.models = [CostModel(parent, t, get_scenario(s, recipe=recipe or None), provider=provider)
                       for t, s in targets]
        if fraction < 1:  # counts move here, bounds in `problem` (they need the parent's figures)
            base = self.models[0].report().max_concurrency if self.c.concurrency else 0
            self.c = dataclasses.replace(self.c, speedup=self._move(1.0, self.c.speedup, up=True) if self.c.speedup else 0.0,
                                         concurrency=math.ceil(self._move(max(base, 1), self.c.concurrency, up=True))
                                         if self.c.concurrency else 0)
        self.base = [cm.report() for cm in self.models] if self.c.speedup else []

    def _scores(self, metric: str) -> tuple[np.ndarray, str]:
        if self.lib.weightless:
            n = len(self.parents)
            return np.array([prior_score(r, self.parents[r["layer"]], r["layer"], n) for r in self.rows]), "prior"
        missing = [r for r in self.rows if metric not in r.get("scores", {})]
        if missing:
            known = sorted(self.rows[0].get("scores", {}))
            raise PassError(f"library {self.lib.path} has no {metric!r} score for variant {missing[0]['layer']}/"
                            f"{missing[0]['id']}; recorded: {known or 'none'}")
        return np.array([r["scores"][metric] for r in self.rows]), f"measured {metric}"

    def _labels(self, name: str) -> np.ndarray:
        kind, _, axis = name.partition(".")
        specs = self.specs
        known = {a for r, s in zip(self.rows, specs) if r["kind"] == kind for a in s.attrs()}
        if not axis or axis not in known or axis == "quant":
            raise PassError(f"uniform={name!r}: {kind or '?'} has no attribute {axis!r}; "
                            f"known: {', '.join(sorted(known - {'quant'})) or 'no layer of that kind'}")
        return np.array([getattr(s, axis) if r["kind"] == kind else None for r, s in zip(self.rows, specs)],
                        dtype=object)

    # -- costs ----------------------------------------------------------------------------------------------
    def costs(self, cm: CostModel, batch: int, context: int) -> tuple[dict, dict, dict]:
        """Per-option costs, the fixed part outside the blocks and the parent's blocks' total, for one target
        at one batch."""
        blocks = {n.path for n in self.parent.blocks()}
        cm.prepare([n.op for n in self.parent.nodes] + self.specs + [self.lib.spec(r) for r in self.parents.values()],
                   batch, context)
        fixed = {"decode_seconds": cm.step_overhead(), "prefill_seconds": cm.step_overhead(),
                 "serve_seconds": cm.step_overhead() * (1 + cm.prefill_share(batch))}
        for n in self.parent.nodes:
            if n.path not in blocks:
                for k, v in cm.node_costs(n.path, n.op, batch, context, cm.routing.get(n.path)).items():
                    if not (n.op.kind == "mtp" and "params" in k):  # parameter counts leave the MTP head out
                        fixed[k] = fixed.get(k, 0.0) + v
        per = [cm.node_costs(r["path"], spec, batch, context, cm.routing.get(r["path"]) if r["id"] == "parent" else None)
               for r, spec in zip(self.rows, self.specs)]
        parent = [cm.node_costs(r["path"], self.lib.spec(r), batch, context, cm.routing.get(r["path"]))
                  for r in self.parents.values()]
        return ({k: np.array([p[k] for p in per]) for k in per[0]}, fixed,
                {k: float(sum(p[k] for p in parent)) for k in per[0]})

    def problem(self, batch_of: list[int], c: Constraints | None = None) -> Priced:
        """The MIP for the given decode batch per target (under `c`, by default the search's constraints),
        with each constraint's bound, fixed part and parent figure."""
        pr, c = Priced(), c or self.c
        for t, (cm, batch) in enumerate(zip(self.models, batch_of)):
            tag = f"{cm.target.name}/{cm.scenario.name}"
            s = cm.scenario
            context = c.context or None  # None: the scenario's (full context for memory, mean for decode)
            opt, fixed, par = self.costs(cm, batch, context)
            usable = cm.usable_memory()  # the parent's reserve: a child's activation peak is no larger
            want = {}
            if c.speedup:
                base = self.base[t]
                if not base.max_batch:
                    raise PassError(f"{tag}: the parent itself cannot serve this scenario ({base.infeasible}); "
                                    "a throughput target relative to it is undefined")
                # throughput is batch / serving step (a decode step plus its share of prefills)
                budget = batch * base.serve_step_seconds / (c.speedup * base.max_batch)
                want["serve_seconds"] = (opt, fixed, par, "serve_seconds", min(budget, 1 / s.rate_floor)
                                         if s.rate_floor else budget)
                want["memory_bytes"] = self._memory(opt, fixed, par, requests=batch) + (usable,)
            if c.concurrency:
                want["memory_bytes"] = self._memory(opt, fixed, par, requests=c.concurrency) + (usable,)
            if c.decode_ms:
                o1, f1, p1 = (opt, fixed, par) if batch == 1 else self.costs(cm, 1, context)
                want["latency_seconds"] = (o1, f1, p1, "decode_seconds", c.decode_ms / 1e3)
            if c.prefill_s:
                want["prefill_seconds"] = (opt, fixed, par, "prefill_seconds", c.prefill_s)
            if t == 0:
                for key, bound in (("params", c.max_params), ("active_params", c.max_active)):
                    if bound:
                        want[key] = (opt, fixed, par, key, bound)
            for key, (o, f, p, col, bound) in want.items():
                name = f"{key}@{tag}" if len(self.models) > 1 and key not in ("params", "active_params") else key
                parent = p[col] + f[col]
                if key in self.MOVED:
                    bound = self._move(parent, bound)
                pr.add(name, o[col], f[col], bound, parent)
        pr.problem = Problem(self.layer, self.score, pr.costs, {k: pr.bound[k] - pr.fixed[k] for k in pr.costs},
                             uniform=self.uniform)
        return pr

    #: the largest decode batch tried: a far larger throughput target is infeasible in memory, and says so
    MAX_BATCH = 1 << 20
    #: bounds that move from the parent's figure toward the target over the rounds (memory is physical)
    MOVED = ("latency_seconds", "prefill_seconds", "params", "active_params")

    def _move(self, parent: float, final: float, up: bool = False) -> float:
        """The bound `fraction` of the way from the parent's figure to the final one (only when the parent
        does not already meet it): geometric (equal ratios per round) or linear."""
        f = self.fraction
        if f >= 1 or (final <= parent if up else final >= parent) or parent <= 0:
            return final
        return parent * (final / parent) ** f if self.schedule == "geometric" else parent + f * (final - parent)

    @staticmethod
    def _memory(*parts, requests: int):
        """Weights plus `requests` requests' state (compared with the memory left after the workspace reserve),
        for each of the options, the fixed part and the parent."""
        return (*({"memory": p["weight_bytes"] + requests * p["state_bytes"]} for p in parts), "memory")

    # -- solving --------------------------------------------------------------------------------------------
    def batches(self) -> list[list[int]]:
        """Decode batches to try per target: ceil(X B) and B (the parent's), or 1 without a throughput target."""
        if not self.c.speedup:
            return [[1] * len(self.models)]
        base = [b.max_batch or 1 for b in self.base]
        options = [sorted({max(1, math.ceil(min(self.c.speedup * b, self.MAX_BATCH))), b}) for b in base]
        return [list(x) for x in np.array(np.meshgrid(*options)).T.reshape(-1, len(self.models))]

    def plan(self, method: str = "mip", alternatives: int = 1, min_distance: int = 1,
             time_limit: float = 60.0, alternatives_seconds: float = 60.0) -> Plan:
        """The best choice over the candidate batches: by the MIP (with up to `alternatives` - 1 diverse
        runners-up at the best batch, sought for at most `alternatives_seconds`), or by a baseline
        (`uniform`, `greedy`)."""
        if method not in ("mip", *BASELINES):
            raise PassError(f"unknown search method {method!r}; known: mip, {', '.join(BASELINES)}")
        start, best, failed = time.perf_counter(), None, None
        for batch in self.batches():
            pr = self.problem(batch)
            if method == "mip":
                try:
                    sols = solve(pr.problem, 1, time_limit=time_limit)
                except Infeasible as e:
                    failed = failed or (e, pr)
                    continue
            else:
                choice = BASELINES[method](self, pr)
                if choice is None:
                    continue
                choice = np.array(choice)
                sols = [Solution(choice, float(self.score[choice].sum()),
                                 {k: float(v[choice].sum()) for k, v in pr.costs.items()}, method, 0.0, 0.0)]
            if best is None or sols[0].objective < best[0][0].objective:
                best = (sols, pr, batch)
        if best is None:
            if failed:
                raise PlanError(explain(*failed) + self._fitting(failed[0])) from None
            raise PlanError(f"the {method} baseline finds no architecture that meets the constraints")
        sols, pr, batch = best
        if method == "mip" and alternatives > 1:
            sols = solve(pr.problem, alternatives, min_distance, time_limit, seconds=alternatives_seconds)
        seconds = time.perf_counter() - start
        plans = [self._plan(s, pr, int(batch[0]), seconds) for s in sols]
        plans[0].alternatives = [p.to_json() for p in plans[1:]]
        return plans[0]

    def _fitting(self, e: Infeasible) -> str:
        """With a concurrency target out of reach in memory: how many requests do fit (found by solving)."""
        if not self.c.concurrency or not any(b.resource.startswith("memory") for b in e.binding):
            return ""
        lo, hi = 0, self.c.concurrency - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            try:
                solve(self.problem(self.batches()[0], dataclasses.replace(self.c, concurrency=mid)).problem)
                lo = mid
            except (Infeasible, TimedOut):
                hi = mid - 1
        return f"\n  {lo} requests fit"

    def _plan(self, sol, pr: Priced, batch: int, seconds: float) -> Plan:
        rows = [self.rows[i] for i in sol.choice]
        counts = self.parent_counts.copy()
        for r in rows:  # the child's counts: the parent's with each layer's block swapped
            for k, key in (("total", "params"), ("active", "active_params")):
                counts[k] += r[key] - self.parents[r["layer"]][key]
        return Plan(True, [{"layer": r["layer"], "path": r["path"], "id": r["id"], "label": variant_label(r),
                            "spec": r["spec"]} for r in rows],
                    {k: sol.totals[k] + pr.fixed[k] for k in pr.costs}, pr.parent, pr.bound, counts["total"],
                    counts["active"], sol.objective, self.score_source, sol.status, sol.gap, seconds, batch)

    def throughput_ratio(self, plan: Plan) -> float:
        """The child's predicted throughput over the parent's on the first target (0 without a speedup target)."""
        key = next((k for k in plan.predicted if k.startswith("serve_seconds")), None)
        if not self.base or key is None:
            return 0.0
        base = self.base[0]
        return (plan.batch / plan.predicted[key]) / (base.max_batch / base.serve_step_seconds)

    def child(self, rows: list[dict], weights: bool = False) -> Program:
        """The parent with each layer replaced by its chosen variant (shapes only, or with its library weights)."""
        return realise(self.parent.copy(), self.lib, rows, weights)

    def rows_of(self, plan: Plan) -> list[dict]:
        by = {(r["layer"], r["id"]): r for r in self.lib.rows}
        return [by[p["layer"], p["id"]] for p in plan.layers]


def realise(prog: Program, lib: Library, rows: list[dict], weights: bool = True) -> Program:
    """Rewrites each chosen layer of `prog` in place to its variant: spec and (BLD-trained) weights together.
    Measured routing frequencies of changed layers no longer apply and are dropped."""
    for r in rows:
        if r["id"] == "parent":
            continue
        spec = lib.spec(r)
        w = lib.weights(r, lazy=True) if weights else {k: _meta(s) for k, s in spec.stored_params().items()}
        prog.rewrite(prog.node(r["path"]), op=spec, weights=w)
        prog.meta.get("routing", {}).pop(r["path"], None)
    return prog


def _meta(shape):
    import torch

    return torch.empty(shape, device="meta")


# -- baselines --------------------------------------------------------------------------------------------------
def meets(pr: Priced, choice) -> bool:
    return all(pr.costs[k][choice].sum() <= pr.bound[k] - pr.fixed[k] + 1e-12 * abs(pr.bound[k]) for k in pr.costs)


def uniform_choice(search: Search, pr: Priced) -> list[int] | None:
    """Minitron-style: the same share of parameters kept in every layer (no replacements), the largest share
    that meets the constraints. Per layer, the variant with the largest share not above it."""
    rows = search.rows
    share = np.array([r["params"] / max(search.parents[r["layer"]]["params"], 1) for r in rows])
    sliced = np.array([not r["replacement"] for r in rows])
    for level in sorted(set(share[sliced].round(9)), reverse=True):
        choice = []
        for members in pr.problem.members:
            ok = [i for i in members if sliced[i] and share[i] <= level + 1e-9]
            if not ok:
                break
            choice.append(max(ok, key=lambda i: (share[i], -i)))
        else:
            if meets(pr, np.array(choice)):
                return choice
    return None


def greedy_choice(search: Search, pr: Priced) -> list[int] | None:
    """From the parent, repeatedly take the single-layer change with the least score added per unit of the
    most violated resource saved, until every constraint holds."""
    score, p = search.score, pr.problem
    choice = np.array([next((i for i in m if search.rows[i]["id"] == "parent"), min(m, key=lambda i: score[i]))
                       for m in p.members])  # the parent, or in a later round the least damaging option
    while not meets(pr, choice):
        over = {k: pr.costs[k][choice].sum() / max(pr.bound[k] - pr.fixed[k], 1e-30) for k in pr.costs}
        k = max(over, key=over.get)
        best, move = math.inf, None
        for layer, members in enumerate(p.members):
            cur = choice[layer]
            for i in members:
                saved = pr.costs[k][cur] - pr.costs[k][i]
                if saved > 0 and (score[i] - score[cur]) / saved < best:
                    best, move = (score[i] - score[cur]) / saved, (layer, i)
        if move is None:
            return None
        choice[move[0]] = move[1]
    return choice.tolist()


BASELINES = {"uniform": uniform_choice, "greedy": greedy_choice}
