"""The batch ranges that `Search.plan` (search.py) branches and bounds over: where to look per target and layout
(`batch_spans`, bounded by what the least choice can reach in memory and throughput), the single batches a range
is seeded with (`grid`), how a range is cut in two (`split`), and the exact batch at which a range's relaxed
optimum holds (`admitting`). Functions of the priced layouts alone; the rows and problems come in as callables.
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from ...backends.cost import CostModel
from .search_types import Constraints, Priced, _total

#: the largest decode batch per replica tried: a far larger throughput target is infeasible, and says so
MAX_BATCH = 1 << 20


def batch_spans(models: list, speedup: float, bases: list, costs, layer: np.ndarray, prog,
                max_batch: int = MAX_BATCH) -> tuple[list[tuple], list]:
    """Where to look, per target: every layout with the batches per replica that can meet the throughput
    target (one batch, 1, without one). The analytic providers price a range b1..b2 (whole multiples of the
    attention groups); a measured provider only batches it times, each alone: the parent's, the target's
    (the speedup times the parent's) and the powers of two between them. Also, per target, one batch to
    diagnose an infeasible target at (the largest that fits, when none can meet it): `Search.nearest`."""
    per_target, nearests = [], []
    for t, cms in enumerate(models):
        out, nearest = [], None
        for li, cm in enumerate(cms):
            if not speedup:
                out.append((li, 1, 1))
                continue
            hi = largest_batch(cm, costs, layer, prog, max_batch)
            if hi < 1:
                continue
            nearest = nearest or (li, hi, hi)
            if cm.provider.measures:
                base = bases[t].max_batch // cm.layout.replicas or 1
                ends = sorted({base, math.ceil(speedup * base)})
                grid = set(ends) | {1 << k for k in range(64) if ends[0] <= 1 << k <= ends[-1]}
                out += [(li, b, b) for b in sorted(grid) if b <= hi]
            else:
                span = reach(cm, speedup, bases[t], costs, layer, hi)
                if span:
                    out.append((li, *span))
        per_target.append(out)
        nearests.append(out[0] if out else nearest)
    return [tuple(p) for p in itertools.product(*per_target)], nearests


def reach(cm: CostModel, speedup: float, base, costs, layer: np.ndarray, hi: int) -> tuple[int, int] | None:
    """The batches per replica (multiples of the attention groups, at most `hi`) at which the least serving
    step of any choice (each layer at its fastest) meets both the throughput target (`speedup` times the
    parent's `base`) and the rate floor: outside them no choice can. None when there are none."""
    L, s, step = cm.layout, cm.scenario, cm.layout.dp
    want = speedup * base.throughput_tokens_per_second
    layers = [np.flatnonzero(layer == i) for i in range(int(layer.max()) + 1)]

    def least(b):
        opt, fixed, _ = costs(cm, b * step)
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


def largest_batch(cm: CostModel, costs, layer: np.ndarray, prog, max_batch: int = MAX_BATCH) -> int:
    """The largest batch per replica whose least memory per device (every layer at its smallest footprint)
    fits, within the provider's bound and `max_batch`: no choice can serve more."""
    cap = min(max_batch, cm.provider.max_batch,
              cm.provider.batch_limit([n.op for n in prog.nodes if n.op.kind != "mtp"],
                                      cm.scenario.context_len))
    opt, fixed, _ = costs(cm, 1)
    layers = [np.flatnonzero(layer == i) for i in range(int(layer.max()) + 1)]
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


def admitting(models: list, choice, spans, rows, c: Constraints, problem) -> Priced | None:
    """The exact problem at batches of `spans` that `choice` meets, or None when no batch does. Per target
    (its rows concern its batch alone): the smallest batch whose throughput row holds, found by bisection
    (the budget grows faster with the batch than the choice's serving step); the rate floor and memory
    only tighten with the batch, so if they fail there they fail at every batch that meets throughput.
    `rows(t, span, c, only)` gives a target's rows (for the options `only` alone), `problem(spans)` the exact
    problem. Only the chosen options are priced at the batches tried."""
    exact, mine = [], np.arange(len(choice))
    for t, (li, b1, b2) in enumerate(spans):
        step, holds = models[t][li].layout.dp, lambda b, key=None: all(  # noqa: E731
            _total(r, mine) <= r.bound - r.fixed + 1e-9 * abs(r.bound)
            for k, r in rows(t, (li, b, b), c, choice).items() if key is None or k.startswith(key))
        lo, hi = b1 // step, b2 // step
        if not holds(hi * step, "serve_seconds"):
            return None
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if holds(mid * step, "serve_seconds") else (mid + 1, hi)
        if not holds(lo * step):
            return None
        exact.append((li, lo * step, lo * step))
    return problem(tuple(exact))


def grid(models: list, spans, ends: bool = False) -> list[tuple]:
    """Single batches of a span: its ends and geometric middle (`ends`), or also every power of two in it."""
    per = []
    for t, (li, b1, b2) in enumerate(spans):
        step = models[t][li].layout.dp
        mid = round(math.sqrt(b1 * b2) / step) * step
        grid = {b1, b2, min(max(b1, mid), b2)}
        if not ends:
            grid |= {step << k for k in range(64) if b1 <= step << k <= b2}
        per.append([(li, b, b) for b in sorted(grid)])
    return list(itertools.product(*per))


def split(models: list, spans) -> list[tuple]:
    """The widest target's batch range (by ratio) in two at its geometric middle: a range's relaxation is as
    loose as its largest batch is large against its smallest (whole multiples of the attention groups)."""
    t = max(range(len(spans)), key=lambda i: spans[i][2] / spans[i][1])
    li, b1, b2 = spans[t]
    step = models[t][li].layout.dp
    mid = min(max(b1, round(math.sqrt(b1 * b2) / step) * step), b2 - step)  # ratios: the relaxation
    return [spans[:t] + ((li, b1, mid),) + spans[t + 1:], spans[:t] + ((li, mid + step, b2),) + spans[t + 1:]]
