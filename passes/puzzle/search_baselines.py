"""The baselines the MIP is compared with (Minitron-style uniform pruning, greedy), and `solve_by`, which solves
one exact problem by the MIP or a baseline for `Search.plan` (search.py). A baseline takes the search (its
options `rows`, their `score` and the `parents` per layer) and a priced problem, and returns one choice or None.
"""
from __future__ import annotations

import math

import numpy as np

from .mip import Infeasible, Problem, Solution, solve
from .search_types import Priced


def meets(pr: Priced, choice) -> bool:
    """Every bound holds and every uniform group has one label among the chosen options."""
    return all(pr.costs[k][choice].sum() <= pr.bound[k] - pr.fixed[k] + 1e-12 * abs(pr.bound[k]) for k in pr.costs) \
        and all(len({x for x in labels[choice] if x is not None}) <= 1 for labels in pr.problem.uniform.values())


def _moved(search, p: Problem, choice: np.ndarray, layer: int, option: int) -> np.ndarray | None:
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


def uniform_choice(search, pr: Priced) -> list[int] | None:
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


def greedy_choice(search, pr: Priced) -> list[int] | None:
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


def solve_by(search, method, pr: Priced, time_limit, beat: float | None = None):
    """The exact problem's solutions (the MIP's best, or a baseline's choice), [] for a baseline that finds
    none or a MIP that finds none scoring below `beat`, or the Infeasible diagnosis."""
    if method == "mip":
        try:
            return solve(pr.problem, 1, time_limit=time_limit, beat=beat)
        except Infeasible as e:
            return e
    choice = BASELINES[method](search, pr)
    if choice is None:
        return []
    choice = np.array(choice)
    return [Solution(choice, float(search.score[choice].sum()), {k: float(v[choice].sum()) for k, v in pr.costs.items()},
                     method, 0.0, 0.0)]
