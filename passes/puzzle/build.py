"""Building a block library: importance -> variants sliced in importance order -> BLD -> scoring.

The expensive, target-independent half of Puzzle, done once per parent, layer by layer so that a parent
larger than memory is built within the memory budget: one sweep of the parent over the calibration and
held-out windows (importance gathered on the way) writes every layer's input to `activations/`; then each
layer's variants are initialised, trained (BLD) and scored from those files, reading only that layer and the
ones after it. Under `torchrun` rank 0 sweeps, the layers are then shared out over the ranks (gloo on CPU)
and rank 0 writes the manifest; the activations are removed once it is written.

One variant at a time: each is initialised, trained, run over its layer's held-out inputs, written and freed
before the next, so a layer holds the parent block, one variant's training and the layer's inputs (holding a
layer's 20 MoE variants together would take 110 GiB for one of Nemotron-3-Super's layers). What is kept of a
variant for scoring is its output in place of the layer (windows x seq x hidden: 67 MB on Super's scoring set,
against up to 11 GB of weights), and a layer's outputs go through the later layers together, as many as a
quarter of the budget holds (a sixteenth of a GPU; counted twice: each later layer's outputs replace them as
they run). Each later layer that the stream does not keep is then read once per such group: once per layer
scored when the outputs fit, where scoring each variant on its own would read it once per variant (20 times
for a Super MoE layer's variants); the price is the outputs' memory. `hold_all` keeps the blocks themselves until all are scored instead: the same
reads and the same library, with every variant held. Nested variants (prefix slices of one importance-sorted
axis trained together in one run) are not built: every variant trains alone from its own fixed seed, so its
weights do not depend on which other sizes the grid names, and such a run would hold as much as its largest
variant does anyway; it would save BLD time, not memory.

A variant's weights and its row so far are written once it is trained, its row once scored: a killed build
resumes where it stopped, per variant (a trained variant is read back, not trained again), and ends with the
same manifest as an uninterrupted one (every variant trains from its own fixed seed). On a GPU the scorer's
later layers are held in the compute dtype (bf16: what autocast would cast them to on every call); the parent
block is on the host in float32, the variant training on the device in float32 master weights under autocast.
"""
from __future__ import annotations

import json
import shutil
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from ...backends.torch import checkpoint_state
from ...eta import Remaining, bars
from ...backends.torch.device import CPU, Compute
from ...backends.torch.stream import StreamedProgram, holding
from ...ir import Program, print_program
from ...ir.checkpoint import spec_from_dict
from ...outputs import atomic_file, check_output, write_json
from ...training import barrier, distributed
from .bld import block_module, distill_block, linear_fit, nmse, seed_of
from .grid import Variant, check_grid, load_grid, variants
from .importance import ImportanceStats
from .library import (FORMAT, MANIFEST, SCORED_ON, TRAINED, Library, LibraryError, check_format, load_row,
                      load_trained, parent_hash, replacement_spec, row_of, save_row, save_trained, slice_variant,
                      variant_spec)
from .score import Scorer

SETTINGS = "settings.json"


@dataclass
class LibrarySettings:
    """What a library is built with; a resumed build must use the same."""

    grid: dict = field(default_factory=dict)
    calib_windows: int = 64  # training split windows for importance and BLD
    score_windows: int = 16  # windows of the held-out `scoring` set for scoring and the reported BLD loss
    seq: int = 256
    bld_tokens: int = 65536  # per variant
    bld_lr: float = 1e-3
    data: list = field(default_factory=list)


def _start(prog: Program, out: Path, settings: LibrarySettings, digest: str) -> None:
    """Creates the library directory, or checks that an existing one is this build's to resume."""
    record = {"format": FORMAT, "parent_hash": digest, "settings": asdict(settings)}
    if (out / SETTINGS).exists():
        old = json.loads((out / SETTINGS).read_text())
        check_format(old, out)
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
                  progress: bool | str = False, importance: dict | None = None, compute: Compute = CPU,
                  hold_all: bool = False) -> Library:
    """Builds (or resumes) the library of `prog` in `out`; a meta program gives a weightless library.
    `importance` (the analysis, on the settings' calibration windows) saves computing it again. The parent,
    BLD and scoring run on `compute`'s device and precision (importance in float32). `progress`: a bar, or
    lines in a log (eta.Remaining). `hold_all`: a layer's variants held until all are scored, the same library
    built with more memory (to measure what one variant at a time saves: benchmarks/estimate.py)."""
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
    if not weightless and any(load_row(out, i, v.id) is None for i, _, vs in todo for v in vs):
        if rank == 0:
            _sweep_parent(prog, out, settings, importance, compute, progress)
        barrier(world)
        _build_rows(prog, out, settings, [t for t in todo if t[0] % world == rank], progress, compute, hold_all)
    barrier(world)
    if rank == 0:
        rows = []
        for i, n, vs in todo:
            rows += [row_of(i, n.path, v, variant_spec(n.op, v)) if weightless else load_row(out, i, v.id) for v in vs]
        manifest = {"format": FORMAT, "weightless": weightless, "scored_on": SCORED_ON,
                    "parent": {"hash": digest, "source": prog.meta.get("source", ""), "program": print_program(prog)},
                    "settings": asdict(settings), "variants": rows}
        write_json(out / MANIFEST, manifest)
        shutil.rmtree(out / ACTIVATIONS, ignore_errors=True)
        for f in (out / "variants").glob(f"*/*{TRAINED}"):  # left by a kill between a row and its removal
            f.unlink()
    barrier(world)
    return Library.open(out)


