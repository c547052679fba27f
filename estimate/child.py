"""The child a pipeline's search will pick, before any weight is read: the stages after the search (distillation,
the MTP head's, quantize, the write) are estimated at its size, not the parent's.

The search runs on a weightless library of the parent (variants' sizes from the grid, no BLD, no scores: what
`library` builds from a bare config) in a temporary directory, with the puzzle pass's own target, scenario and
constraints; seconds for Nemotron-3-Super. With scores the trained library would pick another child of about the
same size: the size is what the target asks for.
"""
from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import torch


def meta_copy(prog):
    """`prog` with every weight on the meta device (shapes and dtypes only): planning reads no weight."""
    out = prog.copy()
    for name in out.weights.names():
        out.weights.set(name, torch.empty(out.weights.shape(name), dtype=_dtype(out.weights, name), device="meta"))
    return out


def _dtype(store, name: str) -> torch.dtype:
    return store.dtype(name) if not store.is_quantized(name) else torch.bfloat16


def planned_child(prog, puzzle, library=None):
    """The meta program of the child `puzzle` (a Puzzle pass, its final round's constraints) picks from a
    weightless library of `prog` built with `library`'s grid (a BuildLibrary pass, or None: the default grid);
    None when the search finds none (the run itself would stop there, saying why)."""
    from ..passes import PassManager
    from ..passes.core import PASSES, PassError

    with tempfile.TemporaryDirectory(prefix="puzzlekit-plan-") as tmp:
        lib = str(Path(tmp) / "library")
        passes = [PASSES["snapshot"](name="teacher"),
                  PASSES["library"](out=lib, grid=getattr(library, "grid", "") or ""),
                  dataclasses.replace(puzzle, library=lib, parent="teacher")]
        child = meta_copy(prog)
        try:
            PassManager(passes).run(child)
        except PassError:
            return None
    return child
