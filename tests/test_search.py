"""The hardware-costed search over a library: the MIP's linear costs equal the cost model's figures for the
realised child, constraints hold, baselines, realisation, and clear errors. Weightless libraries (prior
scores, analytic GPU targets) keep these fast; measured libraries are exercised in test_library."""
from __future__ import annotations

import functools
import json
import subprocess
import sys

import pytest

from puzzlekit import ir
from puzzlekit.backends.cost import CostModel, get_scenario
from puzzlekit.passes.puzzle import build_library
from puzzlekit.passes.puzzle.search import Constraints, PlanError, Search as _Search

#: the search itself, over every option (replacements included) without an engine's rules (test_engines.py)
Search = functools.partial(_Search, engine="none")
from puzzlekit.tools.cli import main
from puzzlekit.tools.default_model import DEFAULT_MODEL, config_path

SUPER = config_path("nemotron-3-super-120b-a12b")
REL = 1e-9


@pytest.fixture(scope="module")
def meta_lib(tmp_path_factory):
    """A weightless library of the built-in model's architecture (its config alone)."""
    parent = ir.load(DEFAULT_MODEL / "config.json")
    return parent, build_library(parent, tmp_path_factory.mktemp("lib") / "lib")


@pytest.fixture(scope="module")
def small_meta_lib(small_grid_file, tmp_path_factory):
    """A weightless library of the built-in model on the small grid (4-6 options a layer, not 8-20): for the
    tests whose property is not the size of the problem, a MIP that solves in a fraction of the time. (Under the
    CLI's default engine profile it reaches a speedup of about 1.1 on h100/chat, with one plan above 1.0.)"""
    parent = ir.load(DEFAULT_MODEL / "config.json")
    return parent, build_library(parent, tmp_path_factory.mktemp("small") / "lib", small_grid_file)


@pytest.fixture(scope="module")
def super_lib(tmp_path_factory):
    parent = ir.load(SUPER)
    return parent, build_library(parent, tmp_path_factory.mktemp("super") / "lib")


