"""From the cost model to the MIP's rows (used by search.py): each option priced on one target, layout and batch
(`price`), and one target's named constraint rows over a span of batches (`target_rows`), with the bounds that
move from the parent's figure toward the target over the rounds of Iterative Puzzle (`move`). The row names and
their order are the MIP's: `Search.problem` assembles the rows of every target in turn.
"""
from __future__ import annotations

import math

import numpy as np

from ...backends.cost import CostModel
from ..core import PassError
from .search_types import Constraints, Row

#: bounds that move from the parent's figure toward the target over the rounds (memory is physical)
MOVED = ("latency_seconds", "prefill_seconds", "params", "active_params")


def price(cm: CostModel, batch: int, prog, lib, rows: list[dict], specs: list,
          parents: dict, only=None) -> tuple[dict, dict, dict]:
    """Per-option costs (`rows` with their `specs`; those indexed by `only` alone when given), the fixed part
    outside the blocks of the parent `prog` and its blocks' total (`parents`: per layer its row), for one
    target and layout at one batch per replica."""
    if only is not None:  # a choice's options: its totals at this batch, no more priced
        rows, specs = [rows[i] for i in only], [specs[i] for i in only]
    blocks = {n.path for n in prog.blocks()}
    cm.prepare([n.op for n in prog.nodes] + specs + [lib.spec(r) for r in parents.values()], batch)
    fixed = {"decode_seconds": cm.step_overhead(), "prefill_seconds": cm.step_overhead(),
             "serve_seconds": cm.step_overhead() * (1 + cm.prefill_share(batch))}
    for n in prog.nodes:
        if n.path not in blocks:
            for k, v in cm.node_costs(n.path, n.op, batch, None, cm.routing.get(n.path)).items():
                if not (n.op.kind == "mtp" and "params" in k):  # parameter counts leave the MTP head out
                    fixed[k] = fixed.get(k, 0.0) + v
    first, inverse = groups(cm, rows, specs) if only is None else (range(len(rows)), np.arange(len(rows)))
    per = [cm.node_costs(rows[i]["path"], specs[i], batch, None,
                         cm.routing.get(rows[i]["path"]) if rows[i]["id"] == "parent" else None) for i in first]
    parent = [cm.node_costs(r["path"], lib.spec(r), batch, None, cm.routing.get(r["path"]))
              for r in parents.values()]
    return ({k: np.array([p[k] for p in per])[inverse] for k in per[0]}, fixed,
            {k: float(sum(p[k] for p in parent)) for k in per[0]})


def groups(cm: CostModel, rows: list[dict], specs: list) -> tuple[list[int], np.ndarray]:
    """The options that price alike on `cm` (same spec, routing and recipe paths: the cost model's own memo
    key), once per cost model: the first of each group and each option's group. The same variant in 40 layers
    is then priced, and looked up, once per batch."""
    memo = cm.__dict__.setdefault("_search_groups", {})
    if id(rows) not in memo:
        index: dict = {}
        inverse = [index.setdefault((spec, r["path"] if r["id"] == "parent" and cm.routing.get(r["path"]) else None,
                                     cm._prec.signature(r["path"])), i)
                   for i, (r, spec) in enumerate(zip(rows, specs))]
        first = list(dict.fromkeys(inverse))
        position = {i: k for k, i in enumerate(first)}
        memo[id(rows)] = (rows, first, np.array([position[i] for i in inverse]))
    return memo[id(rows)][1:]


def target_rows(cm: CostModel, span: tuple, c: Constraints, *, first: bool, multi: bool, base, costs, unsplit,
                rows: list[dict], move) -> dict:
    """One target's rows over its span (layout index, b1, b2) in the layout `cm`: `first` for the first target
    (it alone bounds the parameter counts), `multi` when there are several (row names carry the target), `base`
    the parent in its best layout there (for a throughput target), `costs(cm, batch)` the priced options,
    `unsplit(layout)` per option whether the engines refuse to split it, `rows` the options and `move` the
    bound of a moved constraint this round."""
    li, b1, b2 = span
    out = {}
    s, L = cm.scenario, cm.layout
    tag = f"{cm.target.name}/{s.name}"
    lo, hi = costs(cm, b1), costs(cm, b2)
    want = {}
    if c.speedup:
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
        want["memory_bytes"] = (memory(*lo, per_device=L.requests_per_group(requests)), "memory",
                                cm.usable_memory())
    if c.decode_ms:
        want["latency_seconds"] = (costs(cm, 1), "decode_seconds", c.decode_ms / 1e3)
    if c.prefill_s:
        want["prefill_seconds"] = (lo, "prefill_seconds", c.prefill_s)
    if first:
        for key, bound in (("params", c.max_params), ("active_params", c.max_active)):
            if bound:
                want[key] = (lo, key, bound)
    off = unsplit(L)
    if off.any():  # choices the engines cannot split over this layout
        parent = float(sum(off[i] for i, r in enumerate(rows) if r["id"] == "parent"))
        out[f"unsplit_layers@{tag}" if multi else "unsplit_layers"] = Row(off, 0.0, 0.0, parent)
    for key, ((o, f, p), col, bound) in want.items():
        name = f"{key}@{tag}" if multi and key not in ("params", "active_params") else key
        parent = p[col] + f[col]
        if key in MOVED:
            bound = move(parent, bound)
        out[name] = Row(o[col], f[col], bound, parent)
    return out


def move(parent: float, final: float, fraction: float, schedule: str, up: bool = False) -> float:
    """The bound `fraction` of the way from the parent's figure to the final one (only when the parent
    does not already meet it): geometric (equal ratios per round) or linear."""
    f = fraction
    if f >= 1 or (final <= parent if up else final >= parent) or parent <= 0:
        return final
    return parent * (final / parent) ** f if schedule == "geometric" else parent + f * (final - parent)


def memory(*parts, per_device: int):
    """One device's weights plus the state of the `per_device` requests its attention group holds, for
    each of the options, the fixed part and the parent."""
    return tuple({"memory": p["weight_bytes"] + per_device * p["state_bytes"]} for p in parts)
