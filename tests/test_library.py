"""The block library on the built-in model: importance-ordered slicing, BLD, scoring, the directory format,
resuming after a kill, and the grid's errors. One small library (a reduced grid, small budgets) is built once
per session; the default grid's full build is timed by benchmarks/library.py."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import torch

from puzzlekit import ir
from puzzlekit.backends.torch import materialize
from puzzlekit.text.data import held_out_windows, load_corpus, sequential_windows
from puzzlekit.passes.puzzle import GridError, Library, LibraryError, LibrarySettings, build_library, load_grid
from puzzlekit.backends.torch.stream import StreamedProgram
from puzzlekit.passes.puzzle.bld import block_module, linear_fit, nmse
from puzzlekit.passes.puzzle.grid import Variant, variants
from puzzlekit.passes.puzzle.importance import compute_importance
from puzzlekit.passes.puzzle.library import replacement_spec, slice_variant
from puzzlekit.passes.puzzle.score import Scorer, sweep_inputs
from puzzlekit.tools.cli import main
from puzzlekit.tools.default_model import config_path, model_path

SUPER = config_path("nemotron-3-super-120b-a12b")


@pytest.fixture(scope="module")
def parent():
    return ir.load(model_path(None))


@pytest.fixture(scope="module")
def grid_file(small_grid_file):
    return small_grid_file


@pytest.fixture(scope="module")
def lib(small_library):
    return small_library


SETTINGS = dict(calib_windows=8, score_windows=2, seq=64, bld_tokens=4096)  # the small library's (conftest)
CLI_SETTINGS = [x for k, v in SETTINGS.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def test_every_layer_has_its_variants(lib, parent):
    layers = lib.layers()
    assert sorted(layers) == list(range(len(parent.blocks())))
    want = {"mamba2": {"parent", "heads=4", "noop", "linear"},
            "moe": {"parent", "top_k=1", "experts=4", "top_k=1,experts=4", "noop", "linear"},
            "attention": {"parent", "q_heads=2", "noop", "linear"}, "mlp": {"parent", "d_ff=128", "noop", "linear"}}
    for i, n in enumerate(parent.blocks()):
        assert {r["id"] for r in layers[i]} == want[n.op.kind]
        for r in layers[i]:
            spec = lib.spec(r)
            assert r["params"] == sum(torch.Size(s).numel() for s in spec.params().values())
            assert {k: tuple(v.shape) for k, v in lib.weights(r).items()} == spec.params()


def test_identity_scores_zero_and_noop_scores_above_zero(lib):
    for layer, vs in lib.layers().items():
        by = {r["id"]: r for r in vs}
        assert by["parent"]["scores"]["kl"] == pytest.approx(0.0, abs=1e-7)
        assert by["parent"]["scores"]["top1"] == 1.0
        assert by["noop"]["scores"]["kl"] > 1e-4, f"layer {layer}"
        assert by["noop"]["scores"]["top1"] < 1.0


def test_the_layer_as_it_is_scores_what_running_its_block_gives(parent):
    """The scorer's shortcut for the parent's own block (`None`: scored from the sweep, no layer re-run) gives
    the scores of running that block and every later layer, beside another block scored in the same call."""
    held = held_out_windows(load_corpus(None), "scoring", 65, limit=3)
    stream = StreamedProgram(parent)
    scorer = Scorer(stream, held, sweep_inputs(stream, held[:, :-1]), batch=2)
    for layer in (0, 5, len(parent.blocks()) - 1):
        node = parent.blocks()[layer]
        w = parent.node_weights(node)
        own = block_module(*slice_variant(node.op, w, Variant(), {}))
        cut = block_module(replacement_spec(node.op, "noop"), {})
        short, ran, shrink = scorer.score_layer(layer, [None, own, cut])
        shrink_alone, = scorer.score_layer(layer, [cut])
        assert short["kl"] == 0.0 and short["top1"] == 1.0 and ran["kl"] == pytest.approx(0.0, abs=1e-7)
        assert short["lm_loss"] == pytest.approx(ran["lm_loss"], rel=1e-6) and ran["top1"] == 1.0
        assert short["lm_loss"] > 1.0 and shrink["kl"] > 1e-5 and shrink == shrink_alone


def test_bld_lowers_every_trained_variants_loss(lib):
    trained = [r for r in lib.rows if r["bld"]["trained"]]
    assert len(trained) >= 8
    for r in trained:
        assert r["bld"]["final_nmse"] < r["bld"]["initial_nmse"], (r["layer"], r["id"], r["bld"])
    # what was cut deeply had something to learn, and learnt it
    deep = [r for r in lib.rows if r["bld"]["initial_nmse"] > 0.05 and r["steps"]]
    assert deep and sum(r["bld"]["trained"] for r in deep) >= 0.5 * len(deep)


def test_the_library_reloads_identically_and_a_rerun_changes_nothing(lib, parent, grid_file):
    again = Library.open(lib.path, parent)
    assert again.manifest == lib.manifest
    files = lambda: {p: p.read_bytes() for p in sorted(lib.path.rglob("*")) if p.is_file() and p.name != "timings.json"}
    before = files()
    rebuilt = build_library(parent, lib.path, grid_file, LibrarySettings(**SETTINGS))
    assert rebuilt.manifest == lib.manifest
    assert files() == before
    r = next(r for r in lib.rows if r["id"] == "heads=4")
    w = again.weights(r)
    p = parent.copy()
    p.rewrite(p.node(r["path"]), op=again.spec(r), weights=w)
    ir.verify(p)


def test_a_library_of_another_parent_is_refused(lib, parent, grid_file):
    other = parent.copy()
    name = "backbone.layers.6.mixer.up_proj.weight"
    other.weights.set(name, other.weights.get(name) * 1.01)
    with pytest.raises(LibraryError, match="another parent"):
        Library.open(lib.path, other)
    with pytest.raises(LibraryError, match="another parent"):
        build_library(other, lib.path, grid_file, LibrarySettings(**SETTINGS))


def test_resuming_with_other_settings_is_refused(lib, parent, grid_file):
    with pytest.raises(LibraryError, match="other settings"):
        build_library(parent, lib.path, grid_file, LibrarySettings(**{**SETTINGS, "bld_tokens": 8192}))


def test_a_library_of_the_earlier_format_is_refused_with_the_fix(lib, parent, grid_file, tmp_path):
    """A /1 library was scored on held-out text that reported figures now use: opening or resuming it is refused."""
    assert lib.manifest["scored_on"] == "scoring"
    old = tmp_path / "old"
    old.mkdir()
    for name in ("manifest.json", "settings.json"):
        record = json.loads((lib.path / name).read_text())
        (old / name).write_text(json.dumps({**record, "format": "puzzlekit-block-library/1"}))
    for attempt in (lambda: Library.open(old, parent),
                    lambda: build_library(parent, old, grid_file, LibrarySettings(**SETTINGS))):
        with pytest.raises(LibraryError, match=r"holds a puzzlekit-block-library/1 library: its scores were measured "
                                               r"on held-out text .* build it again with `puzzlekit library"):
            attempt()


def test_a_killed_library_command_resumes_to_the_same_manifest(lib, grid_file, tmp_path, capsys):
    """A library process killed part-way leaves whole variants behind; the same command (here in this process)
    resumes from them to the manifest of a build that was never stopped."""
    out = tmp_path / "lib"
    argv = ["library", "-o", str(out), "--grid", str(grid_file), *CLI_SETTINGS,
            "--threads", str(torch.get_num_threads())]  # as the fixture computed: the same numbers to the last bit
    p = subprocess.Popen([sys.executable, "-m", "puzzlekit.tools", *argv], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    try:
        while p.poll() is None and len(list(out.glob("variants/*/*.json"))) < 6:
            time.sleep(0.05)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    done = len(list(out.glob("variants/*/*.json")))
    assert 0 < done < len(lib.rows) and not (out / "manifest.json").exists()
    assert main(argv + ["--json"]) == 0, capsys.readouterr().err[-3000:]
    assert json.loads((out / "manifest.json").read_text()) == lib.manifest


def test_importance_order_beats_random_order(parent):
    """At equal size, slicing by importance loses less (KL to the parent, no BLD) than random slicing: in all
    but at most one of six cuts, and in total."""
    corpus = load_corpus(None)
    calib = sequential_windows(corpus.train, 128, limit=16)
    held = sequential_windows(corpus.valid, 129, limit=4)
    ranks = compute_importance(parent, calib)["layers"]
    stream = StreamedProgram(parent)
    scorer = Scorer(stream, held, sweep_inputs(stream, held[:, :-1]))
    g = torch.Generator().manual_seed(0)
    cases = [(0, "heads", 4), (1, "d_ff", 64), (3, "q_heads", 2), (6, "d_ff", 128), (9, "state", 32), (11, "experts", 4)]
    ours, theirs = [], []
    for layer, axis, n in cases:
        node = parent.blocks()[layer]
        w = {k: v for k, v in parent.node_weights(node).items()}
        def kl(r):
            block = block_module(*slice_variant(node.op, w, Variant(((axis, n),)), r))
            return scorer.score_layer(layer, [block])[0]["kl"]
        ax = node.op.axes()[axis]
        per = ax.size // ax.groups
        rnd = []
        for _ in range(3):
            perms = [torch.randperm(per, generator=g).tolist() for _ in range(ax.groups)]
            if ax.per_unit:
                rnd.append(kl({axis: [torch.randperm(ax.size, generator=g).tolist() for _ in range(node.op.experts)]}))
            else:
                rnd.append(kl({axis: perms if ax.groups > 1 else perms[0]}))
        ours.append(kl(ranks[node.path]))
        theirs.append(sum(rnd) / len(rnd))
    wins = sum(a < b for a, b in zip(ours, theirs))
    assert wins >= len(cases) - 1 and sum(ours) < sum(theirs), list(zip(cases, ours, theirs))


def test_least_squares_linear_beats_the_weight_product(parent):
    """The `linear` replacement of the MLP layer: a fit on activations against W_down @ W_up."""
    calib = sequential_windows(load_corpus(None).train, 128, limit=16)
    inputs = sweep_inputs(StreamedProgram(parent), calib)
    node = parent.blocks()[6]
    w = parent.node_weights(node)
    x, d = inputs(6), inputs(7) - inputs(6)
    fitted = linear_fit(w["norm.weight"], node.op.eps, x, d)
    anchor = w["mixer.down_proj.weight"] @ w["mixer.up_proj.weight"]
    err = {name: nmse(block_module(ir.ops.Linear(128), {"norm.weight": w["norm.weight"], "mixer.linear.weight": m}), x, d)
           for name, m in (("fit", fitted), ("anchor", anchor))}
    assert err["fit"] < err["anchor"] and err["fit"] < 1.0


def test_a_weightless_library_of_the_super_config(tmp_path):
    prog = ir.load(SUPER)
    lib = build_library(prog, tmp_path / "super")
    assert lib.weightless and len(lib.layers()) == 88
    for layer, vs in lib.layers().items():
        assert len(vs) >= 8 and all("scores" not in r and "bld" not in r for r in vs)
    moe = next(r for r in lib.rows if r["id"] == "d_ff=1344,top_k=11,experts=256")
    assert lib.spec(moe).d_ff == 1344 and lib.spec(moe).top_k == 11 and lib.spec(moe).experts == 256
    with pytest.raises(LibraryError, match="weightless"):
        lib.weights(moe)


def test_the_library_command_builds_a_weightless_library_from_a_shipped_config_without_a_tokenizer(tmp_path, capsys):
    """A bare config reads no text, so its 131k vocabulary needs no tokenizer; the plan on it answers."""
    out = tmp_path / "super"
    assert main(["library", "nemotron-3-super-120b-a12b", "-o", str(out), "--grid", "planning", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["weightless"] and got["layers"] == 88 and got["variants"] == len(Library.open(out).rows)
    assert main(["plan", str(out), "--target", "h100", "--scenario", "long-1m", "--recipe", "nvfp4-hybrid",
                 "--concurrency", "8", "--keep", "attention", "--uniform", "mamba2.state", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["status"] == "optimal" and plan["predicted"]["memory_bytes"] <= plan["limits"]["memory_bytes"]


@pytest.mark.parametrize("text,match", [
    ("[mamba2]\nheads = [5]\n", r"backbone.layers.0 \(mamba2\): heads=5 is not a multiple of its 2 groups"),
    ("[moe]\ntop_k = [9]\n", r"backbone.layers.1 \(moe\): top_k=9 exceeds the parent's 2"),
    ("[moe]\nexperts = [1]\n", r"backbone.layers.1 \(moe\): experts=1 is below top_k=2"),
    ("[moe]\nwidth = [0.5]\n", "moe has no axis 'width'"),
    ("[moe]\nd_ff = []\n", "moe.d_ff must be a non-empty list"),
    ("[moe]\nd_ff = [1.5]\n", "moe.d_ff value 1.5"),
    ("", "is empty"),
    ("[conv]\nwidth = [2]\n", r"unknown block kind \[conv\]"),
    ("[replacements]\nkinds = [\"dense\"]\n", "replacements"),
    ("[moe\n", "not valid TOML"),
])
def test_bad_grids_name_the_layer_axis_and_value(parent, tmp_path, text, match):
    f = tmp_path / "grid.toml"
    f.write_text(text)
    with pytest.raises(GridError, match=match):
        grid = load_grid(f)
        from puzzlekit.passes.puzzle.grid import check_grid

        check_grid(grid, parent)
        for n in parent.blocks():
            variants(n.op, grid, n.path)


def test_the_library_command_reports_bad_grids_without_a_traceback(tmp_path, capsys):
    f = tmp_path / "grid.toml"
    f.write_text("[mamba2]\nheads = [5]\n")
    assert main(["library", "-o", str(tmp_path / "lib"), "--grid", str(f)]) == 1
    err = capsys.readouterr().err
    assert "heads=5" in err and "Traceback" not in err
    assert not (tmp_path / "lib").exists()


@pytest.mark.slow
def test_torchrun_shares_the_layers_out_and_gives_the_same_library(lib, grid_file, tmp_path):
    """Two processes (gloo on CPU), each with the thread count of this one, build the same manifest."""
    import os

    out = tmp_path / "lib"
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29517",
           "-m", "puzzlekit.tools", "library", "-o", str(out), "--grid", str(grid_file), *CLI_SETTINGS, "--json",
           "--threads", str(torch.get_num_threads())]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads((out / "manifest.json").read_text()) == lib.manifest


@pytest.mark.slow  # heavy: runs with pytest -m slow
def test_at_2x_cpu_throughput_the_mip_child_beats_the_baselines(lib, parent, tmp_path, monkeypatch):
    """The measured cpu provider prices the variants; every child meets the same throughput target. The MIP's
    summed score is the least (it is optimal), and its realised child is far closer to the parent than the
    uniform one and about as close as the greedy one or closer (KL on held-out text is not exactly the sum of
    the replace-one-block scores, so a close race may go either way by a little). A baseline that cannot
    reach the target at all (uniform cuts need a fine enough grid) counts as infinitely far."""
    monkeypatch.setenv("PUZZLEKIT_CACHE", str(tmp_path))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # steady timings when other jobs share the cores (the provider keys its cache by it)
    try:
        _mip_against_baselines(lib, parent)
    finally:
        torch.set_num_threads(threads)


def _mip_against_baselines(lib, parent):
    from puzzlekit import evaluation as evaluate
    from puzzlekit.passes.puzzle.search import Constraints, PlanError, Search

    # every option (no engine's rules): at 2x cpu the default profile leaves one all-or-nothing Mamba cut, and
    # every method takes it (benchmarks/compress.py compares them under the profile at an h100 target)
    search = Search(lib, parent, [("cpu", "chat")], constraints=Constraints(speedup=2.0), engine="none")
    held = held_out_windows(load_corpus(None), "report", 129, limit=8)  # not the scores' windows
    teacher = materialize(parent)
    kl, score = {}, {}
    for method in ("mip", "uniform", "greedy"):
        try:
            plan = search.plan(method)
        except PlanError:
            assert method != "mip"
            kl[method] = score[method] = float("inf")
            continue
        score[method] = plan.objective
        assert all(plan.predicted[k] <= plan.limits[k] * (1 + 1e-9) for k in plan.predicted), method
        child = search.child(search.rows_of(plan), weights=True)
        kl[method] = evaluate.teacher_agreement(teacher, materialize(child), held)["kl"]
    assert min(kl["uniform"], kl["greedy"]) < float("inf"), kl
    assert score["mip"] <= min(score["uniform"], score["greedy"]) + 1e-12, score
    assert kl["mip"] < 0.5 * kl["uniform"] and kl["mip"] <= 1.1 * kl["greedy"], kl


def test_the_library_command_never_writes_into_its_input_or_a_foreign_directory(tmp_path, capsys):
    d = tmp_path / "notes"
    d.mkdir()
    (d / "keep.txt").write_text("mine")
    assert main(["library", "-o", str(d)]) == 1
    assert "holds no library" in capsys.readouterr().err and [p.name for p in d.iterdir()] == ["keep.txt"]
    assert main(["library", "-o", str(model_path(None))]) == 2
    assert "would replace the input" in capsys.readouterr().err


def test_a_variant_is_labelled_as_its_spec_has_it(parent):
    """The Mamba state axis counts channels over all groups (the id's 512); the spec, the plan and the
    report say the state per group (64)."""
    from puzzlekit.passes.puzzle.library import row_of, variant_label, variant_spec

    node = parent.blocks("mamba2")[0]
    total = node.op.groups * node.op.state
    v = Variant((("state", total // 2), ("heads", node.op.heads // 2)))
    row = row_of(0, node.path, v, variant_spec(node.op, v))
    assert row["id"] == f"state={total // 2},heads={node.op.heads // 2}"
    assert variant_label(row) == f"state={node.op.state // 2},heads={node.op.heads // 2}" == \
        f"state={row['spec']['state']},heads={row['spec']['heads']}"
    assert variant_label(row_of(0, node.path, Variant(), node.op)) == "parent"
    assert variant_label(row_of(0, node.path, Variant(replacement="noop"), variant_spec(node.op, Variant(replacement="noop")))) == "noop"