ACTIVATIONS = "activations"


class LayerInputs:
    """The parent's input to every block, and the trunk's output (layer L), on one split's windows: one
    safetensors file per layer under LIB/activations/SPLIT, complete once `done.json` is written."""

    def __init__(self, lib: Path, split: str, device=None):
        self.dir, self.device = lib / ACTIVATIONS / split, device

    def complete(self) -> bool:
        return (self.dir / "done.json").exists()

    def write(self, layer: int, x: torch.Tensor) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        f = self.dir / f"L{layer:03d}.safetensors"
        with atomic_file(f) as tmp:
            save_file({"x": x.detach().contiguous().cpu()}, str(tmp))

    def finish(self) -> None:
        write_json(self.dir / "done.json", {"complete": True})

    def __call__(self, layer: int) -> torch.Tensor:
        return load_file(str(self.dir / f"L{layer:03d}.safetensors"))["x"].to(self.device)


def library_windows(s: LibrarySettings, prog: Program) -> tuple[torch.Tensor, torch.Tensor]:
    """(calibration windows [n, seq] from the training split, windows [m, seq + 1] of the held-out set the
    scores are measured on: the search minimises them, so no reported figure may use that text), in the
    program's own tokenization."""
    from ...text.data import calibration_windows, corpus_for, held_out_windows

    return (calibration_windows(s.data, s.calib_windows, s.seq, prog),
            held_out_windows(corpus_for(prog, s.data or None), SCORED_ON, s.seq + 1, limit=s.score_windows))


def _sweep_parent(prog: Program, out: Path, s: LibrarySettings, known: dict | None, compute: Compute,
                  progress: bool | str = False) -> None:
    """One layer-by-layer pass of the parent over each split: every layer's inputs to disk. The calibration
    pass runs in float32 and gathers the importance statistics on the way (unless known, or already written);
    the held-out pass runs in the compute precision, as the scorer does."""
    calib, held_out = library_windows(s, prog)
    blocks = prog.blocks()
    layer_of = {b.args[0]: i for i, b in enumerate(blocks)} | {blocks[-1].name: len(blocks)}
    f = out / "importance.json"
    stats = None if f.exists() or known else ImportanceStats()
    exact = Compute(compute.device, memory=compute.memory)
    for split, windows, batch, how, attach in (("train", calib, 4, exact, stats and stats.attach),
                                               ("valid", held_out[:, :-1], 8, compute, None)):
        store = LayerInputs(out, split)
        if store.complete() and attach is None:
            continue
        stream = StreamedProgram(prog, how, dtype=held_dtype(how))
        left = Remaining(f"library sweep ({split})", len(blocks), progress=progress)
        for node, tape, _ in stream.sweep(windows, batch, attach=attach):
            if node.name in layer_of:
                store.write(layer_of[node.name], tape.cat())
            left.done(node.op.is_block)
        store.finish()
    if not f.exists():
        write_json(f, known or stats.result(calib))


def held_dtype(compute: Compute) -> torch.dtype | None:
    """The dtype a library's streams hold the parent's layers in: float32 for a float32 forward (the exact
    numbers), else the forward's own (None: `hold_in`'s cast of what autocast casts; the same results)."""
    return torch.float32 if compute.dtype == torch.float32 else None


