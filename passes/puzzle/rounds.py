"""Iterative Puzzle: a later round searches from the current (pruned, distilled) model, not the parent.

Each layer may keep its current block or shrink further: its options are the library's variants that fit
within the current block (no axis larger) and the replacements. A kept block keeps its distilled weights.
Every other option is made from the current model as a library build makes its variants from the parent, so
that it competes with the kept blocks on equal terms: one sweep of the current model over the library's
calibration windows gives each layer's input x and delta d (kept in the stream's tapes, which spill to scratch
files); a shrink is sliced from the current block in the order of importance measured on the current model,
then trained with BLD to reproduce d; a `linear` replacement is fitted by least squares on (x, d); noop has
nothing to learn. These weights are made once (`Made`) and are what is scored and, where chosen, realised.
Every option is scored anew against the current model on the held-out scoring windows (the replacement
scores of a distilled model differ from the parent's), so the search adds the least damage to the model as
it now is.
"""
from __future__ import annotations

import statistics

import torch

from ...backends.torch import checkpoint_state
from ...backends.torch.device import CPU, Compute
from ...backends.torch.stream import StreamedProgram
from ...ir import Program
from ...ir.checkpoint import spec_to_dict
from ...ir.ops import OpSpec
from ...ir.weights import WeightStore
from .bld import block_module, distill_block, linear_fit, nmse, seed_of
from .library import Library, _keep
from .score import Scorer, sweep_inputs


def steps_to(current: OpSpec, target: OpSpec) -> list[tuple[str, int]] | None:
    """The shrinks that take `current` to `target` (each axis in the order the op applies them, cut to the
    target's size), or None when no such sequence exists: another kind, a larger axis, or coupled axes
    that land elsewhere (dropping a KV group also drops its query heads)."""
    if target.kind != current.kind:
        return None
    steps, op = [], current
    for axis in current.axes():
        n, size = target.axes()[axis].size, op.axes()[axis].size
        if n > size:
            return None
        if n < size:
            steps.append((axis, n))
            op = op.resized(axis, n)
    return steps if spec_to_dict(op) == spec_to_dict(target) else None


def reachable(spec: OpSpec, current: OpSpec) -> bool:
    """Whether a layer whose block is `current` may take `spec` now: a shrink of it (or itself), noop, or
    linear in place of anything but noop."""
    if spec.kind != current.kind:
        return spec.kind == "noop" or (spec.kind == "linear" and current.kind != "noop")
    return steps_to(current, spec) is not None


def candidates(lib: Library, prog: Program) -> list[dict]:
    """The library rows each layer of `prog` may take now."""
    blocks = prog.blocks()
    return [r for r in lib.rows if reachable(lib.spec(r), blocks[r["layer"]].op)]


def candidate_weights(lib: Library, row: dict, prog: Program, ranks: dict) -> dict[str, torch.Tensor]:
    """A candidate's starting weights: the current block's (unchanged, or sliced by the current importance
    ranks), or the library's for a replacement the current block is not."""
    node = prog.blocks()[row["layer"]]
    spec = lib.spec(row)
    if spec.kind != node.op.kind:
        return lib.weights(row)
    cur, w = node.op, {k: v.detach().clone().float() for k, v in prog.node_weights(node).items()}
    for axis, n in steps_to(node.op, spec):
        cur, w = cur.shrink(axis, _keep(cur.axes()[axis], ranks.get(node.path, {}).get(axis), n), w)
    return w


class Made:
    """The weights made for a round's options by (layer, id), made once and read both when scored and when
    realised; held in memory up to `limit` bytes, past it in scratch files (puzzlekit.memory)."""

    def __init__(self, limit: int):
        self.limit, self.store, self.names = limit, WeightStore(), {}
        self.report: dict = {}

    def add(self, key: tuple, weights: dict) -> None:
        self.names[key] = list(weights)
        for k, t in weights.items():
            self.store.set(f"{key[0]}/{key[1]}/{k}", t.detach().cpu())
        self.store.spill_over(self.limit)

    def __contains__(self, key) -> bool:
        return key in self.names

    def __getitem__(self, key: tuple) -> dict[str, torch.Tensor]:
        names = self.names[key]
        return dict(zip(names, self.store.get_many([f"{key[0]}/{key[1]}/{k}" for k in names])))


def _same(spec: OpSpec, op: OpSpec) -> bool:
    return spec_to_dict(spec) == spec_to_dict(op)


