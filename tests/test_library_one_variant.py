"""The library built one variant at a time: the same rows and weights as variants trained and scored on their own,
at most one variant's block alive at once, a build stopped between training and scoring resuming per variant, the
estimate counting one variant's training as a layer's work, and a MoE layer's experts loaded into their stacked
tensors without a second copy."""
from __future__ import annotations

import gc
import json
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from puzzlekit import ir
from puzzlekit.backends.torch.device import Compute
from puzzlekit.backends.torch.stream import StreamedProgram
from puzzlekit.passes.puzzle import LibrarySettings, build, build_library
from puzzlekit.passes.puzzle.bld import block_module, distill_block, seed_of
from puzzlekit.passes.puzzle.grid import Variant, load_grid, variants
from puzzlekit.passes.puzzle.library import slice_variant
from puzzlekit.passes.puzzle.score import Scorer, sweep_inputs
from puzzlekit.tools.default_model import model_path


@pytest.fixture(scope="module")
def parent():
    return ir.load(model_path(None))


def _files(lib: Path) -> dict:
    return {p.relative_to(lib): p.read_bytes() for p in sorted(lib.rglob("*"))
            if p.is_file() and p.name != "timings.json"}


# -- loading a MoE layer ----------------------------------------------------------------------------------------
LOAD = """
import sys, torch
from puzzlekit.backends.torch import load_into
from puzzlekit.ir.ops import MoE
from puzzlekit.ir.weights import WeightStore, lazy_tensors
op = MoE(256, 512, 8, 128, 0)
store = WeightStore()
store.update(lazy_tensors(__import__("pathlib").Path(sys.argv[1])))
with torch.device("meta"):
    block = op.build()
def status(field):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(field))
open("/proc/self/clear_refs", "w").write("5")  # the peak so far (imports' included) reset to what is held now
before = status("VmRSS:")
load_into(block, store, "cpu", [])
peak = status("VmHWM:")
experts = block.mixer.experts
print(peak - before, sum(t.numel() * t.element_size() for t in experts.parameters()),
        float(experts.up_proj.detach()[511, 3, 7]), float(experts.down_proj.detach()[300, 9, 2]))
"""


