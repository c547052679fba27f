"""The Puzzle search MIP against brute force: optimum, diversity, minimum(), infeasibility diagnosis."""
import itertools
import math
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from puzzlekit.passes.core import PassError
from puzzlekit.passes.puzzle.mip import Binding, Infeasible, Problem, minimum, solve

RTOL = 1e-9
PROPERTY = settings(max_examples=150, deadline=None, derandomize=True)
FEWER = settings(max_examples=30, deadline=None, derandomize=True)


def total(values, choice):
    return math.fsum(np.asarray(values, dtype=float)[list(choice)])


def meets(p, choice, skip=()):
    """An independent check of every constraint except the (sense, resource) pairs in `skip`."""
    for r, lim in p.limits.items():
        if ("<=", r) not in skip and total(p.costs[r], choice) > lim + RTOL * abs(lim):
            return False
    for r, low in p.lower.items():
        if (">=", r) not in skip and total(p.costs[r], choice) < low - RTOL * abs(low):
            return False
    for labels in p.uniform.values():
        used = {labels[j] for j in choice if labels[j] is not None and labels[j] != -1}
        if len(used) > 1:
            return False
    return True


def combos(p):
    layer = np.asarray(p.layer)
    return [np.array(c) for c in itertools.product(*[np.flatnonzero(layer == l) for l in range(layer.max() + 1)])]


def feasible(p, skip=()):
    return [c for c in combos(p) if meets(p, c, skip)]


def close(a, b):
    return math.isclose(a, b, rel_tol=RTOL, abs_tol=RTOL)


@st.composite
def problems(draw):
    sizes = draw(st.lists(st.integers(1, 4), min_size=2, max_size=5))
    n, n_layers = sum(sizes), len(sizes)
    order = draw(st.permutations(range(n)))                       # options need not be grouped by layer
    layer = np.repeat(np.arange(n_layers), sizes)[list(order)]
    number = st.one_of(st.integers(0, 4).map(float), st.floats(0, 100))   # small integers make ties
    score = [draw(st.one_of(number, st.floats(-10, 0))) for _ in range(n)]
    costs, limits, lower = {}, {}, {}
    for r in range(draw(st.integers(1, 3))):
        unit = draw(st.sampled_from([1e-3, 1.0, 1e11]))
        c = np.array([draw(number) for _ in range(n)]) * unit
        costs[f"r{r}"] = c
        lo = math.fsum(min(c[layer == l]) for l in range(n_layers))
        hi = math.fsum(max(c[layer == l]) for l in range(n_layers))
        if draw(st.booleans()) or not limits:
            limits[f"r{r}"] = lo + draw(st.floats(-0.1, 1.0)) * (hi - lo)
        if draw(st.integers(0, 3)) == 0:
            lower[f"r{r}"] = lo + draw(st.floats(0.0, 1.1)) * (hi - lo)
    uniform = {}
    if draw(st.booleans()):
        layers = draw(st.sets(st.integers(0, n_layers - 1), min_size=1))
        uniform["state"] = [draw(st.sampled_from(["a", "b", "c", None])) if layer[j] in layers else None
                            for j in range(n)]
    return Problem(layer=layer, score=np.array(score), costs=costs, limits=limits, uniform=uniform, lower=lower)


@PROPERTY
@given(problems())
def test_optimum_matches_brute_force(p):
    ok = feasible(p)
    if not ok:
        with pytest.raises(Infeasible):
            solve(p)
        return
    best = min(total(p.score, c) for c in ok)
    (sol,) = solve(p)
    assert close(sol.objective, best)
    assert sol.status == "optimal"
    assert sorted(p.layer[sol.choice]) == list(range(p.n_layers))
    assert meets(p, sol.choice)
    assert sol.totals == {r: total(c, sol.choice) for r, c in p.costs.items()}


@FEWER
@given(problems(), st.integers(1, 3))
def test_diverse_solutions_are_the_next_best(p, d):
    ok = feasible(p)
    if not ok:
        return
    sols = solve(p, n_solutions=4, min_distance=d)
    for k in range(5):
        rest = [c for c in ok if all(np.count_nonzero(c != s.choice) >= d for s in sols[:k])]
        if k == len(sols):
            assert k == 4 or not rest, "solve stopped although another distinct solution exists"
            break
        assert all(np.count_nonzero(sols[k].choice != s.choice) >= d for s in sols[:k])
        assert meets(p, sols[k].choice)
        assert close(sols[k].objective, min(total(p.score, c) for c in rest))
    objectives = [s.objective for s in sols]
    assert all(a <= b + RTOL * (1 + abs(b)) for a, b in itertools.pairwise(objectives))


