"""Puzzle: hardware-costed structured pruning. Importance, the block library (variants, BLD, scores)."""
from __future__ import annotations

from dataclasses import field

from ..core import ComputePass, PassError, Preserved, pipeline_data, register
from ..manager import reporting
from .build import LibrarySettings, build_library, library_windows
from .grid import DEFAULT_GRID, GridError, Variant, load_grid, variants
from .importance import compute_importance
from .library import Library, LibraryError, parent_hash

__all__ = ["DEFAULT_GRID", "GridError", "Library", "LibraryError", "LibrarySettings", "Variant", "build_library",
           "compute_importance", "load_grid", "parent_hash", "variants"]


@register("importance")
class Importance(ComputePass):
    """Rank every prunable unit of every block by activation statistics on calibration text."""

    samples: int = 32
    seq: int = 256
    data: list[str] = field(default_factory=list)
    minimum = {"samples": 1, "seq": 1}

    def run(self, prog, am):
        imp = am.get("importance", samples=self.samples, seq=self.seq, data=tuple(pipeline_data(self.data, am)),
                     device=str(self.compute(am).device))
        am.reports["importance"] = {"layers": len(imp["layers"]), "tokens": imp["tokens"]}
        return Preserved.all()


@register("library")
class BuildLibrary(ComputePass):
    """Build (or resume) the block library of the program in `out`: variants, BLD and scores."""

    out: str = ""
    grid: str = ""
    bld_tokens: int = 65536
    bld_lr: float = 1e-3
    calib_windows: int = 64
    score_windows: int = 16
    seq: int = 256
    data: list[str] = field(default_factory=list)
    minimum = {"bld_tokens": 1, "calib_windows": 1, "score_windows": 1, "seq": 2}

    def run(self, prog, am):
        if not self.out:
            raise PassError("pass 'library' needs out=DIR, the library directory")
        s = LibrarySettings(calib_windows=self.calib_windows, score_windows=self.score_windows, seq=self.seq,
                            bld_tokens=self.bld_tokens, bld_lr=self.bld_lr, data=pipeline_data(self.data, am))
        compute = self.compute(am)
        known = None if prog.is_meta else am.get("importance", samples=self.calib_windows, seq=self.seq,
                                                   data=tuple(s.data), device=str(compute.device))
        lib = build_library(prog, self.out, self.grid or None, s, progress=reporting(am), importance=known,
                            compute=compute)
        am.reports["library"] = {"path": str(lib.path), "variants": len(lib.rows)}
        return Preserved.all()


@register("puzzle")
class Puzzle(ComputePass):
    """Choose one library variant per layer that meets a deployment target, and put it in place.

    Inside repeat{n=N}(...), round i moves every constraint i/N of the way from the parent to the target
    (`schedule`), and rounds after the first search from the current model (see rounds.py); `parent` names
    the snapshot of the model the library was built from."""

    library: str = ""
    target: list[str] = field(default_factory=lambda: ["h100"])
    scenario: str = "decode-heavy"
    recipe: str = ""
    speedup: float = 0.0
    decode_ms: float = 0.0
    prefill_s: float = 0.0
    concurrency: int = 0
    context: int = 0
    max_params: float = 0.0
    max_active: float = 0.0
    keep: list[str] = field(default_factory=list)
    uniform: list[str] = field(default_factory=list)
    engine: str = "all"  # the serving engines' rules the child meets (engines.py); none lifts them
    prices: str = ""  # auto, tables or analytic (backends/cost/prices.py); empty: PUZZLEKIT_PRICES, else auto
    metric: str = "kl"
    method: str = "mip"
    parent: str = ""
    schedule: str = "geometric"

    def run(self, prog, am):
        from ..distill import teacher_program
        from .rounds import realise_from, rescore
        from .search import Constraints, Search, realise

        if not self.library:
            raise PassError("pass 'puzzle' needs library=DIR (build one with the `library` pass or command)")
        parent = teacher_program(self.parent, am) if self.parent else prog
        lib = Library.open(self.library, parent)
        later = parent is not prog and parent_hash(prog) != lib.manifest["parent"]["hash"]
        i, n = am.round
        c = Constraints(self.speedup, self.decode_ms, self.prefill_s, self.concurrency, self.context,
                        self.max_params, self.max_active, tuple(self.keep), tuple(self.uniform))
        scores = made = None
        if later:  # the options (shrinks trained with BLD) and their scores come from the current model
            st = LibrarySettings(**lib.manifest["settings"])
            compute = self.compute(am)
            ranks = am.get("importance", samples=st.calib_windows, seq=st.seq, data=tuple(st.data),
                           device=str(compute.device))["layers"]
            calib, windows = library_windows(st, prog)  # the library's own: calibration, and its scoring set
            scores, made = rescore(lib, prog, ranks, windows, calib, compute)
        search = Search(lib, parent, [(t, self.scenario) for t in self.target], self.recipe, self.metric, c,
                        scores=scores, fraction=i / n, schedule=self.schedule, engine=self.engine,
                        prices=self.prices or None)
        plan = search.plan(self.method)
        if later:
            realise_from(prog, lib, search.rows_of(plan), made)
        else:
            realise(prog, lib, search.rows_of(plan), weights=not lib.weightless)
        prog.meta["plan"] = plan.to_json()
        am.reports.setdefault("puzzle", []).append({"round": [i, n], "predicted": plan.predicted, "limits": plan.limits,
                                                    "parent": plan.parent, "objective": plan.objective,
                                                    "params": plan.params_total, "rescored": bool(later),
                                                    "engine": self.engine,
                                                    "bld": made.report if later else None,
                                                    "batch": plan.batch, "layout": plan.layout,
                                                    "parent_batch": search.base[0].max_batch if search.base else 1,
                                                    "throughput_ratio": search.throughput_ratio(plan)})
        return Preserved.none()