def test_loading_a_moe_layer_holds_its_experts_once(tmp_path):
    """512 experts (128 MB) read from a checkpoint into their stacked tensors: the process grows by about one copy
    of them (a run of the read at a time), where reading the layer and stacking what was read holds two."""
    from puzzlekit.ir.ops import MoE

    g = torch.Generator().manual_seed(0)
    tensors = {k: torch.randn(shape, generator=g) for k, shape in MoE(256, 512, 8, 128, 0).params().items()}
    f = tmp_path / "moe.safetensors"
    save_file(tensors, str(f))
    p = subprocess.run([sys.executable, "-c", LOAD, str(f)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    grown, stacked, up, down = (float(x) for x in p.stdout.split())
    assert stacked == 512 * 2 * 128 * 256 * 4
    assert up == tensors["mixer.experts.511.up_proj.weight"][3, 7].item()
    assert down == tensors["mixer.experts.300.down_proj.weight"][9, 2].item()
    assert grown < 1.4 * stacked, (grown / stacked)


# -- the build -------------------------------------------------------------------------------------------------
#: a MoE layer's parent, three shrinks and noop, other layers' parent and noop; two BLD steps a shrink: fast
LEAN_GRID = "[moe]\nexperts = [1.0, 0.5]\ntop_k = [1.0, 0.5]\n[replacements]\nkinds = [\"noop\"]\n"
LEAN = dict(calib_windows=4, score_windows=2, seq=32, bld_tokens=256)


class Watch:
    """Watches a build through its real parts: the variant blocks alive whenever one starts training, the
    variants trained, and each scoring call's layer and count."""

    def __init__(self, mp):
        self.blocks, self.alive, self.trained, self.scored = [], [], 0, []
        make, train, watch = build.block_module, build.distill_block, self

        def block_module(*args, **kwargs):
            b = make(*args, **kwargs)
            watch.blocks.append(weakref.ref(b))
            return b

        def distill(block, *args, **kwargs):
            alive = lambda: sum(r() is not None for r in watch.blocks)
            if alive() > 1:  # only a collection can lower the count (and a full one costs a tenth of a second)
                gc.collect()
            watch.alive.append(alive())
            watch.trained += 1
            return train(block, *args, **kwargs)

        class Counted(build.Scorer):
            def score_layer(self, layer, blocks):
                watch.scored.append((layer, sum(b is not None for b in blocks)))
                return super().score_layer(layer, blocks)

        mp.setattr(build, "block_module", block_module)
        mp.setattr(build, "distill_block", distill)
        mp.setattr(build, "Scorer", Counted)


@pytest.fixture(scope="module")
def lean_grid(tmp_path_factory):
    f = tmp_path_factory.mktemp("grid") / "lean.toml"
    f.write_text(LEAN_GRID)
    return f


@pytest.fixture(scope="module")
def lean(parent, lean_grid, tmp_path_factory):
    """The lean library built one variant at a time in memory, watched."""
    with pytest.MonkeyPatch.context() as mp:
        watch = Watch(mp)
        lib = build_library(parent, tmp_path_factory.mktemp("lean") / "lib", lean_grid, LibrarySettings(**LEAN))
    return lib, watch


def _runs(lib) -> dict[int, int]:
    """Per layer, the variants run through the later layers (all but the parent's own block)."""
    return {i: sum(r["id"] != "parent" for r in rows) for i, rows in lib.layers().items()}


def test_a_layer_holds_one_variant_at_a_time_and_scores_them_together(lean):
    """Every variant trains with no other variant block alive, and each layer's variants go through the later
    layers in one call when their outputs fit (each later layer read once per layer scored)."""
    lib, watch = lean
    assert watch.trained == sum(bool(r["steps"]) for r in lib.rows) >= 8
    assert watch.alive and set(watch.alive) == {1}, watch.alive
    assert watch.scored == [(i, n) for i, n in sorted(_runs(lib).items())]


def test_one_variant_at_a_time_gives_the_rows_of_variants_trained_and_scored_on_their_own(lean, parent):
    """An independent oracle: the layer inputs swept again, every variant of a MoE and a Mamba layer sliced from
    the parent in the library's importance order and trained alone from its seed, then all of the layer's blocks
    scored together in one call: the same weights to the bit and the same rows."""
    from puzzlekit.passes.puzzle import library_windows

    lib, _ = lean
    s = LibrarySettings(**lib.manifest["settings"])
    calib, held = library_windows(s, parent)
    ranks = json.loads((lib.path / "importance.json").read_text())["layers"]
    stream = StreamedProgram(parent, dtype=torch.float32)
    train = sweep_inputs(stream, calib, batch=4)
    scorer = Scorer(stream, held, sweep_inputs(stream, held[:, :-1]))
    blocks = parent.blocks()
    for i in (0, next(k for k, b in enumerate(blocks) if b.op.kind == "moe")):
        node, rows = blocks[i], lib.layers()[i]
        x, d = train(i), train(i + 1) - train(i)
        w = {k: t.float() for k, t in parent.node_weights(node).items()}
        made = []
        for r in rows:
            v = Variant(tuple(map(tuple, r["steps"])), r["replacement"])
            if v.replacement:
                made.append(block_module(lib.spec(r), {}))
                continue
            block = block_module(*slice_variant(node.op, w, v, ranks.get(node.path, {})))
            if v.steps:
                got = distill_block(block, x, d, s.bld_tokens, seed_of(i, v.id), s.bld_lr)
                assert got["trained"] == r["bld"]["trained"] and got["steps"] == r["bld"]["steps"]
            stored = lib.weights(r)
            mine = {k: t.detach() for k, t in build.checkpoint_state(block).items()}
            assert stored.keys() == mine.keys() and all(torch.equal(stored[k], mine[k]) for k in mine), r["id"]
            made.append(None if v == Variant() else block)
        assert [r["scores"] for r in rows] == scorer.score_layer(i, made), i


@pytest.mark.slow
def test_a_build_stopped_between_training_and_scoring_resumes_per_variant(lean, parent, lean_grid, tmp_path):
    """Stopped as a MoE layer's trained variants were about to be scored: the rerun trains none of them again
    (their weights are read back) and ends with the files of the uninterrupted build."""
    lib, _ = lean
    moe = next(i for i, b in enumerate(parent.blocks()) if b.op.kind == "moe")
    out, real = tmp_path / "lib", build._Group.flush

    def stop(group):
        if group.layer == moe and group.items:
            raise KeyboardInterrupt
        real(group)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(build._Group, "flush", stop)
        with pytest.raises(KeyboardInterrupt):
            build_library(parent, out, lean_grid, LibrarySettings(**LEAN))
    assert list(out.glob("variants/*/*.bld.json")) and not (out / "manifest.json").exists()
    with pytest.MonkeyPatch.context() as mp:
        watch = Watch(mp)
        again = build_library(parent, out, lean_grid, LibrarySettings(**LEAN))
    assert watch.trained == sum(bool(r["steps"]) for r in lib.rows if r["layer"] > moe)
    assert again.manifest == lib.manifest and _files(out) == _files(lib.path)


@pytest.mark.slow
def test_the_same_library_holding_every_variant_or_in_groups_that_fit_a_small_budget(lean, parent, lean_grid,
                                                                                     tmp_path):
    """The same files, to the byte, when a layer's variants are all held until scored (the other rule: more
    variant blocks alive at once), and when the budget's quarter holds two variants' outputs at a time (their
    outputs and successors: 4 x 32 kB): then a MoE layer's four go through the later layers in two calls."""
    lib, _ = lean
    with pytest.MonkeyPatch.context() as mp:
        held = Watch(mp)
        build_library(parent, tmp_path / "held", lean_grid, LibrarySettings(**LEAN), hold_all=True)
    assert max(held.alive) > 1 and _files(tmp_path / "held") == _files(lib.path)
    output = LEAN["score_windows"] * LEAN["seq"] * parent.blocks()[0].op.hidden * 4
    with pytest.MonkeyPatch.context() as mp:
        small = Watch(mp)
        build_library(parent, tmp_path / "small", lean_grid, LibrarySettings(**LEAN),
                      compute=Compute(memory=4 * 5 * output))
    assert _files(tmp_path / "small") == _files(lib.path)
    calls = {i: sum(1 for j, _ in small.scored if j == i) for i in _runs(lib)}
    assert calls == {i: -(-n // 2) for i, n in _runs(lib).items()} and max(calls.values()) == 2


def test_the_estimate_counts_one_variant_s_training_as_a_layer_s_work(capsys, tmp_path):
    """Super on one H100: a layer's work is the largest trained variant's (the `top_k` shrink of a MoE layer keeps
    every expert: float32 weights, starting copy, gradient and AdamW's two moments, 20 bytes a parameter) with the
    layer's activations beside it, not its 20 variants together; under a smaller budget the library fits."""
    from puzzlekit.tools.cli import main
    from puzzlekit.tools.default_model import config_path

    prog = ir.load(config_path("nemotron-3-super-120b-a12b"))
    moe = next(n.op for n in prog.blocks() if n.op.kind == "moe")
    grid = load_grid(None)
    assert any(v.steps == (("top_k", moe.top_k // 2),) for v in variants(moe, grid, "moe"))
    got = {}
    for memory in ("200GB", "100GB"):
        assert main(["library", "nemotron-3-super-120b-a12b", "-o", str(tmp_path / "lib"), "--estimate", "--hardware",
                     "h100:1", "--max-memory", memory, "--json"]) == 0
        got[memory] = json.loads(capsys.readouterr().out)["stages"][0]
    work = got["200GB"]["memory"]["layer work and activations"]
    assert 20 * moe.param_count() < work < 1.1 * 20 * moe.param_count()
    assert got["200GB"]["host_memory"]["the parent block"] == 4 * moe.param_count()
    assert got["100GB"]["fits"] and got["100GB"]["memory"]["layer work and activations"] == work