def outputs_room(compute: Compute) -> int:
    """Bytes of a layer's variant outputs (with their successors through the later layers) scored together: a
    quarter of the budget (the share of the sweep's tapes, written out by then), on a GPU at most a sixteenth of its
    memory."""
    room = compute.budget // 4
    if compute.device.type == "cuda":
        room = min(room, torch.cuda.get_device_properties(compute.device).total_memory // 16)
    return room


def _build_rows(prog: Program, out: Path, s: LibrarySettings, todo: list, progress: bool | str,
                compute: Compute, hold_all: bool = False) -> None:
    clock = Stopwatch()
    _, held_out = library_windows(s, prog)
    ranks = json.loads((out / "importance.json").read_text())["layers"]
    train, valid = LayerInputs(out, "train", compute.device), LayerInputs(out, "valid", compute.device)
    scorer = Scorer(StreamedProgram(prog, compute, dtype=held_dtype(compute)), held_out, valid)
    bar = tqdm(total=sum(len(vs) for _, _, vs in todo), desc="library", disable=not bars(progress))
    left = Remaining("library", sum(any(load_row(out, i, v.id) is None for v in vs) for i, _, vs in todo),
                     progress=progress)
    blocks = prog.blocks()
    for i, node, vs in todo:
        pending = [v for v in vs if load_row(out, i, v.id) is None]
        bar.update(len(vs) - len(pending))
        if not pending:
            continue
        group = _Group(out, i, scorer, float("inf") if hold_all else outputs_room(compute), clock, bar)
        with holding(_work_bytes(node, pending, hold_all)):  # the scorer's kept layers make room for it
            weights = {k: v.float() for k, v in prog.node_weights(node).items()}
            x, vx = train(i), valid(i)
            d, vd = train(i + 1) - x, valid(i + 1) - vx
            for v in pending:
                row, block = _trained(out, node, i, v, weights, ranks.get(node.path, {}), (x, d, vx, vd), s,
                                      clock, compute)
                with clock("score"):  # the parent's own block: scored from the sweep, not re-run
                    ran = None if v == Variant() else block if hold_all else scorer.block_outputs(i, block, vx)
                group.add(v, row, ran)
                del block, ran
            del weights, x, d, vx, vd
            if hold_all:
                group.flush()
        group.flush()
        scorer.stream.release(blocks[: i + 2])  # scoring a later layer j reads layers j+1.. only
        left.done()
    bar.close()
    write_json(out / "timings.json", clock.seconds)  # this run's; not part of the manifest


class _Group:
    """A layer's trained variants waiting to be scored together: their outputs in place of the layer (None: the
    layer as it is; a block, held until scored), through the later layers once they would outgrow `room`."""

    def __init__(self, out: Path, layer: int, scorer: Scorer, room: float, clock, bar):
        self.out, self.layer, self.scorer, self.room, self.clock, self.bar = out, layer, scorer, room, clock, bar
        self.items, self.bytes = [], 0

    def add(self, v: Variant, row: dict, ran) -> None:
        n = 2 * sum(y.numel() * y.element_size() for y in ran) if isinstance(ran, list) else 0
        if self.items and self.bytes + n > self.room:
            self.flush()
        self.items.append((v, row, ran))
        self.bytes += n

    def flush(self) -> None:
        if not self.items:
            return
        with self.clock("score"):
            scores = self.scorer.score_layer(self.layer, [ran for _, _, ran in self.items])
        for (v, row, _), sc in zip(self.items, scores):
            save_row(self.out, self.layer, v.id, row | {"scores": sc})
            self.bar.update(1)
        self.items, self.bytes = [], 0


def _work_bytes(node, pending: list, hold_all: bool = False) -> int:
    """What building a layer's variants holds beside the scorer's kept layers (float32 bytes, from their specs):
    the parent block's weights the variants are sliced from, and one variant: its block and, when it trains, its
    starting copy, gradient and AdamW's two moments (`hold_all`: every variant's block, and the largest
    training)."""
    count = lambda spec: 4 * sum(torch.Size(shape).numel() for shape in spec.params().values())
    sizes = [count(variant_spec(node.op, v)) for v in pending]
    if hold_all:
        return count(node.op) + sum(sizes) + 4 * max((n for v, n in zip(pending, sizes) if v.steps), default=0)
    return count(node.op) + max((5 if v.steps else 1) * n for v, n in zip(pending, sizes))


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


def _trained(out: Path, node, i: int, v: Variant, weights: dict, ranks: dict, acts: tuple, s: LibrarySettings,
             clock: Stopwatch, compute: Compute) -> tuple[dict, torch.nn.Module]:
    """One variant's row so far and its block: trained now (its weights and row written at once), or read back
    from what an interrupted build wrote."""
    done = load_trained(out, i, v.id)
    if done is not None:
        row, w = done
        with clock("initialise"):
            return row, block_module(spec_from_dict(row["spec"], f"{out}: variant {i}/{v.id}"), w).to(compute.device)
    row, block = _variant(node, i, v, weights, ranks, acts, s, clock, compute)
    save_trained(out, i, v.id, {k: t.detach().cpu() for k, t in checkpoint_state(block).items()}, row)
    return row, block


def _variant(node, i: int, v: Variant, weights: dict, ranks: dict, acts: tuple, s: LibrarySettings,
             clock: Stopwatch, compute: Compute) -> tuple[dict, torch.nn.Module]:
    """Initialises and trains (when it has something to learn) one variant: its row so far and its block."""
    x, d, vx, vd = acts
    with clock("initialise"):
        spec, w, init = _initial(node, v, weights, ranks, x, d)
        block = block_module(spec, w).to(compute.device)
        del w  # the slice: the block holds its own copy
        bld = {"initial_nmse": nmse(block, vx, vd, compute=compute), "trained": False}
    if v.steps:  # the parent is exact; noop has nothing to learn; linear starts at its least-squares optimum
        with clock("bld"):
            bld.update(distill_block(block, x, d, s.bld_tokens, seed_of(i, v.id), s.bld_lr, compute=compute))
    bld["final_nmse"] = nmse(block, vx, vd, compute=compute) if bld["trained"] else bld["initial_nmse"]
    return row_of(i, node.path, v, spec) | {"init": init, "bld": bld}, block


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
