"""The deployment model's search and workload: the batch chosen exactly (against brute force), memory for
the batch and the concurrency together, one context for parent and child, and the workload options and scenario files of `cost` and `compress`."""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re

import pytest

from puzzlekit import ir
from puzzlekit.backends.cost import CostModel, get_scenario
from puzzlekit.passes.puzzle import build_library
from puzzlekit.passes.puzzle.mip import Infeasible, solve
from puzzlekit.passes.puzzle.search import Constraints, Search as _Search

#: the search itself, over every option (replacements included) without an engine's rules (test_engines.py)
Search = functools.partial(_Search, engine="none")
from puzzlekit.tools.cli import main
from puzzlekit.tools.default_model import DEFAULT_MODEL


@pytest.fixture(scope="module")
def meta_lib(tmp_path_factory):
    parent = ir.load(DEFAULT_MODEL / "config.json")
    return parent, build_library(parent, tmp_path_factory.mktemp("lib") / "lib")


@pytest.mark.parametrize("floor,keep", [(1500.0, ("attention", "mamba2", "mlp")),
                                        (2000.0, ("attention", "moe", "mlp"))])
def test_the_batch_is_the_best_of_every_batch(meta_lib, floor, keep):
    """Branch and bound over the batch ranges finds what solving at every batch of the range finds."""
    parent, lib = meta_lib
    search = Search(lib, parent, [("h100", get_scenario("chat", rate_floor=floor))],
                    constraints=Constraints(speedup=1.3, keep=keep))
    plan = search.plan()
    ((li, b1, b2),) = search.spans()[0]
    assert 10 < b2 - b1 < 300
    best = math.inf
    for b in range(b1, b2 + 1):
        try:
            best = min(best, solve(search.problem(((li, b, b),)).problem)[0].objective)
        except Infeasible:
            pass
    assert plan.status == "optimal" and plan.objective == pytest.approx(best, rel=1e-9)
    assert all(plan.predicted[k] <= plan.limits[k] * (1 + 1e-9) for k in plan.predicted)


def test_memory_holds_the_batch_even_with_a_smaller_concurrency(meta_lib):
    """At 1M tokens memory binds the parent; the 1.5x throughput child's batch must fit although
    --concurrency asks for one request only (its memory row counts the batch, not the one request)."""
    parent, lib = meta_lib
    search = Search(lib, parent, [("h100", "long-1m")], constraints=Constraints(speedup=1.5, concurrency=1))
    assert search.base[0].binding == "memory"
    plan = search.plan()
    child = search.child(search.rows_of(plan))
    cm = CostModel(child, "h100", get_scenario("long-1m"), layout=plan.layout)
    assert plan.batch > 1
    need = cm.device_weight_bytes() + plan.batch * cm.device_state_bytes()
    assert need == pytest.approx(plan.predicted["memory_bytes"], rel=1e-9)
    assert need <= cm.usable_memory()


def test_parent_and_child_are_priced_at_one_context(meta_lib):
    parent, lib = meta_lib
    search = Search(lib, parent, [("h100", "chat")], constraints=Constraints(speedup=1.5, context=20000))
    assert search.base[0].scenario.context == 20000
    plan = search.plan()
    own = CostModel(parent, "h100", get_scenario("chat", context=20000), layout=plan.layout)
    b = plan.batch
    assert plan.parent["serve_seconds"] == pytest.approx(own.serve_seconds(b), rel=1e-9)


