"""Puzzle: hardware-costed structured pruning. Importance, the block library (variants, BLD, scores)."""
from __future__ import annotations

from dataclasses import field

from ..core import Pass, PassError, Preserved, register
from .build import LibrarySettings, build_library
from .grid import DEFAULT_GRID, GridError, Variant, load_grid, variants
from .importance import compute_importance
from .library import Library, LibraryError, parent_hash

__all__ = ["DEFAULT_GRID", "GridError", "Library", "LibraryError", "LibrarySettings", "Variant", "build_library",
           "compute_importance", "load_grid", "parent_hash", "variants"]


@register("importance")
class Importance(Pass):
    """Rank every prunable unit of every block by activation statistics on calibration text."""

    samples: int = 32
    seq: int = 256
    data: list[str] = field(default_factory=list)
    minimum = {"samples": 1, "seq": 1}

    def run(self, prog, am):
        imp = am.get("importance", samples=self.samples, seq=self.seq, data=tuple(self.data))
        am.reports["importance"] = {"layers": len(imp["layers"]), "tokens": imp["tokens"]}
        return Preserved.all()


@register("library")
class BuildLibrary(Pass):
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
                            bld_tokens=self.bld_tokens, bld_lr=self.bld_lr, data=list(self.data))
        known = None if prog.is_meta else am.get("importance", samples=self.calib_windows, seq=self.seq,
                                                   data=tuple(self.data))
        lib = build_library(prog, self.out, self.grid or None, s, importance=known)
        am.reports["library"] = {"path": str(lib.path), "variants": len(lib.rows)}
        return Preserved.all()


@register("puzzle")
class Puzzle(Pass):
    """Choose one library variant per layer that meets a deployment target, and put it in place."""

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
    metric: str = "kl"
    method: str = "mip"

    def run(self, prog, am):
        from .search import Constraints, Search, realise

        if not self.library:
            raise PassError("pass 'puzzle' needs library=DIR (build one with the `library` pass or command)")
        lib = Library.open(self.library, prog)
        c = Constraints(self.speedup, self.decode_ms, self.prefill_s, self.concurrency, self.context,
                        self.max_params, self.max_active, tuple(self.keep), tuple(self.uniform))
        search = Search(lib, prog, [(t, self.scenario) for t in self.target], self.recipe, self.metric, c)
        plan = search.plan(self.method)
        realise(prog, lib, search.rows_of(plan), weights=not lib.weightless)
        prog.meta["plan"] = plan.to_json()
        am.reports["puzzle"] = {"predicted": plan.predicted, "parent": plan.parent, "objective": plan.objective}
        return Preserved.none()
