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
    most violated resource saved, until every constraint holds (ties: the first layer, then the first option),
    never back to a choice it made before.
    A change to a layer in a uniform group moves the group's other layers with it. Each step prices every option
    at once: a change that moves no other layer differs from the choice in one entry; those that do are few and
    share their moved layers per label (`_aligned`)."""
    score, p = search.score, pr.problem
    choice = np.array([next((i for i in m if search.rows[i]["id"] == "parent"), min(m, key=lambda i: score[i]))
                       for m in p.members])  # the parent, or in a later round the least damaging option
    for layer in range(len(choice)):  # a later round's start may mix a uniform group's labels: align them
        choice = _moved(search, p, choice, layer, choice[layer]) if choice is not None else None
    codes = np.stack([p.codes(g) for g in p.uniform]) if p.uniform else np.zeros((0, len(score)), dtype=np.int64)
    order = np.concatenate(p.members)  # layer by layer, each layer's options in order
    seen = {choice.tobytes()} if choice is not None else set()  # a move that saves one resource may cost another:
    # never back to a choice made before (the steps could cycle), so the walk ends
    while choice is not None and not meets(pr, choice):
        over = {k: pr.costs[k][choice].sum() / max(pr.bound[k] - pr.fixed[k], 1e-30) for k in pr.costs}
        cost = pr.costs[max(over, key=over.get)]
        cur = choice[p.layer]  # each option's layer's current option
        saved, added = cost[cur] - cost, score - score[cur]
        moves = {}  # the options that move other layers: the new choice each makes (None: a layer cannot follow)
        for i in np.flatnonzero(_moves_others(codes, choice, p.layer)):
            want = tuple(codes[:, i].tolist())
            if want not in moves:
                moves[want] = _aligned(score, p, codes, choice, want)
            base, failed = moves[want]
            layer = p.layer[i]
            if failed - {layer}:
                saved[i] = 0.0
                continue
            new = base.copy()
            new[layer] = i
            saved[i], added[i] = cost[choice].sum() - cost[new].sum(), score[new].sum() - score[choice].sum()
        saved[choice] = 0.0
        ratio = np.where(saved > 0, added / np.where(saved > 0, saved, 1.0), np.inf)[order]
        for j in np.argsort(ratio, kind="stable"):  # the best move to a choice not made before
            if not np.isfinite(ratio[j]):
                return None
            new = _moved(search, p, choice, p.layer[order[j]], order[j])
            if (key := new.tobytes()) not in seen:
                break
        seen.add(key)
        choice = new
    return None if choice is None else choice.tolist()


def _moves_others(codes: np.ndarray, choice: np.ndarray, layer: np.ndarray) -> np.ndarray:
    """Per option: whether taking it moves another layer (another layer's chosen option has a different label in
    one of its uniform groups). `codes`: [groups, options], -1 where an option is not concerned."""
    out = np.zeros(codes.shape[1], dtype=bool)
    for c in codes:
        chosen = c[choice]  # per layer
        counts = np.bincount(chosen[chosen >= 0], minlength=max(int(c.max()) + 1, 1))
        own = chosen[layer]  # the option's own layer's label, which it replaces
        other = (chosen >= 0).sum() - counts[np.maximum(c, 0)] - ((own >= 0) & (own != c))
        out |= (c >= 0) & (other > 0)
    return out


def _aligned(score, p: Problem, codes: np.ndarray, choice: np.ndarray, want: tuple) -> tuple[np.ndarray, set]:
    """`choice` with every layer whose option has another label than `want` (per group, -1: any) moved to its
    least-score option with exactly those labels, and the layers that have none."""
    need = [(g, v) for g, v in enumerate(want) if v >= 0]
    new, failed = choice.copy(), set()
    for layer, members in enumerate(p.members):
        if all(codes[g, new[layer]] in (-1, v) for g, v in need):
            continue
        fits = members[np.all([codes[g, members] == v for g, v in need], axis=0)]
        if not len(fits):
            failed.add(layer)
            continue
        new[layer] = fits[np.argmin(score[fits])]
    return new, failed


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