def _by_layer(lib: Library, prog: Program) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for r in candidates(lib, prog):
        out.setdefault(r["layer"], []).append(r)
    return out


def make_options(lib: Library, prog: Program, ranks: dict, calib: torch.Tensor, compute: Compute = CPU) -> Made:
    """The weights of every option that is not a kept block, from the current model's own activations on
    `calib` [n, seq] (swept in float32, as a build sweeps the parent): a shrink sliced by importance, then
    trained with BLD (the library's bld_tokens and bld_lr, a fixed seed per option); `linear` fitted by least
    squares after the current block's norm; noop empty."""
    st = lib.manifest["settings"]
    inputs = sweep_inputs(StreamedProgram(prog, Compute(compute.device, memory=compute.memory), torch.float32),
                          calib, batch=4)
    made, blocks, trained, improved = Made(compute.budget // 4), prog.blocks(), 0, 0
    for layer, rows in _by_layer(lib, prog).items():
        node = blocks[layer]
        rows = [r for r in rows if not _same(lib.spec(r), node.op)]
        if not rows:
            continue
        x = inputs(layer)
        d = inputs(layer + 1) - x
        for r in rows:
            spec = lib.spec(r)
            if spec.kind == node.op.kind:
                block = block_module(spec, candidate_weights(lib, r, prog, ranks)).to(compute.device)
                trained += 1
                improved += distill_block(block, x, d, st["bld_tokens"], seed_of(layer, r["id"]), st["bld_lr"],
                                          compute=compute)["trained"]
                w = checkpoint_state(block)
            elif spec.kind == "linear":
                norm = prog.node_weights(node)["norm.weight"].float().to(x.device)
                w = {"norm.weight": norm, "mixer.linear.weight": linear_fit(norm, node.op.eps, x, d)}
            else:
                w = {}
            made.add((layer, r["id"]), w)
        del x, d
    made.report.update(trained=trained, improved=improved)
    return made


def rescore(lib: Library, prog: Program, ranks: dict, windows: torch.Tensor, calib: torch.Tensor,
            compute: Compute = CPU) -> tuple[dict[tuple, dict], Made]:
    """{(layer, id): scores} of every candidate, each put alone into the current model, on `windows`
    [n, seq + 1]; and the weights made for them on `calib` (`make_options`), to realise the chosen ones with.
    Made.report says how many shrinks BLD trained (`improved`: those whose training was kept) and their mean
    nmse on `windows` before and after training."""
    made = make_options(lib, prog, ranks, calib, compute)
    stream = StreamedProgram(prog, compute, dtype=torch.float32)
    inputs = sweep_inputs(stream, windows[:, :-1])
    scorer, blocks, out, before, after = Scorer(stream, windows, inputs), prog.blocks(), {}, [], []
    for layer, rows in _by_layer(lib, prog).items():
        keys = [(layer, r["id"]) for r in rows]
        mods = [block_module(lib.spec(r), made[k] if k in made else candidate_weights(lib, r, prog, ranks))
                .to(compute.device) for r, k in zip(rows, keys)]
        out.update(zip(keys, scorer.score_layer(layer, mods)))
        kind = blocks[layer].op.kind
        shrinks = [(r, m) for r, k, m in zip(rows, keys, mods) if k in made and lib.spec(r).kind == kind]
        if shrinks:
            x = inputs(layer)
            d = inputs(layer + 1) - x
            for r, m in shrinks:
                start = block_module(lib.spec(r), candidate_weights(lib, r, prog, ranks)).to(compute.device)
                before.append(nmse(start, x, d, compute=compute))
                after.append(nmse(m, x, d, compute=compute))
    made.report.update(initial_nmse=statistics.fmean(before) if before else None,
                       final_nmse=statistics.fmean(after) if after else None)
    return out, made


def realise_from(prog: Program, lib: Library, rows: list[dict], made: Made) -> Program:
    """Rewrites each layer of `prog` whose chosen variant differs from its current block, with the weights
    made for it (those it was scored with)."""
    blocks = prog.blocks()
    for r in rows:
        node, spec = blocks[r["layer"]], lib.spec(r)
        if not _same(spec, node.op):
            prog.rewrite(node, op=spec, weights=made[r["layer"], r["id"]])
            prog.meta.get("routing", {}).pop(node.path, None)
    return prog
