"""Building a block library: importance -> variants sliced in importance order -> BLD -> scoring.

The expensive, target-independent half of Puzzle, done once per parent. Every variant is written as it
finishes (weights, then its row), so a killed build resumes where it stopped and ends with the same
manifest as an uninterrupted one (every variant trains from its own fixed seed). Under `torchrun` the
layers are shared out over the ranks (gloo on CPU) and rank 0 writes the manifest.
"""
from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ...backends.torch.device import CPU, Compute
from ...ir import Program, print_program
from ...outputs import check_output, write_json
from ...training import barrier, distributed
from .bld import block_activations, block_module, distill_block, linear_fit, nmse, seed_of
from .grid import Variant, check_grid, load_grid, variants
from .importance import compute_importance
from .library import (FORMAT, MANIFEST, Library, LibraryError, load_row, parent_hash, replacement_spec, row_of,
                      save_variant, slice_variant, variant_spec)
from .score import Scorer

SETTINGS = "settings.json"


@dataclass
class LibrarySettings:
    """What a library is built with; a resumed build must use the same."""

    grid: dict = field(default_factory=dict)
    calib_windows: int = 64  # training split windows for importance and BLD
    score_windows: int = 16  # held-out windows for scoring and the reported BLD loss
    seq: int = 256
    bld_tokens: int = 65536  # per variant
    bld_lr: float = 1e-3
    data: list = field(default_factory=list)


def _start(prog: Program, out: Path, settings: LibrarySettings, digest: str) -> None:
    """Creates the library directory, or checks that an existing one is this build's to resume."""
    record = {"format": FORMAT, "parent_hash": digest, "settings": asdict(settings)}
    if (out / SETTINGS).exists():
        old = json.loads((out / SETTINGS).read_text())
        if old.get("parent_hash") != digest:
            raise LibraryError(f"{out} holds a library of another parent; choose another -o")
        if old != record:
            raise LibraryError(f"{out} was started with other settings {old['settings']}; "
                               "rerun with the same settings to resume, or choose another -o")
        return
    check_output(out, prog.input_paths(), overwrite=True)  # never into, onto or above its input; writable
    if out.is_dir() and any(out.iterdir()):
        raise LibraryError(f"{out} is not empty and holds no library; choose a new -o (the same -o again resumes "
                           "a library)")
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / SETTINGS, record)


def build_library(prog: Program, out, grid_file=None, settings: LibrarySettings | None = None,
                  progress: bool = False, importance: dict | None = None, compute: Compute = CPU) -> Library:
    """Builds (or resumes) the library of `prog` in `out`; a meta program gives a weightless library.
    `importance` (the analysis, on the settings' calibration windows) saves computing it again. The parent,
    BLD and scoring run on `compute`'s device and precision (importance in float32)."""
    out = Path(out)
    settings = settings or LibrarySettings()
    settings.grid = settings.grid or load_grid(grid_file)
    check_grid(settings.grid, prog)
    layers = prog.blocks()
    todo = [(i, n, variants(n.op, settings.grid, n.path)) for i, n in enumerate(layers)]
    digest = parent_hash(prog)
    rank, world = distributed()
    if rank == 0:
        _start(prog, out, settings, digest)
    barrier(world)
    weightless = prog.is_meta
    if not weightless:
        _build_rows(prog, out, settings, [t for t in todo if t[0] % world == rank], progress, importance, compute)
    barrier(world)
    if rank == 0:
        rows = []
        for i, n, vs in todo:
            rows += [row_of(i, n.path, v, variant_spec(n.op, v)) if weightless else load_row(out, i, v.id) for v in vs]
        manifest = {"format": FORMAT, "weightless": weightless,
                    "parent": {"hash": digest, "source": prog.meta.get("source", ""), "program": print_program(prog)},
                    "settings": asdict(settings), "variants": rows}
        write_json(out / MANIFEST, manifest)
    barrier(world)
    return Library.open(out)


def _importance(prog: Program, out: Path, windows: torch.Tensor, known: dict | None, compute: Compute) -> dict:
    f = out / "importance.json"
    if f.exists():
        return json.loads(f.read_text())
    imp = known or compute_importance(prog, windows, compute=compute)
    write_json(f, imp)
    return imp


def _build_rows(prog: Program, out: Path, s: LibrarySettings, todo: list, progress: bool, known: dict | None,
                compute: Compute) -> None:
    from ...backends.torch import materialize
    from ...data import load_corpus, sequential_windows

    clock = Stopwatch()
    corpus = load_corpus(s.data or None)
    calib = sequential_windows(corpus.train, s.seq, limit=s.calib_windows)
    held_out = sequential_windows(corpus.valid, s.seq + 1, limit=s.score_windows)
    with clock("importance"):
        ranks = _importance(prog, out, calib, known, compute)["layers"]
    with clock("parent activations"):
        model = materialize(prog, dtype=torch.float32, compute=compute)
        train = block_activations(model, calib)
        valid = block_activations(model, held_out[:, :-1])
        scorer = Scorer(model, held_out, valid.inputs)
    bar = tqdm(total=sum(len(vs) for _, _, vs in todo), desc="library", disable=not progress)
    for i, node, vs in todo:
        weights = {k: v.float() for k, v in prog.node_weights(node).items()}
        for v in vs:
            if load_row(out, i, v.id) is None:
                row, w = _variant(node, i, v, weights, ranks.get(node.path, {}), train, valid, scorer, s, clock,
                                  compute)
                save_variant(out, i, v.id, w, row)
            bar.update(1)
    bar.close()
    write_json(out / "timings.json", clock.seconds)  # this run's; not part of the manifest


class Stopwatch:
    """Seconds spent per stage, summed over calls: `with clock("bld"): ...`."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start


def _variant(node, i: int, v: Variant, weights: dict, ranks: dict, train, valid, scorer: Scorer,
             s: LibrarySettings, clock: Stopwatch, compute: Compute) -> tuple[dict, dict]:
    """Initialises, trains (when it has something to learn) and scores one variant."""
    x, d, vx, vd = train.inputs[i], train.deltas[i], valid.inputs[i], valid.deltas[i]
    with clock("initialise"):
        spec, w, init = _initial(node, v, weights, ranks, x, d)
        block = block_module(spec, w).to(compute.device)
        bld = {"initial_nmse": nmse(block, vx, vd, compute=compute), "trained": False}
    if v.steps:  # the parent is exact; noop has nothing to learn; linear starts at its least-squares optimum
        with clock("bld"):
            bld.update(distill_block(block, x, d, s.bld_tokens, seed_of(i, v.id), s.bld_lr, compute=compute))
    bld["final_nmse"] = nmse(block, vx, vd, compute=compute) if bld["trained"] else bld["initial_nmse"]
    with clock("score"):
        scores = scorer.score(i, block)
    row = row_of(i, node.path, v, spec) | {"init": init, "bld": bld, "scores": scores}
    return row, {k: t.detach().cpu() for k, t in block.state_dict().items()}


def _initial(node, v: Variant, weights: dict, ranks: dict, x, d):
    """The variant's spec, starting weights and how they were made."""
    if v.replacement:
        spec = replacement_spec(node.op, v.replacement)
        w = {} if v.replacement == "noop" else {
            "norm.weight": weights["norm.weight"],
            "mixer.linear.weight": linear_fit(weights["norm.weight"], node.op.eps, x, d)}
        return spec, w, {"noop": "none", "linear": "least squares on calibration activations"}[v.replacement]
    spec, w = slice_variant(node.op, weights, v, ranks)
    return spec, w, "importance-ordered slice" if v.steps else "parent"
