"""The child a pipeline's search will pick, before any weight is read: the stages after the search (distillation,
the MTP head's, quantize, the write) are estimated at its size, not the parent's.

The search runs on a weightless library of the parent (variants' sizes from the grid, no BLD, no scores: what
`library` builds from a bare config) in a temporary directory, with the puzzle pass's own target, scenario and
constraints; seconds for Nemotron-3-Super. With scores the trained library would pick another child of about the
same size: the size is what the target asks for.
"""
from __future__ import annotations

import dataclasses
import json
import os
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


#: (the parent's shapes, the search's settings, the grid) -> the child it picks (or None): the same question asked
#: again in one process (on other --hardware, or by the check before a run after --estimate) is not searched again
_PLANNED: dict = {}
#: the program's settings that say where it came from, not what it is
WHERE = ("source", "tokenizer")


def planned_child(prog, puzzle, library=None):
    """The meta program of the child `puzzle` (a Puzzle pass, its final round's constraints) picks from a
    weightless library of `prog` built with `library`'s grid (a BuildLibrary pass, or None: the default grid);
    None when the search finds none (the run itself would stop there, saying why). Searched once a process."""
    from ..passes import PassManager
    from ..passes.core import PASSES, PassError

    grid = getattr(library, "grid", "") or ""
    key = _key(prog, puzzle, grid)
    if key not in _PLANNED:
        with tempfile.TemporaryDirectory(prefix="puzzlekit-plan-") as tmp:
            lib = str(Path(tmp) / "library")
            passes = [PASSES["snapshot"](name="teacher"), PASSES["library"](out=lib, grid=grid),
                      dataclasses.replace(puzzle, library=lib, parent="teacher")]
            child = meta_copy(prog)
            try:
                PassManager(passes).run(child)
            except PassError:
                child = None
        while len(_PLANNED) >= 4:  # a few children: each holds every tensor's shape (127k of them for Super)
            _PLANNED.pop(next(iter(_PLANNED)))
        _PLANNED[key] = child
    child = _PLANNED[key]
    return None if child is None else child.copy()


def _key(prog, puzzle, grid: str) -> tuple:
    """What the search reads: the program's text and settings (no weight, nor where it came from), the pass's
    options, the grid (a file's text), the prices asked for in the environment."""
    from ..ir import print_program

    text = Path(grid).read_text() if grid and Path(grid).is_file() else grid
    settings = {k: v for k, v in prog.meta.items() if k not in WHERE}
    return (print_program(prog), json.dumps(settings, sort_keys=True, default=str),
            repr(dataclasses.replace(puzzle, library="")), text, os.environ.get("PUZZLEKIT_PRICES", ""))
