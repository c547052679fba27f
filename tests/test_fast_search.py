"""The fast exact search (issue 39): options priced once per group and layout, ranges bounded before their MIPs,
choices checked on their own options, and the same optimum as solving every layout and batch."""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import numpy as np
import pytest

from puzzlekit import ir
from puzzlekit.backends.cost import get_scenario
from puzzlekit.passes.puzzle import build_library
from puzzlekit.passes.puzzle.mip import Infeasible, solve
from puzzlekit.passes.puzzle.search import Constraints, Search as _Search
from puzzlekit.tools.default_model import DEFAULT_MODEL

Search = functools.partial(_Search, engine="none")


@pytest.fixture(scope="module")
def meta_lib(tmp_path_factory):
    parent = ir.load(DEFAULT_MODEL / "config.json")
    return parent, build_library(parent, tmp_path_factory.mktemp("lib") / "lib")


def test_the_fast_search_equals_solving_every_layout_and_batch(meta_lib):
    """Four layouts of two GPUs, every batch each can meet the target at: the best of them all is the plan."""
    parent, lib = meta_lib
    sc = get_scenario("chat", rate_floor=1500.0, gpus=2, context=60000)
    search = Search(lib, parent, [("8xh100", sc)], constraints=Constraints(speedup=1.3, keep=("attention",)))
    plan = search.plan()
    spans = [s for (s,) in search.spans()]
    assert len({li for li, _, _ in spans}) == 4
    best, where = math.inf, None
    for li, b1, b2 in spans:
        step = search.models[0][li].layout.dp
        for b in range(b1, b2 + 1, step):
            try:
                got = solve(search.problem(((li, b, b),)).problem)[0].objective
            except Infeasible:
                continue
            if got < best:
                best, where = got, (str(search.models[0][li].layout), b)
    assert plan.status == "optimal" and plan.objective == pytest.approx(best, rel=1e-9, abs=1e-12)
    assert plan.layout == where[0]
    assert all(plan.predicted[k] <= plan.limits[k] * (1 + 1e-9) for k in plan.predicted)


TWO_TARGETS = [("8xh100", get_scenario("chat", rate_floor=1700.0, gpus=2, context=60000)),
               ("8xb200", get_scenario("chat", rate_floor=1500.0, gpus=2, context=30000))]


def test_two_targets_at_once_equal_solving_every_pair_of_batches(meta_lib):
    """Two targets, each with its own layout and batch: the plan is the best over every pair of batches of
    every pair of layouts (keyed by each target's own bound, halved before any MIP, and still exact)."""
    parent, lib = meta_lib

    class Small(_Search):
        MAX_BATCH = 12  # every pair solved below: 144 problems

    search = Small(lib, parent, TWO_TARGETS, constraints=Constraints(speedup=1.1, keep=("attention",)), engine="none")
    plan = search.plan()
    best, where, pairs = math.inf, None, 0
    for combo in search.spans():
        batches = [[(li, n, n) for n in range(b1, b2 + 1, search.models[t][li].layout.dp)]
                   for t, (li, b1, b2) in enumerate(combo)]
        for pick in itertools.product(*batches):
            pairs += 1
            try:
                got = solve(search.problem(pick).problem)[0].objective
            except Infeasible:
                continue
            if got < best:
                best, where = got, [str(search.models[t][li].layout) for t, (li, _, _) in enumerate(pick)]
    assert pairs > 100 and len(search.spans()) > 1
    assert plan.status == "optimal" and plan.objective == pytest.approx(best, rel=1e-9, abs=1e-12)
    assert plan.layouts == where
    assert all(plan.predicted[k] <= plan.limits[k] * (1 + 1e-9) for k in plan.predicted)


def test_a_search_planned_again_under_other_constraints_plans_as_a_fresh_one(meta_lib):
    """A sweep plans one search at several speedups (harder first here): nothing bounded under the earlier
    constraints carries over, with one target or two."""
    parent, lib = meta_lib
    for targets in (TWO_TARGETS[:1], TWO_TARGETS):
        c = Constraints(speedup=1.3, keep=("attention",))
        search = Search(lib, parent, targets, constraints=c)
        search.plan()
        search.c = dataclasses.replace(c, speedup=1.05)
        again = search.plan()
        fresh = Search(lib, parent, targets, constraints=dataclasses.replace(c, speedup=1.05)).plan()
        assert again.objective == pytest.approx(fresh.objective, rel=1e-9, abs=1e-12) and again.status == "optimal"
        assert again.layouts == fresh.layouts


def test_options_priced_once_per_group_equal_each_option_priced_alone(meta_lib):
    parent, lib = meta_lib
    search = Search(lib, parent, [("8xb200", "chat")], constraints=Constraints(speedup=1.5))
    cm = search.models[0][3]
    opt, _, _ = search.costs(cm, 24)
    for i, (r, spec) in enumerate(zip(search.rows, search.specs)):
        alone = cm._node_costs(r["path"], spec, 24, None, cm.routing.get(r["path"]) if r["id"] == "parent" else None)
        for k, v in alone.items():
            assert opt[k][i] == v, (i, k)


def test_a_choice_checked_on_its_own_options_matches_the_full_rows(meta_lib):
    parent, lib = meta_lib
    search = Search(lib, parent, [("h100", "chat")], constraints=Constraints(speedup=1.5))
    choice = np.array([m[len(m) // 2] for m in (np.flatnonzero(search.layer == i)
                                                 for i in range(int(search.layer.max()) + 1))])
    full = search._rows(0, (0, 16, 16), search.c)
    mine = search._rows(0, (0, 16, 16), search.c, choice)
    assert set(full) == set(mine)
    for k in full:
        assert math.fsum(full[k].costs[choice]) == math.fsum(mine[k].costs)
        assert (full[k].bound, full[k].fixed) == (mine[k].bound, mine[k].fixed)