@FEWER
@given(problems())
def test_minimum_matches_brute_force(p):
    for r in p.costs:
        ok = feasible(p, skip={("<=", r)})
        got = minimum(p, r)
        if not ok:
            assert got is None
        else:
            assert close(got, min(total(p.costs[r], c) for c in ok))
    r = next(iter(p.costs))
    ok = feasible(p, skip={("<=", q) for q in p.costs} | {(">=", q) for q in p.costs})
    got = minimum(p, r, drop=tuple(p.costs))  # without limits only a uniform group can make it infeasible
    assert got is None if not ok else close(got, min(total(p.costs[r], c) for c in ok))


def two_layers(more=None, **kw):
    """Each layer: a fast big option (0, 2) and a slow small one (1, 3)."""
    return Problem(layer=[0, 0, 1, 1], score=[0.0, 1.0, 0.0, 1.0],
                   costs={"decode_seconds": np.array([0.004, 0.006, 0.0083, 0.009]),
                          "weight_bytes": np.array([6e10, 4e10, 6e10, 4e10]), **(more or {})}, **kw)


def test_infeasible_names_each_limit_out_of_reach_alone():
    p = two_layers(limits={"decode_seconds": 0.01, "weight_bytes": 7e10})
    with pytest.raises(Infeasible) as e:
        solve(p)
    assert str(e.value) == ("no choice meets decode_seconds: needs 0.0123 at best, 0.01 allowed; "
                            "weight_bytes: needs 8e+10 at best, 7e+10 allowed")
    assert e.value.binding == [Binding("decode_seconds", pytest.approx(0.0123), 0.01, "<="),
                               Binding("weight_bytes", 8e10, 7e10, "<=")]
    p = two_layers(limits={"decode_seconds": 0.01, "weight_bytes": 2e11})
    with pytest.raises(Infeasible) as e:
        solve(p)
    assert str(e.value) == "no choice meets decode_seconds: needs 0.0123 at best, 0.01 allowed"


def test_infeasible_names_limits_that_conflict_together():
    p = two_layers({"params": [3.0, 2.0, 3.0, 2.0]}, limits={"decode_seconds": 0.0125, "weight_bytes": 1.1e11,
                                                             "params": 10.0}, uniform={"ssm_state": [16, 16, 16, None]})
    assert minimum(p, "decode_seconds", drop=("weight_bytes",)) <= 0.0125
    assert minimum(p, "weight_bytes", drop=("decode_seconds",)) <= 1.1e11
    with pytest.raises(Infeasible) as e:
        solve(p)
    msg = str(e.value)
    assert msg.startswith("decode_seconds <= 0.0125 and weight_bytes <= 1.1e+11 cannot hold together")
    assert "decode_seconds: needs 0.013 at best, 0.0125 allowed" in msg
    assert "weight_bytes: needs 1.2e+11 at best, 1.1e+11 allowed" in msg
    assert "params" not in msg and "ssm_state" not in msg
    assert e.value.conflict == ["decode_seconds <= 0.0125", "weight_bytes <= 1.1e+11"]
    assert e.value.binding == [Binding("decode_seconds", pytest.approx(0.013), 0.0125, "<="),
                               Binding("weight_bytes", 1.2e11, 1.1e11, "<=")]


def test_infeasible_lower_bound_and_uniform_groups():
    p = two_layers(limits={"decode_seconds": 1.0}, lower={"weight_bytes": 1.3e11})
    with pytest.raises(Infeasible, match=r"weight_bytes: reaches 1.2e\+11 at most, 1.3e\+11 required"):
        solve(p)
    p = two_layers(limits={}, uniform={"ssm_state": [64, 128, 256, 32]})
    with pytest.raises(Infeasible) as e:
        solve(p)
    assert str(e.value) == ("no label of uniform group ssm_state is offered by every layer that must take one "
                            "(layer 0: [64, 128], layer 1: [256, 32])")
    p = two_layers(limits={}, uniform={"a": [1, 2, 1, 2], "b": [1, 2, 2, 1]})   # each can alone, not both
    with pytest.raises(Infeasible, match="uniform groups a, b cannot hold together"):
        solve(p)
    p = two_layers(limits={}, uniform={"ssm_state": [64, 128, -1, 64]})     # layer 1 may leave the group
    assert solve(p, n_solutions=3)[0].objective == 0.0 and len(solve(p, n_solutions=5)) == 3


def test_bounds_hold_to_a_relative_tolerance_of_1e_9_exactly():
    p = Problem(layer=[0, 0, 1, 1], score=[1.0, 0.0, 1.0, 0.0], costs={"a": [0.0, 1.0, 0.0, 1.0]},
                limits={"a": 1.99999999})          # (1, 3) is over by 5e-9: within HiGHS's tolerance, not ours
    (sol,) = solve(p)
    assert sol.totals["a"] == 1.0 and sol.objective == 1.0
    p = Problem(layer=[0, 0, 1, 1], score=[1.0, 0.0, 1.0, 0.0], costs={"a": [1e11, 1e11 + 50] * 2},
                limits={"a": 2e11})                # (1, 3) is over by 5e-10: within ours, not HiGHS's
    (sol,) = solve(p)
    assert sol.totals["a"] == 2e11 + 100 and sol.objective == 0.0


