"""Iterative Puzzle: a later round searches from the current (pruned, distilled) model, not the parent.

Each layer may keep its current block or shrink further: its options are the library's variants that fit
within the current block (no axis larger) and the replacements. A kept block keeps its distilled weights;
a shrunk one is sliced from the current block in the order of importance measured on the current model
(a replacement takes the library's weights). Every option is scored anew against the current model (the
replacement scores of a distilled model differ from the parent's), so the search adds the least damage
to the model as it now is.
"""
from __future__ import annotations

import torch

from ...ir import Program
from ...ir.checkpoint import spec_to_dict
from ...ir.ops import OpSpec
from .bld import block_module
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
    """A candidate's weights: the current block's (unchanged, or sliced by the current importance ranks),
    or the library's for a replacement the current block is not."""
    node = prog.blocks()[row["layer"]]
    spec = lib.spec(row)
    if spec.kind != node.op.kind:
        return lib.weights(row)
    cur, w = node.op, {k: v.detach().clone().float() for k, v in prog.node_weights(node).items()}
    for axis, n in steps_to(node.op, spec):
        cur, w = cur.shrink(axis, _keep(cur.axes()[axis], ranks.get(node.path, {}).get(axis), n), w)
    return w


def rescore(lib: Library, prog: Program, ranks: dict, windows: torch.Tensor, compute=None) -> dict[tuple, dict]:
    """{(layer, id): scores} of every candidate, each put alone into the current model, on `windows`."""
    from ...backends.torch.device import CPU
    from ...backends.torch.stream import StreamedProgram

    compute = compute or CPU
    stream = StreamedProgram(prog, compute, dtype=torch.float32)
    scorer = Scorer(stream, windows, sweep_inputs(stream, windows[:, :-1]))
    by_layer: dict[int, list[dict]] = {}
    for r in candidates(lib, prog):
        by_layer.setdefault(r["layer"], []).append(r)
    out = {}
    for layer, rows in by_layer.items():
        blocks = [block_module(lib.spec(r), candidate_weights(lib, r, prog, ranks)).to(compute.device) for r in rows]
        for r, sc in zip(rows, scorer.score_layer(layer, blocks)):
            out[r["layer"], r["id"]] = sc
    return out


def realise_from(prog: Program, lib: Library, rows: list[dict], ranks: dict) -> Program:
    """Rewrites each layer of `prog` whose chosen variant differs from its current block."""
    blocks = prog.blocks()
    for r in rows:
        node, spec = blocks[r["layer"]], lib.spec(r)
        if spec_to_dict(spec) != spec_to_dict(node.op):
            prog.rewrite(node, op=spec, weights=candidate_weights(lib, r, prog, ranks))
            prog.meta.get("routing", {}).pop(node.path, None)
    return prog
