"""The hardware-costed search: given a library, targets and a scenario, one variant per layer.

The deployment target comes first: every constraint becomes a named row, a budget on a sum of per-variant
costs from the cost model (serving step at a batch, prefill, one device's weight and state bytes,
parameters), minus the fixed part outside the blocks (embedding, LM head, MTP head, per-step overhead). The
MIP (passes/puzzle/mip.py) minimises the summed replacement score. A throughput target X becomes a budget
on the serving step at each batch b per replica: the child's replicas x b x tokens per step / step must reach
X times the parent's throughput in its best layout, with b requests in memory on each device and the rate
floor met. Every layout and every batch is searched, exactly, by branch and bound (`Search.plan`).

This module holds `Search` (the options priced on the targets, the MIP per span of layouts and batches, and the
branch and bound over them) and `realise`; its parts live in sibling modules, re-exported here: the records
(search_types.py), the options' scores and labels (search_options.py), the rows (search_rows.py), the batch
ranges (search_batches.py), the explanations of infeasibility (search_explain.py) and the baselines
(search_baselines.py).
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import time

import numpy as np

from ...backends.cost import CostModel, Scenario, best_layout, get_scenario, layouts_of
from ...backends.cost.model import shared_provider
from ...backends.cost.prices import describe
from ...backends.targets import get_target
from ...ir import Program
from ..core import PassError
from .engines import DEFAULT_ENGINE, EngineProfile, get_engine
from .library import Library, variant_label
from .mip import Infeasible, Problem, Solution, TimedOut, lower_bound, solve  # noqa: F401 (TimedOut: re-exported)
from .search_baselines import BASELINES, _moved, greedy_choice, meets, solve_by, uniform_choice  # noqa: F401
from .search_batches import MAX_BATCH, admitting, batch_spans, grid, split
from .search_explain import _fmt, explain, fitting, lifting  # noqa: F401
from .search_options import PRIOR_WEIGHT, option_scores, prior_score, refused, uniform_labels  # noqa: F401
from .search_rows import MOVED, move, price, target_rows
from .search_types import Constraints, Plan, PlanError, Priced, Row, _total  # noqa: F401


class Search:
    """The options of a library priced on targets, ready for the MIP and the baselines."""

    def __init__(self, lib: Library, parent: Program, targets: list[tuple], recipe: str = "",
                 metric: str = "kl", constraints: Constraints | None = None, provider=None,
                 scores: dict | None = None, fraction: float = 1.0, schedule: str = "geometric",
                 engine: str | EngineProfile = DEFAULT_ENGINE, prices: str | None = None):
        """`targets`: (target, scenario name or Scenario) pairs. `scores` ({(layer, id): scores}) restricts the
        options to those variants, scored anew (a later round of Iterative Puzzle); `fraction` < 1 moves every
        constraint only that part of the way from the parent's figure to its bound, on a `geometric` or
        `linear` schedule. `engine` names the profile (engines.py) whose rules the child must meet to be served;
        its tables price the GPU targets where `prices` (auto, tables, analytic: backends/cost/prices.py) allows."""
        if schedule not in ("geometric", "linear"):
            raise PassError(f"schedule={schedule!r}: use geometric or linear")
        self.lib, self.parent, self.c = lib, parent, constraints or Constraints()
        self.fraction, self.schedule = fraction, schedule
        self.engine = get_engine(engine)
        self.engine.check_parent(parent)
        self.parents = {r["layer"]: r for r in lib.rows if r["id"] == "parent"}
        kind_of = {layer: r["kind"] for layer, r in self.parents.items()}
        recipes = " ".join(self._scenario(sc, recipe).recipe or "" for _, sc in targets)  # NVFP4 kernel rules
        rows = lib.rows if scores is None else \
            [{**r, "scores": scores[r["layer"], r["id"]]} for r in lib.rows if (r["layer"], r["id"]) in scores]
        head = next((n.op for n in parent.find("mtp")), None)
        self.rows = [r for r in rows if not (kind_of[r["layer"]] in self.c.keep and r["id"] != "parent")
                     and not self.engine.refusal(lib.spec(r), lib.spec(self.parents[r["layer"]]), recipes, head)]
        unknown = [k for k in self.c.keep if k not in kind_of.values()]
        if unknown:
            raise PassError(f"keep={list(unknown)}: no layer of the library is of that kind")
        self.layer = np.array([r["layer"] for r in self.rows])
        self.specs = [lib.spec(r) for r in self.rows]
        self.parent_counts = parent.param_counts()
        self.score, self.score_source = option_scores(lib, self.rows, self.parents, metric)
        groups = dict.fromkeys(self.c.uniform + self.engine.uniform_groups(set(kind_of.values())))
        self.uniform = {u: uniform_labels(self.rows, self.specs, u) for u in groups}
        self.scenarios = [self._scenario(s, recipe) for _, s in targets]
        hardware = [get_target(t) if isinstance(t, str) else t for t, _ in targets]
        # the child in every layout of each target's GPUs (or the one pinned) that the engines can split a child
        # over, drafting as its head accepts
        self.recipes, self._unsplit_memo = recipes, {}
        self.models = []
        providers = [shared_provider(t, provider, prices, self.engine.name) for t in hardware]
        self.prices = [describe(p) for p in providers]
        for t, s, provider in zip(hardware, self.scenarios, providers):
            every = layouts_of(t, s, parent)
            why = {str(L): self._no_child_splits(L) for L in every}
            if all(why.values()):
                raise PassError(f"engine {self.engine.name}: no layout of {t.name} splits the model as the engines "
                                f"do ({'; '.join(f'{k}: {v}' for k, v in why.items())}); use engine none")
            self.models.append([CostModel(parent, t, self._child(s), provider, layout=L)
                                for L in every if not why[str(L)]])
        need_base = self.c.speedup or (fraction < 1 and self.c.concurrency)
        # the parent's throughput in the best layout the engines split all of it over
        whole = refused(self.engine, (n.op for n in parent.nodes), self.recipes)
        self.base = [best_layout(parent, t, s, p, fits=lambda L: not whole(L))[1]
                     for t, s, p in zip(hardware, self.scenarios, providers)] if need_base else []
        if fraction < 1:  # counts move here, bounds in `problem` (they need the parent's figures)
            base = self.base[0].max_concurrency if self.c.concurrency else 0
            self.c = dataclasses.replace(self.c, speedup=self._move(1.0, self.c.speedup, up=True) if self.c.speedup else 0.0,
                                         concurrency=math.ceil(self._move(max(base, 1), self.c.concurrency, up=True))
                                         if self.c.concurrency else 0)
        self._costs: dict = {}
        self._alone: dict = {}  # (target, span) -> that target's rows' relaxation bound, per plan

    def _no_child_splits(self, layout) -> str:
        """Why the engines split no child over `layout` (a part outside the blocks, or a layer none of whose
        options splits), or ""."""
        blocks = {n.path for n in self.parent.blocks()}
        why = refused(self.engine, (n.op for n in self.parent.nodes if n.path not in blocks), self.recipes)(layout)
        off = self._unsplit(layout)
        stuck = next((layer for layer in dict.fromkeys(self.layer.tolist()) if off[self.layer == layer].all()), None)
        if not why and stuck is not None:
            why = f"layer {stuck}: " + self.engine.unsplit(self.lib.spec(self.parents[stuck]), layout, self.recipes)
        return why

    def _unsplit(self, layout) -> np.ndarray:
        """Per option: 1 where the engines do not split it over `layout`."""
        key = str(layout)
        if key not in self._unsplit_memo:
            self._unsplit_memo[key] = np.array([float(bool(self.engine.unsplit(sp, layout, self.recipes)))
                                                for sp in self.specs])
        return self._unsplit_memo[key]

    def _scenario(self, s, recipe: str) -> Scenario:
        """The target's scenario, with one context for parent and child when the constraints name one."""
        sc = s if isinstance(s, Scenario) else get_scenario(s, recipe=recipe or None)
        if recipe and not sc.recipe:
            sc = dataclasses.replace(sc, recipe=recipe)
        return dataclasses.replace(sc, context=self.c.context) if self.c.context else sc

    def _child(self, s: Scenario) -> Scenario:
        a = self.c.mtp_acceptance
        if a and not s.mtp_draft:
            raise PassError("mtp_acceptance for the child needs speculative decoding in the scenario (mtp_draft)")
        return dataclasses.replace(s, mtp_acceptance=a) if a else s

    # -- costs ----------------------------------------------------------------------------------------------
    def costs(self, cm: CostModel, batch: int) -> tuple[dict, dict, dict]:
        """Per-option costs, the fixed part outside the blocks and the parent's blocks' total, for one target
        and layout at one batch per replica (memoised: the search revisits batches)."""
        key = (id(cm), batch)
        if key not in self._costs:
            self._costs[key] = price(cm, batch, self.parent, self.lib, self.rows, self.specs, self.parents)
        return self._costs[key]

    def problem(self, spans, c: Constraints | None = None) -> Priced:
        """The MIP over `spans` (per target: layout index, b1, b2) under `c` (by default the search's
        constraints), with each constraint's bound, fixed part and parent figure. Over b1..b2 the rows hold what
        every batch in the range implies: the serving budget of the throughput target at b2 (serving time per
        request falls as the batch grows), the rate floor and the memory at b1 (they only tighten)."""
        pr, c = Priced(spans=tuple(spans)), c or self.c
        for t, span in enumerate(spans):
            pr.rows.update(self._rows(t, span, c))
        pr.problem = Problem(self.layer, self.score, pr.costs, {k: r.bound - r.fixed for k, r in pr.rows.items()},
                             uniform=self.uniform)
        return pr

    def _rows(self, t: int, span: tuple, c: Constraints, only=None) -> dict:
        """One target's rows over its span (layout index, b1, b2); with `only` (option indices), their costs
        for those options alone, in that order (what checking one choice needs)."""
        costs, unsplit, rows = self.costs, self._unsplit, self.rows
        if only is not None:
            costs = lambda cm, b: price(cm, b, self.parent, self.lib, self.rows, self.specs, self.parents, only)  # noqa: E731
            unsplit, rows = (lambda L: self._unsplit(L)[only]), [self.rows[i] for i in only]
        return target_rows(self.models[t][span[0]], span, c, first=t == 0, multi=len(self.models) > 1,
                           base=self.base[t] if self.base else None, costs=costs, unsplit=unsplit,
                           rows=rows, move=self._move)

    #: the largest decode batch per replica tried (search_batches.py)
    MAX_BATCH = MAX_BATCH
    #: problems solved over the batch ranges at most; stopping early reports the gap left (Plan.gap)
    MAX_SOLVES = 64
    #: a batch range is searched only while its bound is below the best found by more than this (relative)
    GAP = 1e-6
    #: a batch range wider than this (largest over smallest batch) is halved rather than solved: its
    #: relaxation is too loose for a MIP's choice to be admitted at one of its batches
    WIDE = 1.05
    #: bounds that move from the parent's figure toward the target over the rounds (search_rows.py)
    MOVED = MOVED

    def _move(self, parent: float, final: float, up: bool = False) -> float:
        """The bound `fraction` of the way from the parent's figure to the final one, on the search's schedule."""
        return move(parent, final, self.fraction, self.schedule, up)

    # -- the batches ------------------------------------------------------------------------------------------
    def spans(self) -> list[tuple]:
        """Where to look, per target: every layout with the batches per replica that can meet the throughput
        target (one batch, 1, without one). The analytic providers price a range b1..b2 (whole multiples of the
        attention groups); a measured provider only batches it times, each alone: the parent's, the target's
        (the speedup times the parent's) and the powers of two between them. `self.nearest` keeps, per target,
        one batch to diagnose an infeasible target at (the largest that fits, when none can meet it)."""
        roots, self.nearest = batch_spans(self.models, self.c.speedup, self.base, self.costs, self.layer, self.parent,
                                          self.MAX_BATCH)
        return roots

    # -- solving --------------------------------------------------------------------------------------------
    def plan(self, method: str = "mip", alternatives: int = 1, min_distance: int = 1,
             time_limit: float = 60.0, alternatives_seconds: float = 60.0, batch_seconds: float = 300.0) -> Plan:
        """The best choice over every layout and batch: by the MIP (with up to `alternatives` - 1 diverse
        runners-up at the best one, sought for at most `alternatives_seconds`), or by a baseline (`uniform`,
        `greedy`, tried at each layout's power-of-two batches). Once a choice is found, the batch search stops
        after MAX_SOLVES problems or `batch_seconds` and reports the gap left (`Plan.gap`, status).

        The MIP's batch is exact, by branch and bound over batch ranges: a range's relaxed problem (`problem`)
        admits every choice that some batch in the range admits, so its optimum bounds the range from below.
        When that optimum's choice meets the exact rows at one of the range's batches, no batch in the range
        does better; otherwise the range is halved. A range wider than WIDE is halved before any MIP (its LP
        relaxation's bound is what orders and drops it). Ranges whose bound cannot beat the best found are
        dropped."""
        if method not in ("mip", *BASELINES):
            raise PassError(f"unknown search method {method!r}; known: mip, {', '.join(BASELINES)}")
        start, best, failed = time.perf_counter(), None, None
        heap, order = [], itertools.count()
        self._alone = {}  # its bounds follow the constraints, which a sweep changes between plans
        roots = self.spans()
        # the ranges and single batches of them (their ends and middle; the baselines try only these, at
        # power-of-two batches too), each keyed by a bound that is cheap to know (`_key`) and evaluated (its own
        # relaxation's bound) only when it comes to the top: most are dropped unevaluated once a choice is found
        for spans in roots if method == "mip" else [s for spans in roots for s in grid(self.models, spans)]:
            key = self._key(spans)
            if key is not None:
                heapq.heappush(heap, (key, next(order), spans, len(self.models) == 1))
            elif all(b1 == b2 for _, b1, b2 in spans):  # a batch no choice meets: the diagnosis if none is found
                failed = failed or self._failure(spans, time_limit)
        solved = 0
        while heap:
            bound, _, spans, evaluated = heapq.heappop(heap)
            if best is not None and bound >= best[0][0].objective - self.GAP * abs(best[0][0].objective):
                continue
            if best is not None and (solved >= self.MAX_SOLVES or time.perf_counter() - start > batch_seconds):
                heapq.heappush(heap, (bound, next(order), spans, evaluated))
                break
            if not evaluated:  # its own relaxation's bound, at least the one it was keyed by
                low = lower_bound(self.problem(spans).problem)
                if low is not None:
                    heapq.heappush(heap, (max(bound, low), next(order), spans, True))
                elif all(b1 == b2 for _, b1, b2 in spans):
                    failed = failed or self._failure(spans, time_limit)
                continue
            if method == "mip" and self._wide(spans):  # a loose relaxation: halve it before any MIP
                self._push_halves(heap, order, spans, bound)
                continue
            solved += 1
            pr = self.problem(spans)
            sols = solve_by(self, method, pr, time_limit,
                            None if best is None else best[0][0].objective - self.GAP * abs(best[0][0].objective))
            if isinstance(sols, Infeasible):
                failed = failed if failed and isinstance(failed[0], Infeasible) else (sols, pr)
                continue
            if not sols or (best is not None and sols[0].objective >= best[0][0].objective):
                continue
            exact = pr if pr.exact else admitting(self.models, sols[0].choice, spans, self._rows, self.c, self.problem)
            if exact is not None:
                best = (sols, exact)
            else:  # no batch of the range admits a better choice than this one
                self._push_halves(heap, order, spans, max(bound, sols[0].objective))
        if best is None:
            near = None if None in self.nearest else tuple((li, b, b) for li, b, _ in self.nearest)
            if not (failed and isinstance(failed[0], Infeasible) and failed[1].exact) and near:  # one batch's
                pr = self.problem(near)
                e = solve_by(self, "mip", pr, time_limit)
                failed = (e, pr) if isinstance(e, Infeasible) else failed
            if failed and isinstance(failed[0], Infeasible):
                raise PlanError(explain(*failed) + fitting(failed[0], self.c, self.spans, self.problem)
                                + lifting(self.engine)) from None
            raise PlanError(f"the {method} baseline finds no architecture that meets the constraints" if near else
                            "no layout of the target holds the model's smallest variant and one request in memory")
        sols, pr = best
        open_bound = min((b for b, *_ in heap), default=math.inf)
        left = max(0.0, (sols[0].objective - open_bound) / max(abs(sols[0].objective), 1e-300))
        status = sols[0].status if left <= self.GAP else f"batch search stopped after {solved} solves"
        sols = [Solution(s.choice, s.objective, {k: math.fsum(v[s.choice]) for k, v in pr.costs.items()},
                         status if i == 0 else s.status, max(s.gap, left) if i == 0 else s.gap, s.seconds)
                for i, s in enumerate(sols)]  # the totals at the batch chosen, and what the batch search left
        if method == "mip" and alternatives > 1:
            sols = solve(pr.problem, alternatives, min_distance, time_limit, seconds=alternatives_seconds)
        seconds = time.perf_counter() - start
        plans = [self._plan(s, pr, seconds) for s in sols]
        plans[0].alternatives = [p.to_json() for p in plans[1:]]
        return plans[0]

    def _wide(self, spans) -> bool:
        """Whether some target's batch range is wider (by ratio) than WIDE and can still be halved."""
        return any(b2 > b1 * self.WIDE and b2 - b1 >= 2 * self.models[t][li].layout.dp
                   for t, (li, b1, b2) in enumerate(spans))

    def _key(self, spans) -> float | None:
        """A lower bound of the problem over `spans` that is cheap to know (None: nothing there is feasible).
        With one target, its relaxation's bound; with several, the largest of each target's alone (memoised
        per target and span, so the combinations of layouts, which grow as their product, cost no more LPs)."""
        if len(self.models) == 1:
            return lower_bound(self.problem(spans).problem)
        lows = []
        for t, span in enumerate(spans):
            if (t, span) not in self._alone:
                rows = self._rows(t, span, self.c)
                costs, limits = {k: r.costs for k, r in rows.items()}, {k: r.bound - r.fixed for k, r in rows.items()}
                self._alone[t, span] = lower_bound(Problem(self.layer, self.score, costs, limits, uniform=self.uniform))
            lows.append(self._alone[t, span])
        return None if None in lows else max(lows)

    def _push_halves(self, heap, order, spans, floor: float) -> None:
        """Each half of `spans`, unevaluated, keyed by `floor` (what bounds the whole range) or, with several
        targets, by each target's own bound when larger (a half none of whose choices is feasible is dropped)."""
        for half in split(self.models, spans):
            key = self._key(half) if len(self.models) > 1 else floor
            if key is not None:
                heapq.heappush(heap, (max(floor, key), next(order), half, False))

    def _failure(self, spans, time_limit: float) -> tuple:
        """The diagnosis of a single batch no choice meets, with its problem."""
        pr = self.problem(spans)
        return solve_by(self, "mip", pr, time_limit), pr

    def _plan(self, sol, pr: Priced, seconds: float) -> Plan:
        rows = [self.rows[i] for i in sol.choice]
        counts = self.parent_counts.copy()
        for r in rows:  # the child's counts: the parent's with each layer's block swapped
            for k, key in (("total", "params"), ("active", "active_params")):
                counts[k] += r[key] - self.parents[r["layer"]][key]
        li, b, _ = pr.spans[0]
        cm = self.models[0][li]
        return Plan(True, [{"layer": r["layer"], "path": r["path"], "id": r["id"], "label": variant_label(r),
                            "spec": r["spec"]} for r in rows],
                    {k: sol.totals[k] + pr.fixed[k] for k in pr.costs}, pr.parent, pr.bound, counts["total"],
                    counts["active"], sol.objective, self.score_source, sol.status, sol.gap, seconds,
                    b * cm.layout.replicas, layout=str(cm.layout),
                    layouts=[str(self.models[t][i].layout) for t, (i, _, _) in enumerate(pr.spans)],
                    prices=self.prices)

    def throughput_ratio(self, plan: Plan) -> float:
        """The child's predicted throughput over the parent's on the first target (0 without a speedup target)."""
        key = next((k for k in plan.predicted if k.startswith("serve_seconds")), None)
        if not self.base or key is None:
            return 0.0
        cm = next(m for m in self.models[0] if str(m.layout) == plan.layout)
        return plan.batch * cm.tokens_per_step / plan.predicted[key] / self.base[0].throughput_tokens_per_second

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