def test_near_ties_in_the_objective_are_resolved():
    """Scores 1e-7 apart: HiGHS's absolute gap (1e-6) must not stop it short."""
    rng = np.random.default_rng(1)
    for _ in range(8):
        layer = np.repeat(np.arange(6), 3)
        score = rng.integers(0, 3, 18) + rng.integers(0, 2, 18) * 1e-7
        cost = rng.integers(1, 10, 18).astype(float)
        lo, hi = cost.reshape(6, 3).min(1).sum(), cost.reshape(6, 3).max(1).sum()
        p = Problem(layer=layer, score=score, costs={"a": cost}, limits={"a": lo + 0.4 * (hi - lo)})
        assert close(solve(p)[0].objective, min(total(score, c) for c in feasible(p)))


def test_single_option_layers_and_bad_input():
    p = Problem(layer=[0, 1, 1, 2], score=[5.0, 1.0, 0.0, 2.0], costs={"a": [1.0, 0.0, 3.0, 1.0]}, limits={"a": 4})
    (sol,) = solve(p)
    assert sol.choice.tolist() == [0, 1, 3] and sol.totals == {"a": 2.0}
    with pytest.raises(PassError, match="layers 0..L-1"):
        Problem(layer=[0, 2], score=[0, 0], costs={}, limits={})
    with pytest.raises(PassError, match="without costs"):
        Problem(layer=[0], score=[0], costs={}, limits={"a": 1})


def test_full_scale_instance_solves_to_optimality():
    rng = np.random.default_rng(0)
    n_layers, k = 88, 32
    layer = np.repeat(np.arange(n_layers), k)
    keep = rng.uniform(0.2, 1.0, layer.size)
    keep[::k] = 1.0                                                   # the parent's own block
    score = (1 - keep) ** 2 * rng.uniform(0.5, 2.0, layer.size)
    costs = {"decode": keep * rng.uniform(0.9, 1.1, layer.size) * 1e-4,
             "prefill": keep ** 1.5 * 2e-2, "bytes": keep * 1.5e9, "params": keep * 1.3e9}
    parent = {r: math.fsum(c[::k]) for r, c in costs.items()}
    limits = {"decode": 0.6 * parent["decode"], "prefill": 0.6 * parent["prefill"], "bytes": 0.6 * parent["bytes"]}
    mamba = layer < 40
    labels = np.where(mamba, np.arange(layer.size) % 3, -1)
    p = Problem(layer=layer, score=score, costs=costs, limits=limits, uniform={"state": labels},
                lower={"params": 0.4 * parent["params"]})
    t0 = time.perf_counter()
    (sol,) = solve(p, time_limit=20)
    assert sol.status == "optimal" and time.perf_counter() - t0 < 10
    assert all(sol.totals[r] <= lim for r, lim in limits.items()) and sol.totals["params"] >= p.lower["params"]
    assert len(set(labels[sol.choice[:40]])) == 1


def test_dominated_options_are_those_another_of_their_layer_and_label_beats_on_every_count():
    from puzzlekit.passes.puzzle.mip import _constraints, _dominated

    # layer 0: option 1 is beaten by option 0 (score and cost); option 2 ties option 0 exactly (later index);
    # option 3 is cheaper in cost but worse in score (kept); option 4 would be beaten but has another label
    p = Problem(layer=[0, 0, 0, 0, 0, 1, 1], score=np.array([1.0, 2.0, 1.0, 3.0, 5.0, 0.0, 0.0]),
                costs={"t": np.array([2.0, 2.0, 2.0, 1.0, 9.0, 1.0, 1.0]), "q": np.array([5.0, 5, 5, 5, 5, 5, 4])},
                limits={"t": 10.0}, lower={"q": 1.0}, uniform={"g": ["a", "a", "a", "a", "b", "a", "b"]})
    assert _dominated(p, p.score, _constraints(p)).tolist() == [False, True, True, False, False, False, False]


@PROPERTY
@given(problems(), st.sampled_from([-1.0, -1e-3, 0.0, 1e-3, 1.0]))
def test_a_choice_below_a_score_to_beat_is_the_optimum_and_none_is_found_when_none_exists(p, delta):
    ok = feasible(p)
    if not ok:
        return
    best = min(total(p.score, c) for c in ok)
    beat = best + delta * max(1.0, abs(best))
    sols = solve(p, beat=beat)
    if best < beat - 1e-6 * max(1.0, abs(beat)):  # a choice beats it: the optimum is found
        assert len(sols) == 1 and close(sols[0].objective, best) and meets(p, sols[0].choice)
    else:  # none beats it: nothing, or a choice that does not beat it either
        assert not sols or sols[0].objective >= beat - 1e-6 * max(1.0, abs(beat))
