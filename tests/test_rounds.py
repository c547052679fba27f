"""Later rounds of Iterative Puzzle: new shrinks are trained with BLD on the current model's own activations, and
the weights scored are the weights realised. On the built-in model with the small library (conftest)."""
from __future__ import annotations

import pytest
import torch

from puzzlekit import ir
from puzzlekit.backends.torch.stream import StreamedProgram
from puzzlekit.text.data import held_out_windows, load_corpus, sequential_windows
from puzzlekit.ir.checkpoint import spec_to_dict
from puzzlekit.passes import PassManager
from puzzlekit.passes.puzzle.bld import block_module, nmse
from puzzlekit.passes.puzzle.importance import compute_importance
from puzzlekit.passes.puzzle.rounds import candidate_weights, make_options, realise_from, rescore
from puzzlekit.passes.puzzle.score import Scorer, sweep_inputs
from puzzlekit.passes.puzzle.search import realise
from puzzlekit.tools.default_model import model_path


@pytest.fixture(scope="module")
def round2(small_library):
    """A round-1 child (every layer's first shrink, library weights), the options of its next round and their
    scores: (lib, child, ranks, calib, scoring windows, scores, made)."""
    lib = small_library
    first = {}
    for r in lib.rows:
        if r["steps"] and r["layer"] not in first:
            first[r["layer"]] = r
    child = realise(ir.load(model_path(None)), lib, list(first.values()))
    st, corpus = lib.manifest["settings"], load_corpus(None)
    calib = sequential_windows(corpus.train, st["seq"], limit=st["calib_windows"])
    windows = held_out_windows(corpus, "scoring", st["seq"] + 1, limit=st["score_windows"])
    ranks = compute_importance(child, calib)["layers"]
    scores, made = rescore(lib, child, ranks, windows, calib)
    return lib, child, ranks, calib, windows, scores, made


def _shrinks(lib, child, made):
    """The BLD-trained options: those made for a layer from its own block kind."""
    kinds = [b.op.kind for b in child.blocks()]
    return [r for r in lib.rows if (r["layer"], r["id"]) in made and lib.spec(r).kind == kinds[r["layer"]]]


def test_a_later_rounds_shrinks_are_trained_to_reproduce_the_current_blocks_delta(round2):
    """The trained shrinks differ from their importance slices and, together, reproduce the current blocks'
    deltas better on held-out text neither saw (with 8 calibration windows one shrink alone may not)."""
    lib, child, ranks, _, _, _, made = round2
    shrinks = _shrinks(lib, child, made)
    assert shrinks and made.report["trained"] == len(shrinks)
    held = held_out_windows(load_corpus(None), "selection", lib.manifest["settings"]["seq"], limit=4)
    inputs = sweep_inputs(StreamedProgram(child), held)
    before = after = 0.0
    trained = 0
    for r in shrinks:
        key, spec = (r["layer"], r["id"]), lib.spec(r)
        sliced = candidate_weights(lib, r, child, ranks)
        if all(torch.equal(made[key][k], v) for k, v in sliced.items()):
            continue  # BLD kept the slice: training gained less than 10% on its held-back windows
        trained += 1
        x = inputs(r["layer"])
        d = inputs(r["layer"] + 1) - x
        before += nmse(block_module(spec, sliced), x, d)
        after += nmse(block_module(spec, made[key]), x, d)
    assert trained == made.report["improved"] >= 1
    assert after < 0.9 * before, (before, after)
    assert made.report["final_nmse"] < made.report["initial_nmse"]


def test_the_weights_realised_are_the_weights_scored(round2):
    """One option other than the kept block per layer (a trained shrink where there is one), realised: its
    tensors are the made ones, and scoring them afresh gives the score the search saw, which the untrained
    slice does not."""
    lib, child, ranks, _, windows, scores, made = round2
    shrinks = {r["layer"]: r for r in _shrinks(lib, child, made)}
    rows = [shrinks.get(i) or next(r for r in lib.rows if r["layer"] == i and r["id"] == "linear")
            for i in range(len(child.blocks()))]
    stream = StreamedProgram(child)
    scorer = Scorer(stream, windows, sweep_inputs(stream, windows[:, :-1]))
    out = realise_from(child.copy(), lib, rows, made)
    blocks, now, compared = child.blocks(), out.blocks(), 0
    for r in rows:
        key, spec, node = (r["layer"], r["id"]), lib.spec(r), now[r["layer"]]
        realised = out.node_weights(node)
        assert spec_to_dict(node.op) == spec_to_dict(spec)
        assert realised.keys() == made[key].keys()
        assert all(torch.equal(realised[k], made[key][k]) for k in realised)
        rescored = scorer.score_layer(r["layer"], [block_module(spec, realised)])[0]
        assert rescored["kl"] == pytest.approx(scores[key]["kl"], rel=1e-5, abs=1e-9)
        if r["id"] == "linear":  # fitted after the current block's own norm
            assert torch.equal(realised["norm.weight"], child.node_weights(blocks[r["layer"]])["norm.weight"])
            continue
        sliced = candidate_weights(lib, r, child, ranks)
        if not all(torch.equal(realised[k], v) for k, v in sliced.items()):  # BLD kept its training
            compared += 1
            untrained = scorer.score_layer(r["layer"], [block_module(spec, sliced)])[0]
            assert untrained["kl"] != pytest.approx(scores[key]["kl"], rel=1e-3)
    assert compared >= 1


def test_a_later_round_makes_the_same_weights_twice(round2):
    lib, child, ranks, calib, _, _, made = round2
    again = make_options(lib, child, ranks, calib)
    assert again.names == made.names
    for key in made.names:
        assert all(torch.equal(again[key][k], v) for k, v in made[key].items()), key


def test_a_later_puzzle_pass_reports_its_bld(small_library):
    """A second puzzle pass from the first one's child: its options are made, scored and realised, and its
    report says how many shrinks BLD trained and their loss before and after."""
    prog = ir.load(model_path(None))
    total = prog.param_counts()["total"]
    lib = small_library.path
    am = PassManager(f"snapshot{{name=teacher}},puzzle{{library={lib},max_params={0.7 * total},parent=teacher}},"
                     f"puzzle{{library={lib},max_params={0.65 * total},parent=teacher}}").run(prog)
    first, second = am.reports["puzzle"]
    assert first["bld"] is None and second["rescored"]
    bld = second["bld"]
    assert bld["trained"] >= 1 and 0 <= bld["improved"] <= bld["trained"]
    assert 0 < bld["final_nmse"] < bld["initial_nmse"]
    assert prog.param_counts()["total"] <= 0.65 * total
    ir.verify(prog)
