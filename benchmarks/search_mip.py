"""Solves a synthetic search shaped like planning Nemotron-3-Super (88 layers x 32 variants, six costs, one
SSM state size shared by the 40 Mamba layers, budgets at 60% of the parent) with our HiGHS solver and with
PuLP/CBC on the same MIP, and prints both times next to the goal: HiGHS under 5 s on 2 cores, faster than CBC.

Run: python benchmarks/search_mip.py [--seeds 0 1 2 3] [--cbc-seconds 60]
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import time

import numpy as np

from puzzlekit.ir.printer import format_table
from puzzlekit.passes.puzzle.mip import Problem, solve

KINDS = ["mamba"] * 40 + ["moe"] * 40 + ["attention"] * 8
BUDGET = 0.6
STATES = [128, 64, 32]                        # the Mamba SSM state sizes, the uniform group's labels


def block_options(kind: str, rng) -> list[dict]:
    """32 variants of one block, option 0 the parent's: `keep` is the kept fraction of its weights, `route`
    of its routed top-k (MoE), `state` of its per-request state; `label` is the SSM state size."""
    def v(keep, route=1.0, state=0.0, label=-1):
        return {"keep": keep, "route": route, "state": state, "label": label}

    if kind == "mamba":       # 3 state sizes x 10 head fractions, plus a linear stand-in and a no-op
        grid = [v(h, state=h * s / 128, label=s) for s in STATES for h in np.linspace(1, .28, 10)] + [v(.05), v(0)]
        params, active, state = 0.3e9, 1.0, 128 * 64 * 128 * 4             # heads x head_dim x state, fp32
    elif kind == "moe":       # kept experts x routed top-k
        grid = [v(e, route=k) for e in (1, .75, .5, .375, .25, .1875, .125, .0625) for k in (1, .75, .5, .25)]
        params, active, state = 2.4e9, 22 / 512, 0.0                       # top-22 of 512 experts
    else:                     # KV heads x attention window (fraction of a 64k context)
        grid = [v(h, state=h * w) for h in (1.0, .5) for w in np.linspace(1, .0625, 16)]
        params, active, state = 0.1e9, 1.0, 2 * 2 * 8 * 128 * 65536        # K and V, bf16, 8 heads, 64k tokens
    out = []
    for g in grid:
        p = g["keep"] * params
        a = p * active * g["route"]
        attention = g["state"] * 8192 ** 2 * 8 * 128 * 4 if kind == "attention" else 0.0
        smaller_state = 0.2 * STATES.index(g["label"]) if g["label"] > 0 else 0.0
        loss = (1 - g["keep"]) ** 1.5 + 0.3 * (1 - g["route"]) + smaller_state
        decode = (2 * a + g["state"] * state) / 4.8e12 + 4e-6 * (p > 0)      # bytes over HBM bandwidth, launch
        out.append({"params": p, "active_params": a, "weight_bytes": 2 * p, "state_bytes": g["state"] * state,
                    "decode_seconds": decode * rng.uniform(.95, 1.05),
                    "prefill_seconds": (2 * a * 8192 + attention) / 1e15 * rng.uniform(.9, 1.1),
                    "score": loss * rng.lognormal(-4, 0.6), "label": g["label"] if kind == "mamba" else None})
    return out


def build(seed: int) -> Problem:
    rng = np.random.default_rng(seed)
    rows = [(l, o) for l, kind in enumerate(KINDS) for o in block_options(kind, rng)]
    layer = np.array([l for l, _ in rows])
    col = {k: np.array([o[k] for _, o in rows], dtype=float)
           for k in ("score", "params", "active_params", "weight_bytes", "state_bytes", "decode_seconds",
                     "prefill_seconds")}
    costs = {k: v for k, v in col.items() if k != "score"}
    parent = np.flatnonzero(np.r_[True, layer[1:] != layer[:-1]])           # option 0 of every layer
    limits = {r: BUDGET * math.fsum(costs[r][parent]) for r in costs if r != "params"}
    labels = np.array([-1 if o["label"] is None else o["label"] for _, o in rows])
    return Problem(layer=layer, score=col["score"] - col["score"][parent][layer], costs=costs, limits=limits,
                   uniform={"ssm_state": labels})


def solve_cbc(p: Problem, seconds: float):
    """The same MIP in PuLP: one binary per option and per label, rows divided by their limit. The time
    includes PuLP writing the model and starting CBC (under 0.1 s here)."""
    import pulp
    m = pulp.LpProblem("puzzle", pulp.LpMinimize)
    x = [pulp.LpVariable(f"x{j}", cat="Binary") for j in range(p.layer.size)]
    m += pulp.lpSum(float(s) * xj for s, xj in zip(p.score, x))
    for members in p.members:
        m += pulp.lpSum(x[j] for j in members) == 1
    for r, lim in p.limits.items():
        m += pulp.lpSum(float(c / lim) * x[j] for j, c in enumerate(p.costs[r]) if c) <= 1
    for g, labels in p.uniform.items():
        y = {v: pulp.LpVariable(f"y_{g}_{v}", cat="Binary") for v in set(labels.tolist()) - {-1}}
        m += pulp.lpSum(y.values()) == 1
        for members in p.members:
            for v, yv in y.items():
                opts = [j for j in members if labels[j] == v]
                if opts:
                    m += pulp.lpSum(x[j] for j in opts) <= yv
    t0 = time.perf_counter()
    m.solve(pulp.PULP_CBC_CMD(msg=False, timeLimit=seconds, gapRel=1e-9))
    took = time.perf_counter() - t0
    return took, pulp.value(m.objective), pulp.LpStatus[m.status]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--cbc-seconds", type=float, default=60.0)
    args = ap.parse_args()
    has_pulp = importlib.util.find_spec("pulp") is not None
    if not has_pulp:
        print("PuLP not installed (pip install 'puzzlekit[bench]'): CBC skipped")
    rows = [("seed", "HiGHS s", "CBC s", "CBC/HiGHS", "HiGHS objective", "CBC - HiGHS", "status")]
    highs_s, cbc_s = [], []
    for seed in args.seeds:
        p = build(seed)
        (best,) = solve(p)
        highs_s.append(best.seconds)
        row = (str(seed), f"{best.seconds:.2f}", "-", "-", f"{best.objective:.7f}", "-", best.status)
        if has_pulp:
            took, objective, status = solve_cbc(p, args.cbc_seconds)
            cbc_s.append(took)
            row = row[:2] + (f"{took:.2f}", f"{took / best.seconds:.2f}x") + row[4:5] + (
                f"{objective - best.objective:.1e}", f"{best.status} / CBC {status}")
        rows.append(row)
    print(f"synthetic Nemotron-3-Super search: {p.n_layers} layers, {p.layer.size} variants, {len(p.limits)} "
          f"budgets at {BUDGET:.0%} of the parent, ssm_state shared by {KINDS.count('mamba')} layers")
    print(format_table(rows), end="")
    t0 = time.perf_counter()
    five = solve(build(args.seeds[0]), n_solutions=5, min_distance=4)
    print(f"seed {args.seeds[0]}, 5 solutions at least 4 layers apart: {time.perf_counter() - t0:.2f} s, objectives "
          + ", ".join(f"{s.objective:.7f}" for s in five))
    print(f"goal: HiGHS under 5 s on 2 cores: {'met' if max(highs_s) < 5 else 'NOT met'} "
          f"(slowest {max(highs_s):.2f} s)", end="")
    if cbc_s:
        faster = sum(highs_s) < sum(cbc_s)
        print(f"; faster than CBC: {'met' if faster else 'NOT met'} (total {sum(highs_s):.2f} s vs "
              f"{sum(cbc_s):.2f} s)", end="")
    print()


if __name__ == "__main__":
    main()
