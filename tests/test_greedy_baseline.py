"""The greedy baseline prices every option at once each step; it must pick exactly what the plain rule picks: from the
parent, the single-layer change (moving a uniform group's other layers with it) with the least score added per
unit of the most violated resource saved, first layer and first option on ties, never back to a choice made
before (a move saving one resource may cost another: without that rule the walk can cycle)."""
from __future__ import annotations

import math
import types

import numpy as np
import pytest

from puzzlekit.passes.puzzle.mip import Problem
from puzzlekit.passes.puzzle.search_baselines import _moved, greedy_choice, meets
from puzzlekit.passes.puzzle.search_types import Priced, Row


def plain_greedy(search, pr):
    """The rule as written: every option of every layer tried in turn, each step."""
    score, p = search.score, pr.problem
    choice = np.array([next((i for i in m if search.rows[i]["id"] == "parent"), min(m, key=lambda i: score[i]))
                       for m in p.members])
    for layer in range(len(choice)):
        choice = _moved(search, p, choice, layer, choice[layer]) if choice is not None else None
    seen = {tuple(choice)} if choice is not None else set()
    while choice is not None and not meets(pr, choice):
        over = {k: pr.costs[k][choice].sum() / max(pr.bound[k] - pr.fixed[k], 1e-30) for k in pr.costs}
        k = max(over, key=over.get)
        best, move = math.inf, None
        for layer, members in enumerate(p.members):
            for i in members:
                new = _moved(search, p, choice, layer, i) if i != choice[layer] else None
                if new is None or tuple(new) in seen:
                    continue
                saved = pr.costs[k][choice].sum() - pr.costs[k][new].sum()
                if saved > 0 and (added := (score[new].sum() - score[choice].sum()) / saved) < best:
                    best, move = added, new
        if move is None:
            return None
        choice = move
        seen.add(tuple(choice))
    return None if choice is None else choice.tolist()


def problem(seed: int, layers: int = 14, groups: int = 2, tight: float = 0.6):
    """A random search: 1-6 options a layer (the first the parent; 4-6 in a uniform group, with every label),
    integer-valued costs and scores (no ties decided by rounding), `groups` uniform groups over some layers, bounds
    at `tight` of the parent's."""
    rng = np.random.default_rng(seed)
    kind = rng.integers(0, groups + 1, layers)  # 0: no group
    sizes = np.where(kind > 0, rng.integers(4, 7, layers), rng.integers(1, 7, layers))
    layer = np.repeat(np.arange(layers), sizes)
    n = len(layer)
    first = np.r_[0, np.cumsum(sizes)[:-1]]
    is_parent = np.zeros(n, bool)
    is_parent[first] = True
    score = np.where(is_parent, 0.0, rng.integers(1, 50, n).astype(float))
    costs = {k: np.where(is_parent, 100.0, rng.integers(5, 100, n).astype(float)) for k in ("memory", "seconds")}
    within = np.arange(n) - first[layer]  # an option's place in its layer (0: the parent)
    uniform = {f"g{g}": np.array([(7 if is_parent[i] else int(within[i] + seed) % 3) if kind[l] == g + 1 else None
                                  for i, l in enumerate(layer)], dtype=object) for g in range(groups)}
    parent_total = {k: v[is_parent].sum() for k, v in costs.items()}
    rows = {k: Row(v, 10.0, 10.0 + tight * parent_total[k], 10.0 + parent_total[k]) for k, v in costs.items()}
    pr = Priced(rows=rows)
    pr.problem = Problem(layer, score, costs, {k: r.bound - r.fixed for k, r in rows.items()}, uniform=uniform)
    search = types.SimpleNamespace(score=score, rows=[{"id": "parent" if p else f"v{i}"} for i, p in
                                                      enumerate(is_parent)])
    return search, pr


@pytest.mark.parametrize("seed", range(40))
def test_greedy_picks_what_the_plain_rule_picks(seed):
    search, pr = problem(seed, tight=(0.6, 0.75, 0.9)[seed % 3])
    want = plain_greedy(search, pr)
    assert greedy_choice(search, pr) == want
    if want is not None:
        assert meets(pr, np.array(want))


def test_greedy_without_uniform_groups_and_an_unreachable_bound():
    search, pr = problem(3, groups=0, tight=0.6)
    assert greedy_choice(search, pr) == plain_greedy(search, pr) is not None
    search, pr = problem(3, groups=0, tight=0.01)  # below every layer's cheapest option
    assert greedy_choice(search, pr) is None and plain_greedy(search, pr) is None