def test_a_head_that_accepts_more_makes_a_faster_child(meta_lib):
    parent, lib = meta_lib
    sc = get_scenario("chat", mtp_draft=3, mtp_acceptance=2.0)
    same = Search(lib, parent, [("h100", sc)], constraints=Constraints(speedup=2.0)).plan()
    better = Search(lib, parent, [("h100", sc)], constraints=Constraints(speedup=2.0, mtp_acceptance=3.0)).plan()
    assert better.objective < same.objective  # the better head leaves more of the budget to the trunk


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_cost_takes_a_workload_and_a_scenario_file(tmp_path, capsys):
    f = tmp_path / "mine.toml"
    f.write_text('[agents]\ninput_len = 4000\noutput_len = 500\nrate_floor = 20.0\nkv_dtype = "fp8"\n')
    rc, out, _ = _run(capsys, "cost", "--target", "8xh100", "--scenario", str(f), "--output-len", "300",
                      "--layout", "tp2.r4", "--json")
    r = json.loads(out)
    assert rc == 0 and r["layout"] == "tp2.r4" and r["layouts"] == [{**r["layouts"][0], "layout": "tp2.r4"}]
    assert (r["scenario"]["name"], r["scenario"]["input_len"], r["scenario"]["output_len"]) == ("agents", 4000, 300)
    rc, out, _ = _run(capsys, "cost", "--target", "8xh100", "--scenario", str(f), "--json")
    tried = json.loads(out)["layouts"]
    priced = [x for x in tried if not x.get("unservable")]  # the rest: layouts the engines cannot split it over
    assert len(tried) == 13 and 0 < len(priced) < 13
    assert json.loads(out)["throughput_tokens_per_second"] == max(x["throughput"] for x in priced)
    for argv, code, message in ((["--layout", "tp16"], 1, "layout tp16 uses 16 GPUs"),
                                (["--layout", "8"], 2, "tp<N>"), (["--mtp"], 2, "--mtp-acceptance"),
                                (["--mtp", "--mtp-acceptance", "9"], 1, r"in \[1, 4\]")):
        rc, _, err = _run(capsys, "cost", "--target", "8xh100", "--scenario", str(f), *argv)
        assert rc == code and re.search(message, err), (argv, rc, err)
    (tmp_path / "bad.toml").write_text("[x]\ninput_lenn = 3\n")
    rc, _, err = _run(capsys, "cost", "--target", "h100", "--scenario", str(tmp_path / "bad.toml"))
    assert rc == 1 and "unknown field(s) ['input_lenn']" in err


def test_cost_prices_speculative_decoding_at_the_measured_acceptance(tmp_path, capsys):
    """`--mtp` on a checkpoint that a run with mtp-check wrote: the acceptance stored in its provenance."""
    cfg = json.loads((DEFAULT_MODEL / "config.json").read_text())
    cfg["provenance"] = {"mtp_acceptance": {"length": 2.25, "drafts": 2}}  # as `run` writes it after mtp-check
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rc, out, _ = _run(capsys, "cost", str(tmp_path / "config.json"), "--target", "h100", "--scenario", "chat",
                      "--mtp", "--json")
    r = json.loads(out)
    assert rc == 0 and r["tokens_per_step"] == 2.25 and r["scenario"]["mtp_draft"] == 2
    rc, out, _ = _run(capsys, "cost", str(tmp_path / "config.json"), "--target", "h100", "--scenario", "chat",
                      "--mtp", "--mtp-acceptance", "1.5", "--json")
    assert json.loads(out)["tokens_per_step"] == 1.5 and json.loads(out)["scenario"]["mtp_draft"] == 3


def test_compress_writes_the_workload_it_priced(tmp_path):
    from puzzlekit.tools.compress import _workload

    args = argparse.Namespace(scenario="chat", input_len=None, output_len=None, rate_floor=None, gpus=None,
                              layout=None, estimate=False)
    with _workload(args, tmp_path / "a") as named:
        assert named == "chat" and not (tmp_path / "a").exists()
    args.input_len, args.rate_floor = 777, 0.0
    with _workload(args, tmp_path / "b") as path:
        assert path == str(tmp_path / "b" / "scenario.toml")
    assert get_scenario(path) == get_scenario("chat", input_len=777, rate_floor=0.0)
    args.estimate = True  # an estimate writes nothing: the scenario lives in a temporary file while it runs
    with _workload(args, tmp_path / "c") as temp:
        assert get_scenario(temp) == get_scenario("chat", input_len=777, rate_floor=0.0)
    assert not (tmp_path / "c").exists() and not os.path.exists(temp)
