"""The hardware-costed search: given a library, targets and a scenario, one variant per layer.

The deployment target comes first: every constraint becomes a named row, a budget on a sum of per-variant
costs from the cost model (serving step at a batch, prefill, one device's weight and state bytes,
parameters), minus the fixed part outside the blocks (embedding, LM head, MTP head, per-step overhead). The
MIP (passes/puzzle/mip.py) minimises the summed replacement score. A throughput target X becomes a budget
on the serving step at each batch b per replica: the child's replicas x b x tokens per step / step must reach
X times the parent's throughput in its best layout, with b requests in memory on each device and the rate
floor met. Every layout and every batch is searched, exactly, by branch and bound (`Search.plan`).
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import time
from dataclasses import dataclass, field

import numpy as np

from ...backends.cost import CostModel, Scenario, best_layout, get_scenario, layouts_of
from ...backends.targets import get_target
from ...ir import Program
from ..core import PassError
from .engines import DEFAULT_ENGINE, EngineProfile, get_engine
from .library import Library, variant_label
from .mip import Infeasible, Problem, Solution, TimedOut, lower_bound, solve

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
    mtp_acceptance: float = 0.0  # the child's head's acceptance length when drafting; 0: the scenario's
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
    batch: int = 0  # the decode batch (over all replicas) the throughput constraint was met at
    alternatives: list = field(default_factory=list)
    layout: str = ""  # the child's parallel layout on the first target
    layouts: list = field(default_factory=list)  # one per target

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
class Row:
    """One named constraint: its per-option costs, the fixed part outside the blocks, the bound and the
    parent's figure (bound and figure include the fixed part; the MIP's limit is net of it)."""

    costs: np.ndarray
    fixed: float
    bound: float
    parent: float


@dataclass
class Priced:
    """The MIP of one span of deployments: per target a layout and a range of batches per replica (b1..b2; one
    batch when equal). Over a range the rows are relaxed to what every batch in it implies, so its solutions
    bound those of every batch in it from below."""

    rows: dict = field(default_factory=dict)
    spans: tuple = ()  # per target: (layout index, b1, b2)
    problem: Problem | None = None

    @property
    def costs(self) -> dict:
        return {k: r.costs for k, r in self.rows.items()}

    @property
    def bound(self) -> dict:
        return {k: r.bound for k, r in self.rows.items()}

    @property
    def fixed(self) -> dict:
        return {k: r.fixed for k, r in self.rows.items()}

    @property
    def parent(self) -> dict:
        return {k: r.parent for k, r in self.rows.items()}

    @property
    def exact(self) -> bool:
        return all(b1 == b2 for _, b1, b2 in self.spans)


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


class Search:
    """The options of a library priced on targets, ready for the MIP and the baselines."""

    def __init__(self, lib: Library, parent: Program, targets: list[tuple], recipe: str = "",
                 metric: str = "kl", constraints: Constraints | None = None, provider=None,
                 scores: dict | None = None, fraction: float = 1.0, schedule: str = "geometric",
                 engine: str | EngineProfile = DEFAULT_ENGINE):
        """`targets`: (target, scenario name or Scenario) pairs. `scores` ({(layer, id): scores}) restricts the
        options to those variants, scored anew (a later round of Iterative Puzzle); `fraction` < 1 moves every
        constraint only that part of the way from the parent's figure to its bound, on a `geometric` or
        `linear` schedule. `engine` names the profile (engines.py) whose rules the child must meet to be served."""
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
        self.rows = [r for r in rows if not (kind_of[r["layer"]] in self.c.keep and r["id"] != "parent")
                     and not self.engine.refusal(lib.spec(r), lib.spec(self.parents[r["layer"]]), recipes)]
        unknown = [k for k in self.c.keep if k not in kind_of.values()]
        if unknown:
            raise PassError(f"keep={list(unknown)}: no layer of the library is of that kind")
        self.layer = np.array([r["layer"] for r in self.rows])
        self.specs = [lib.spec(r) for r in self.rows]
        self.parent_counts = parent.param_counts()
        self.score, self.score_source = self._scores(metric)
        groups = dict.fromkeys(self.c.uniform + self.engine.uniform_groups(set(kind_of.values())))
        self.uniform = {u: self._labels(u) for u in groups}
        self.scenarios = [self._scenario(s, recipe) for _, s in targets]
        hardware = [get_target(t) if isinstance(t, str) else t for t, _ in targets]
        # the child in every layout of each target's GPUs (or the one pinned) that the engines can split a child
        # over, drafting as its head accepts
        self.recipes, self._unsplit_memo = recipes, {}
        self.models = []
        for t, s in zip(hardware, self.scenarios):
            every = layouts_of(t, s)
            why = {str(L): self._no_child_splits(L) for L in every}
            if all(why.values()):
                raise PassError(f"engine {self.engine.name}: no layout of {t.name} splits the model as the engines "
                                f"do ({'; '.join(f'{k}: {v}' for k, v in why.items())}); use engine none")
            self.models.append([CostModel(parent, t, self._child(s), provider, layout=L)
                                for L in every if not why[str(L)]])
        need_base = self.c.speedup or (fraction < 1 and self.c.concurrency)
        # the parent's throughput in the best layout the engines split all of it over
        whole = self._refused(n.op for n in parent.nodes)
        self.base = [best_layout(parent, t, s, provider, fits=lambda L: not whole(L))[1]
                     for t, s in zip(hardware, self.scenarios)] if need_base else []
        if fraction < 1:  # counts move here, bounds in `problem` (they need the parent's figures)
            base = self.base[0].max_concurrency if self.c.concurrency else 0
            self.c = dataclasses.replace(self.c, speedup=self._move(1.0, self.c.speedup, up=True) if self.c.speedup else 0.0,
                                         concurrency=math.ceil(self._move(max(base, 1), self.c.concurrency, up=True))
                                         if self.c.concurrency else 0)
        self._costs: dict = {}

    def _refused(self, ops):
        """layout -> why the engines do not split one of `ops` over it ("" : they split them all)."""
        ops = list(ops)
        return lambda L: next((why for op in ops if (why := self.engine.unsplit(op, L, self.recipes))), "")

    def _no_child_splits(self, layout) -> str:
        """Why the engines split no child over `layout` (a part outside the blocks, or a layer none of whose
        options splits), or ""."""
        blocks = {n.path for n in self.parent.blocks()}
        why = self._refused(n.op for n in self.parent.nodes if n.path not in blocks)(layout)
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
        """Per option its values of a uniform group "kind.attr" or "kind.attr+attr+..." (None: another kind)."""
        kind, _, attrs = name.partition(".")
        specs = self.specs
        known = {a for r, s in zip(self.rows, specs) if r["kind"] == kind for a in s.attrs()}
        for axis in attrs.split("+"):
            if not axis or axis not in known or axis == "quant":
                raise PassError(f"uniform={name!r}: {kind or '?'} has no attribute {axis!r}; "
                                f"known: {', '.join(sorted(known - {'quant'})) or 'no layer of that kind'}")
        return np.array([tuple(getattr(s, a) for a in attrs.split("+")) if r["kind"] == kind else None
                         for r, s in zip(self.rows, specs)], dtype=object)

    # -- costs ----------------------------------------------------------------------------------------------
    def costs(self, cm: CostModel, batch: int) -> tuple[dict, dict, dict]:
        """Per-option costs, the fixed part outside the blocks and the parent's blocks' total, for one target
        and layout at one batch per replica (memoised: the search revisits batches)."""
        key = (id(cm), batch)
        if key not in self._costs:
            self._costs[key] = self._price(cm, batch)
        return self._costs[key]

    def _price(self, cm: CostModel, batch: int) -> tuple[dict, dict, dict]:
        blocks = {n.path for n in self.parent.blocks()}
        cm.prepare([n.op for n in self.parent.nodes] + self.specs + [self.lib.spec(r) for r in self.parents.values()],
                   batch)
        fixed = {"decode_seconds": cm.step_overhead(), "prefill_seconds": cm.step_overhead(),
                 "serve_seconds": cm.step_overhead() * (1 + cm.prefill_share(batch))}
        for n in self.parent.nodes:
            if n.path not in blocks:
                for k, v in cm.node_costs(n.path, n.op, batch, None, cm.routing.get(n.path)).items():
                    if not (n.op.kind == "mtp" and "params" in k):  # parameter counts leave the MTP head out
                        fixed[k] = fixed.get(k, 0.0) + v
        per = [cm.node_costs(r["path"], spec, batch, None, cm.routing.get(r["path"]) if r["id"] == "parent" else None)
               for r, spec in zip(self.rows, self.specs)]
        parent = [cm.node_costs(r["path"], self.lib.spec(r), batch, None, cm.routing.get(r["path"]))
                  for r in self.parents.values()]
        return ({k: np.array([p[k] for p in per]) for k in per[0]}, fixed,
                {k: float(sum(p[k] for p in parent)) for k in per[0]})

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

    def _rows(self, t: int, span: tuple, c: Constraints) -> dict:
        """One target's rows over its span (layout index, b1, b2)."""
        li, b1, b2 = span
        rows = {}
        cm = self.models[t][li]
        s, L = cm.scenario, cm.layout
        tag = f"{cm.target.name}/{s.name}"
        lo, hi = self.costs(cm, b1), self.costs(cm, b2)
        want = {}
        if c.speedup:
            base = self.base[t]
            if not base.max_batch:
                raise PassError(f"{tag}: the parent itself cannot serve this scenario ({base.infeasible}); "
                                "a throughput target relative to it is undefined")
            # throughput: replicas x batch x tokens per step / serving step >= speedup x the parent's
            want["serve_seconds"] = (hi, "serve_seconds", L.replicas * b2 * cm.tokens_per_step
                                     / (c.speedup * base.throughput_tokens_per_second))
            if s.rate_floor:
                want["rate_floor_seconds"] = (lo, "serve_seconds", cm.tokens_per_step / s.rate_floor)
        requests = max(b1 if c.speedup else 0, math.ceil(c.concurrency / L.replicas) if c.concurrency else 0)
        if requests:  # the batch served and the requests asked for, whichever is more, on one device
            want["memory_bytes"] = (self._memory(*lo, per_device=L.requests_per_group(requests)), "memory",
                                    cm.usable_memory())
        if c.decode_ms:
            want["latency_seconds"] = (self.costs(cm, 1), "decode_seconds", c.decode_ms / 1e3)
        if c.prefill_s:
            want["prefill_seconds"] = (lo, "prefill_seconds", c.prefill_s)
        if t == 0:
            for key, bound in (("params", c.max_params), ("active_params", c.max_active)):
                if bound:
                    want[key] = (lo, key, bound)
        off = self._unsplit(L)
        if off.any():  # choices the engines cannot split over this layout
            parent = float(sum(off[i] for i, r in enumerate(self.rows) if r["id"] == "parent"))
            rows[f"unsplit_layers@{tag}" if len(self.models) > 1 else "unsplit_layers"] = Row(off, 0.0, 0.0, parent)
        for key, ((o, f, p), col, bound) in want.items():
            name = f"{key}@{tag}" if len(self.models) > 1 and key not in ("params", "active_params") else key
            parent = p[col] + f[col]
            if key in self.MOVED:
                bound = self._move(parent, bound)
            rows[name] = Row(o[col], f[col], bound, parent)
        return rows

    #: the largest decode batch per replica tried: a far larger throughput target is infeasible, and says so
    MAX_BATCH = 1 << 20
    #: problems solved over the batch ranges at most; stopping early reports the gap left (Plan.gap)
    MAX_SOLVES = 64
    #: a batch range is searched only while its bound is below the best found by more than this (relative)
    GAP = 1e-6
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
    def _memory(*parts, per_device: int):
        """One device's weights plus the state of the `per_device` requests its attention group holds, for
        each of the options, the fixed part and the parent."""
        return tuple({"memory": p["weight_bytes"] + per_device * p["state_bytes"]} for p in parts)

    # -- the batches ------------------------------------------------------------------------------------------
    def spans(self) -> list[tuple]:
        """Where to look, per target: every layout with the batches per replica that can meet the throughput
        target (one batch, 1, without one). The analytic providers price a range b1..b2 (whole multiples of the
        attention groups); a measured provider only batches it times, each alone: the parent's, the target's
        (the speedup times the parent's) and the powers of two between them. `self.nearest` keeps, per target,
        one batch to diagnose an infeasible target at (the largest that fits, when none can meet it)."""
        per_target, self.nearest = [], []
        for t, cms in enumerate(self.models):
            out, nearest = [], None
            for li, cm in enumerate(cms):
                if not self.c.speedup:
                    out.append((li, 1, 1))
                    continue
                hi = self._largest_batch(cm)
                if hi < 1:
                    continue
                nearest = nearest or (li, hi, hi)
                if cm.provider.measures:
                    base = self.base[t].max_batch // cm.layout.replicas or 1
                    ends = sorted({base, math.ceil(self.c.speedup * base)})
                    grid = set(ends) | {1 << k for k in range(64) if ends[0] <= 1 << k <= ends[-1]}
                    out += [(li, b, b) for b in sorted(grid) if b <= hi]
                else:
                    span = self._reach(t, cm, hi)
                    if span:
                        out.append((li, *span))
            per_target.append(out)
            self.nearest.append(out[0] if out else nearest)
        return [tuple(p) for p in itertools.product(*per_target)]

    def _reach(self, t: int, cm: CostModel, hi: int) -> tuple[int, int] | None:
        """The batches per replica (multiples of the attention groups, at most `hi`) at which the least serving
        step of any choice (each layer at its fastest) meets both the throughput target and the rate floor:
        outside them no choice can. None when there are none."""
        L, s, step = cm.layout, cm.scenario, cm.layout.dp
        want = self.c.speedup * self.base[t].throughput_tokens_per_second
        layers = [np.flatnonzero(self.layer == i) for i in range(int(self.layer.max()) + 1)]

        def least(b):
            opt, fixed, _ = self.costs(cm, b * step)
            return fixed["serve_seconds"] + sum(opt["serve_seconds"][m].min() for m in layers)

        fast = lambda k: L.replicas * k * step * cm.tokens_per_step / least(k) >= want  # noqa: E731
        slow = lambda k: not s.rate_floor or cm.tokens_per_step / least(k) >= s.rate_floor  # noqa: E731
        top = hi // step
        if top < 1 or not fast(top):
            return None
        lo, k = 1, top
        while lo < k:  # the smallest batch reaching the throughput (it grows with the batch)
            mid = (lo + k) // 2
            lo, k = (lo, mid) if fast(mid) else (mid + 1, k)
        if not slow(lo):
            return None
        up, k = lo, top
        while up < k:  # the largest meeting the rate floor (it falls with the batch)
            mid = (up + k + 1) // 2
            up, k = (mid, k) if slow(mid) else (up, mid - 1)
        return lo * step, up * step

    def _largest_batch(self, cm: CostModel) -> int:
        """The largest batch per replica whose least memory per device (every layer at its smallest footprint)
        fits, within the provider's bound and MAX_BATCH: no choice can serve more."""
        cap = min(self.MAX_BATCH, cm.provider.max_batch,
                  cm.provider.batch_limit([n.op for n in self.parent.nodes if n.op.kind != "mtp"],
                                          cm.scenario.context_len))
        opt, fixed, _ = self.costs(cm, 1)
        layers = [np.flatnonzero(self.layer == i) for i in range(int(self.layer.max()) + 1)]
        w, s = opt["weight_bytes"], opt["state_bytes"]
        least = lambda r: fixed["weight_bytes"] + r * fixed["state_bytes"] + sum((w[m] + r * s[m]).min() for m in layers)  # noqa: E731
        usable, L = cm.usable_memory(), cm.layout
        if least(1) > usable:
            return 0
        lo, hi = 1, L.requests_per_group(cap)
        while lo < hi:  # requests per attention group that fit
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if least(mid) <= usable else (lo, mid - 1)
        return min(cap, lo * L.dp)

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
        does better; otherwise the range is halved. Ranges whose bound cannot beat the best found are dropped."""
        if method not in ("mip", *BASELINES):
            raise PassError(f"unknown search method {method!r}; known: mip, {', '.join(BASELINES)}")
        start, best, failed = time.perf_counter(), None, None
        heap, order = [], itertools.count()
        roots = self.spans()
        # the ranges and single batches of them (their ends and middle; the baselines try only these, at
        # power-of-two batches too), each keyed by its LP relaxation's bound (none: nothing there is feasible)
        for spans in [s for spans in roots for s in self._grid(spans, method == "mip")] + \
                (roots if method == "mip" else []):
            pr = self.problem(spans)
            bound = lower_bound(pr.problem)
            if bound is not None:
                heapq.heappush(heap, (bound, next(order), spans))
            elif pr.exact:
                failed = failed or (self._solve("mip", pr, time_limit), pr)
        solved = 0
        while heap:
            bound, _, spans = heapq.heappop(heap)
            if best is not None and bound >= best[0][0].objective - self.GAP * abs(best[0][0].objective):
                continue
            if best is not None and (solved >= self.MAX_SOLVES or time.perf_counter() - start > batch_seconds):
                heapq.heappush(heap, (bound, next(order), spans))
                break
            solved += 1
            pr = self.problem(spans)
            sols = self._solve(method, pr, time_limit)
            if isinstance(sols, Infeasible):
                failed = failed if failed and isinstance(failed[0], Infeasible) else (sols, pr)
                continue
            if not sols or (best is not None and sols[0].objective >= best[0][0].objective):
                continue
            exact = pr if pr.exact else self._admitting(sols[0].choice, spans)
            if exact is not None:
                best = (sols, exact)
            else:
                for half in self._split(spans):
                    heapq.heappush(heap, (sols[0].objective, next(order), half))
        if best is None:
            near = None if None in self.nearest else tuple((li, b, b) for li, b, _ in self.nearest)
            if not (failed and isinstance(failed[0], Infeasible) and failed[1].exact) and near:  # one batch's
                pr = self.problem(near)
                e = self._solve("mip", pr, time_limit)
                failed = (e, pr) if isinstance(e, Infeasible) else failed
            if failed and isinstance(failed[0], Infeasible):
                raise PlanError(explain(*failed) + self._fitting(failed[0]) + self._lifting()) from None
            raise PlanError(f"the {method} baseline finds no architecture that meets the constraints" if near else
                            "no layout of the target holds the model's smallest variant and one request in memory")
        sols, pr = best
        open_bound = min((b for b, _, _ in heap), default=math.inf)
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

    def _admitting(self, choice, spans) -> Priced | None:
        """The exact problem at batches of `spans` that `choice` meets, or None when no batch does. Per target
        (its rows concern its batch alone): the smallest batch whose throughput row holds, found by bisection
        (the budget grows faster with the batch than the choice's serving step); the rate floor and memory
        only tighten with the batch, so if they fail there they fail at every batch that meets throughput."""
        exact = []
        for t, (li, b1, b2) in enumerate(spans):
            step, holds = self.models[t][li].layout.dp, lambda b, key=None: all(  # noqa: E731
                _total(r, choice) <= r.bound - r.fixed + 1e-9 * abs(r.bound)
                for k, r in self._rows(t, (li, b, b), self.c).items() if key is None or k.startswith(key))
            lo, hi = b1 // step, b2 // step
            if not holds(hi * step, "serve_seconds"):
                return None
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if holds(mid * step, "serve_seconds") else (mid + 1, hi)
            if not holds(lo * step):
                return None
            exact.append((li, lo * step, lo * step))
        return self.problem(tuple(exact))

    def _grid(self, spans, ends: bool = False) -> list[tuple]:
        """Single batches of a span: its ends and geometric middle (`ends`), or also every power of two in it."""
        per = []
        for t, (li, b1, b2) in enumerate(spans):
            step = self.models[t][li].layout.dp
            mid = round(math.sqrt(b1 * b2) / step) * step
            grid = {b1, b2, min(max(b1, mid), b2)}
            if not ends:
                grid |= {step << k for k in range(64) if b1 <= step << k <= b2}
            per.append([(li, b, b) for b in sorted(grid)])
        return list(itertools.product(*per))

    def _split(self, spans) -> list[tuple]:
        """The widest target's batch range (by ratio) in two at its geometric middle: a range's relaxation is as
        loose as its largest batch is large against its smallest (whole multiples of the attention groups)."""
        t = max(range(len(spans)), key=lambda i: spans[i][2] / spans[i][1])
        li, b1, b2 = spans[t]
        step = self.models[t][li].layout.dp
        mid = min(max(b1, round(math.sqrt(b1 * b2) / step) * step), b2 - step)  # ratios: the relaxation
        return [spans[:t] + ((li, b1, mid),) + spans[t + 1:], spans[:t] + ((li, mid + step, b2),) + spans[t + 1:]]

    def _solve(self, method, pr: Priced, time_limit):
        """The exact problem's solutions (the MIP's best, or a baseline's choice), [] for a baseline that finds
        none, or the Infeasible diagnosis."""
        if method == "mip":
            try:
                return solve(pr.problem, 1, time_limit=time_limit)
            except Infeasible as e:
                return e
        choice = BASELINES[method](self, pr)
        if choice is None:
            return []
        choice = np.array(choice)
        return [Solution(choice, float(self.score[choice].sum()), {k: float(v[choice].sum()) for k, v in pr.costs.items()},
                         method, 0.0, 0.0)]

    def _lifting(self) -> str:
        """Under an engine profile: that its rules are part of what could not be met, and what lifts them."""
        if self.engine.name == "none":
            return ""
        return (f"\n  (under the engine profile {self.engine.name!r}, whose rules are part of the constraints: "
                "engine=none lifts them (--engine none, and --extended on compress), for a child no serving engine "
                "loads)")

    def _fitting(self, e: Infeasible) -> str:
        """With a concurrency target out of reach in memory: how many requests do fit (found by solving)."""
        if not self.c.concurrency or not any(b.resource.startswith("memory") for b in e.binding):
            return ""
        lo, hi = 0, self.c.concurrency - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            c = dataclasses.replace(self.c, concurrency=mid)
            fits = False
            for spans in self.spans():
                try:
                    solve(self.problem(tuple((li, b1, b1) for li, b1, _ in spans), c).problem)
                    fits = True
                    break
                except (Infeasible, TimedOut):
                    pass
            lo, hi = (mid, hi) if fits else (lo, mid - 1)
        return f"\n  {lo} requests fit"

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
                    layouts=[str(self.models[t][i].layout) for t, (i, _, _) in enumerate(pr.spans)])

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


# -- baselines --------------------------------------------------------------------------------------------------
def _total(row: Row, choice) -> float:
    return math.fsum(row.costs[choice])


def meets(pr: Priced, choice) -> bool:
    """Every bound holds and every uniform group has one label among the chosen options."""
    return all(pr.costs[k][choice].sum() <= pr.bound[k] - pr.fixed[k] + 1e-12 * abs(pr.bound[k]) for k in pr.costs) \
        and all(len({x for x in labels[choice] if x is not None}) <= 1 for labels in pr.problem.uniform.values())


def _moved(search: Search, p: Problem, choice: np.ndarray, layer: int, option: int) -> np.ndarray | None:
    """`choice` with `option` at `layer`, and every other layer whose option shares a uniform group with it but
    not its label moved to its least-score option with the labels `option` has (None when a layer has none)."""
    new = choice.copy()
    new[layer] = option
    want = {g: labels[option] for g, labels in p.uniform.items() if labels[option] is not None}
    for other, members in enumerate(p.members):
        cur = new[other]
        if other == layer or all(p.uniform[g][cur] in (None, v) for g, v in want.items()):
            continue
        fits = [i for i in members if all(p.uniform[g][i] == v for g, v in want.items())]
        if not fits:
            return None
        new[other] = min(fits, key=lambda i: search.score[i])
    return new


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
    most violated resource saved, until every constraint holds.
    A change to a layer in a uniform group moves the group's other layers with it."""
    score, p = search.score, pr.problem
    choice = np.array([next((i for i in m if search.rows[i]["id"] == "parent"), min(m, key=lambda i: score[i]))
                       for m in p.members])  # the parent, or in a later round the least damaging option
    for layer in range(len(choice)):  # a later round's start may mix a uniform group's labels: align them
        choice = _moved(search, p, choice, layer, choice[layer]) if choice is not None else None
    while choice is not None and not meets(pr, choice):
        over = {k: pr.costs[k][choice].sum() / max(pr.bound[k] - pr.fixed[k], 1e-30) for k in pr.costs}
        k = max(over, key=over.get)
        best, move = math.inf, None
        for layer, members in enumerate(p.members):
            for i in members:
                new = _moved(search, p, choice, layer, i) if i != choice[layer] else None
                if new is None:
                    continue
                saved = pr.costs[k][choice].sum() - pr.costs[k][new].sum()
                if saved > 0 and (added := (score[new].sum() - score[choice].sum()) / saved) < best:
                    best, move = added, new
        if move is None:
            return None
        choice = move
    return None if choice is None else choice.tolist()


BASELINES = {"uniform": uniform_choice, "greedy": greedy_choice}