def realised_figures(search: Search, plan, target: str, scenario: str, constraints: Constraints, recipe=""):
    """The realised child's figures by the cost model, in the plan's layout at its batch per replica."""
    child = search.child(search.rows_of(plan))
    cm = CostModel(child, target, get_scenario(scenario, recipe=recipe or None), layout=plan.layout)
    s, L = cm.scenario, cm.layout
    b = plan.batch // L.replicas
    requests = max(b if constraints.speedup else 0, -(-constraints.concurrency // L.replicas))
    serve = cm.serve_seconds(b)
    return child, {"decode_seconds": cm.decode_step_seconds(b), "prefill_seconds": cm.prefill_seconds(),
                   "serve_seconds": serve, "rate_floor_seconds": serve,
                   "memory_bytes": cm.device_weight_bytes() + L.requests_per_group(requests) * cm.device_state_bytes(),
                   "latency_seconds": cm.decode_step_seconds(1), "params": child.param_counts()["total"],
                   "active_params": child.param_counts()["active"], "context": s.context_len}


@pytest.mark.parametrize("target,scenario,constraints", [
    ("h100", "chat", Constraints(speedup=2.0)),
    ("8xb200", "chat", Constraints(speedup=1.5, keep=("mlp",))),
    ("h100", "prefill-heavy", Constraints(prefill_s=0.0005, decode_ms=0.15, max_params=1.0e6)),
    ("b200", "chat", Constraints(concurrency=4, max_active=0.8e6, uniform=("mamba2.state",))),
])
def test_the_mips_linear_costs_equal_the_cost_model_for_the_realised_child(meta_lib, target, scenario, constraints):
    parent, lib = meta_lib
    search = Search(lib, parent, [(target, scenario)], constraints=constraints)
    plan = search.plan()
    assert plan.feasible and plan.status == "optimal" and plan.score_source == "prior"
    _, got = realised_figures(search, plan, target, scenario, constraints)
    assert set(plan.predicted) == set(plan.limits)
    for k, v in plan.predicted.items():
        assert v == pytest.approx(got[k], rel=REL), k
        assert v <= plan.limits[k] * (1 + REL), k
    if constraints.keep:
        assert [p["id"] for p in plan.layers if p["path"] == "backbone.layers.6"] == ["parent"]  # the MLP layer
    if constraints.uniform:
        states = {lib.spec(r).state for r in search.rows_of(plan) if r["kind"] == "mamba2"}
        assert len(states) == 1


def test_a_throughput_target_is_met_by_the_realised_child(meta_lib):
    parent, lib = meta_lib
    search = Search(lib, parent, [("h100", "chat")], constraints=Constraints(speedup=2.0))
    plan = search.plan()
    child = search.child(search.rows_of(plan))
    before = CostModel(parent, "h100", get_scenario("chat")).report()
    after = CostModel(child, "h100", get_scenario("chat")).report()
    assert after.throughput_tokens_per_second >= 2.0 * before.throughput_tokens_per_second * (1 - 1e-9)


def test_baselines_meet_the_constraints_and_score_no_better_than_the_mip(meta_lib):
    parent, lib = meta_lib
    search = Search(lib, parent, [("h100", "chat")], constraints=Constraints(speedup=1.3))
    best = search.plan()
    for method in ("uniform", "greedy"):
        p = search.plan(method)
        assert all(p.predicted[k] <= p.limits[k] * (1 + REL) for k in p.predicted), method
        assert p.objective >= best.objective - 1e-12, method


def test_diverse_alternatives(small_meta_lib):
    parent, lib = small_meta_lib
    plan = Search(lib, parent, [("h100", "chat")], constraints=Constraints(speedup=1.5)).plan(alternatives=3,
                                                                                             min_distance=2)
    seen = [[p["id"] for p in plan.layers]] + [[p["id"] for p in a["layers"]] for a in plan.alternatives]
    assert len(seen) == 3
    for i in range(3):
        for j in range(i):
            assert sum(a != b for a, b in zip(seen[i], seen[j])) >= 2


def test_runners_up_are_sought_only_within_their_time_budget(small_meta_lib):
    parent, lib = small_meta_lib
    search = Search(lib, parent, [("h100", "chat")], constraints=Constraints(speedup=1.5))
    best = search.plan()
    none = search.plan(alternatives=50, alternatives_seconds=0.0)  # the budget is spent at the first solution
    assert none.alternatives == [] and [p["id"] for p in none.layers] == [p["id"] for p in best.layers]


def test_a_throughput_target_beyond_any_batch_is_infeasible_naming_the_constraint(meta_lib):
    parent, lib = meta_lib
    for speedup in (1e6, 1e308):
        with pytest.raises(PlanError, match=r"^infeasible: (.|\n)*serve_seconds: needs .* allowed"):
            Search(lib, parent, [("h100", "chat")], constraints=Constraints(speedup=speedup)).plan()


#: runs CLI commands with HiGHS's habit simulated: writing to file descriptor 1 through C's stdio and directly (and
#: saying on Python's stderr that it ran). One process runs every case (a fresh one costs ~2 s of imports): each
#: command runs with descriptors 1 and 2 on files of their own, C's buffers flushed before they are pointed back
#: (as the process's exit would flush them), and what reached each descriptor goes to the results file argv[1].
NOISY_SOLVER = """
import ctypes, json, os, sys, tempfile
from puzzlekit.passes.puzzle import mip
libc = ctypes.CDLL(None)
real = mip.milp
def noisy(*args, **kwargs):
    libc.printf(b"HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();\\n")
    os.write(1, b"written past sys.stdout\\n")
    sys.stderr.write("the solver ran\\n")
    return real(*args, **kwargs)
mip.milp = noisy
from puzzlekit.tools.cli import main

def flush():
    sys.stdout.flush()
    sys.stderr.flush()
    libc.fflush(None)

def read(f):
    f.seek(0)
    return f.read().decode()

results = []
for argv in json.loads(sys.argv[2]):
    files, saved = [tempfile.TemporaryFile() for _ in (1, 2)], [os.dup(1), os.dup(2)]
    flush()
    os.dup2(files[0].fileno(), 1)
    os.dup2(files[1].fileno(), 2)
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    finally:
        flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
    results.append({"code": code, "out": read(files[0]), "err": read(files[1])})
with open(sys.argv[1], "w") as f:
    json.dump(results, f)
"""

#: LIB: the small library (a speedup of 1.1 is within its reach)
JSON_COMMANDS = [
    ["plan", "LIB", "--target", "h100", "--scenario", "chat", "--speedup", "1.1", "--json"],
    ["plan", "LIB", "--target", "h100", "--scenario", "chat", "--speedup", "1.1", "--alternatives", "3", "--json"],
    ["plan", "LIB", "--target", "h100", "--scenario", "chat", "--max-params", "1e6", "--method", "greedy", "--json"],
    ["inspect", "--json"], ["passes", "--json"], ["cost", "--target", "h100", "--scenario", "chat", "--json"],
]


@pytest.fixture(scope="module")
def json_outputs(small_meta_lib, tmp_path_factory):
    """{"code", "out", "err"} of each of JSON_COMMANDS, all run by one NOISY_SOLVER process."""
    _, lib = small_meta_lib
    commands = [[str(lib.path) if a == "LIB" else a for a in argv] for argv in JSON_COMMANDS]
    results = tmp_path_factory.mktemp("json") / "results.json"
    p = subprocess.run([sys.executable, "-c", NOISY_SOLVER, str(results), json.dumps(commands)], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout == ""  # nothing reached descriptor 1 between the commands either
    return json.loads(results.read_text())


@pytest.mark.parametrize("argv", JSON_COMMANDS)
def test_json_output_is_json_alone_even_when_the_solver_writes_to_stdout(json_outputs, argv):
    """What reaches the process's descriptor 1 under --json is one JSON document, and the solver's own lines reach
    neither it nor the user's stderr."""
    got = json_outputs[JSON_COMMANDS.index(argv)]
    assert got["code"] == 0, got["err"][-2000:]
    assert isinstance(json.loads(got["out"]), dict)
    assert "tmpSolver.run()" not in got["err"] and "past sys.stdout" not in got["err"]  # nor on the user's stderr
    if argv[0] == "plan" and "greedy" not in argv:
        assert "the solver ran" in got["err"]


def test_two_targets_at_once(small_meta_lib):
    parent, lib = small_meta_lib
    plan = Search(lib, parent, [("h100", "chat"), ("b200", "decode-heavy")],
                  constraints=Constraints(speedup=1.5)).plan()
    assert {k.split("@")[1] for k in plan.predicted} == {"h100/chat", "b200/decode-heavy"}
    assert all(plan.predicted[k] <= plan.limits[k] * (1 + REL) for k in plan.predicted)


def test_an_infeasible_target_names_the_binding_constraint(meta_lib):
    parent, lib = meta_lib
    search = Search(lib, parent, [("h100", "chat")], constraints=Constraints(max_params=1000))
    with pytest.raises(PlanError, match=r"params: needs .* at best, .* allowed"):
        search.plan()


def test_full_scale_planning_on_the_super_config(super_lib):
    """Both published deployment targets solve on a weightless 88-layer library with prior scores."""
    parent, lib = super_lib
    assert min(len(v) for v in lib.layers().values()) >= 8
    c = Constraints(concurrency=8, context=1 << 20, keep=("attention",), uniform=("mamba2.state",))
    search = Search(lib, parent, [("h100", "long-1m")], recipe="nvfp4-hybrid", constraints=c)
    plan = search.plan(time_limit=60)
    assert plan.predicted["memory_bytes"] <= plan.limits["memory_bytes"]
    assert plan.params_total < parent.param_counts()["total"]


def test_memory_out_of_reach_says_how_many_requests_fit(super_lib):
    parent, lib = super_lib
    c = Constraints(concurrency=64, keep=("attention",))
    search = Search(lib, parent, [("h100", "long-1m")], recipe="nvfp4-hybrid", constraints=c)
    with pytest.raises(PlanError, match=r"memory_bytes: needs .* GB at best, 79.26 GB allowed(.|\n)*\d+ requests fit"):
        search.plan()


def test_plan_command_json_and_child(small_meta_lib, tmp_path, capsys):
    _, lib = small_meta_lib
    out = tmp_path / "child"
    assert main(["plan", str(lib.path), "--target", "h100", "--scenario", "chat", "--speedup", "1.5", "--engine",
                 "none", "-o", str(out), "--json", "--extended"]) == 0  # the child may hold linear/noop blocks
    got = json.loads(capsys.readouterr().out)
    assert {"feasible", "solve_seconds", "params_total", "params_active", "layers", "predicted", "parent"} <= set(got)
    child = ir.load(out)
    assert [n.op.kind for n in child.blocks()] and child.find("mtp")
    assert json.loads((out / "config.json").read_text())["provenance"]["plan"]["objective"] == got["objective"]


@pytest.mark.parametrize("args,code,match", [
    (["--target", "h100", "--scenario", "chat", "--max-params", "1000"], 1, "params: needs"),
    (["--target", "h200x", "--scenario", "chat", "--speedup", "2"], 1, "unknown target 'h200x'"),
    (["--target", "h100", "--scenario", "brunch", "--speedup", "2"], 1, "unknown scenario 'brunch'"),
    (["--target", "h100", "--scenario", "chat", "--speedup", "2", "--uniform", "mamba2.width"], 1,
     "mamba2 has no attribute 'width'"),
    (["--target", "h100", "--scenario", "chat", "--speedup", "2", "--keep", "conv"], 1, "keep=.*conv"),
    (["--target", "h100", "--scenario", "chat"], 2, "name at least one constraint"),
    (["--target", "h100", "--speedup", "-1"], 2, "--speedup"),
    (["--target", "h100", "--scenario", "chat", "--speedup", "1e308"], 1, r"infeasible: (.|\n)*serve_seconds"),
    (["--target", "h100", "--scenario", "chat", "--speedup", "2", "--alternatives", "101"], 2,
     r"--alternatives: must be an integer >= 1 and <= 100"),
])
def test_plan_errors_are_clear(meta_lib, args, code, match, capsys):
    import re

    _, lib = meta_lib
    try:  # in this process: argparse's exits are SystemExit
        got = main(["plan", str(lib.path), *args])
    except SystemExit as e:
        got = e.code
    err = capsys.readouterr().err
    assert got == code and "Traceback" not in err, err
    assert re.search(match, err), err


def test_a_library_without_scores_is_refused_outside_the_prior(tmp_path, meta_lib):
    parent, lib = meta_lib
    manifest = dict(lib.manifest, weightless=False)
    d = tmp_path / "lib"
    d.mkdir()
    (d / "manifest.json").write_text(json.dumps(manifest))
    from puzzlekit.passes.puzzle import Library

    with pytest.raises(Exception, match="no 'kl' score"):
        Search(Library.open(d, parent), parent, [("h100", "chat")], constraints=Constraints(speedup=2))


def test_a_sweep_plans_each_speedup_as_a_plan_of_its_own_does(meta_lib, tmp_path, capsys):
    """`plan --sweep` keeps one search and its prices across the points: each point's objective, parameters and
    layout equal a separate `plan --speedup X`; an unreachable point is reported infeasible, not fatal."""
    _, lib = meta_lib
    base = ["plan", str(lib.path), "--target", "h100", "--scenario", "chat", "--json"]
    assert main(base + ["--sweep", "1.1,1.3,40", "--report", str(tmp_path / "sweep.png")]) == 0
    rows = json.loads(capsys.readouterr().out)["sweep"]
    assert [r["speedup"] for r in rows] == [1.1, 1.3, 40] and [r["feasible"] for r in rows] == [True, True, False]
    for r in rows[:2]:
        assert main(base + ["--speedup", str(r["speedup"])]) == 0
        alone = json.loads(capsys.readouterr().out)
        assert r["objective"] == pytest.approx(alone["objective"], rel=1e-9, abs=1e-12)
        assert (r["params"], r["layout"]) == (alone["params_total"], alone["layout"])
        assert r["throughput_ratio"] >= r["speedup"] * (1 - 1e-9)
    assert rows[0]["objective"] <= rows[1]["objective"]  # a harder target costs at least as much score
    assert (tmp_path / "sweep.png").stat().st_size > 1000
    assert main(base + ["--sweep", "2:1:0.1"]) == 2 and "--sweep" in capsys.readouterr().err
