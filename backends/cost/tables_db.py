"""The measured tables themselves (aiconfigurator-core): which library and databases prices are pinned to,
whether they can be used here, loading one engine's tables of one GPU, the expert shapes they measure and
the nearest one to a shape, and evaluating ops on them (each block's ops serialised once, a single op's
row kept per call shape). The library is imported here only, when tables are first used: it is an extra.
"""
from __future__ import annotations

import json
import sys
from functools import lru_cache

import numpy as np

from ...errors import PuzzlekitError
from ...outputs import cache_dir, write_text
from ..targets import TARGETS, Target

#: the library version and databases the prices are pinned to (a plan made with them is reproducible)
LIBRARY_VERSION = "0.12.0"
DATABASES = {"trtllm": "1.3.0rc20", "vllm": "0.24.0", "sglang": "0.5.14"}
MODE = "HYBRID"  # measured where a table has the shape; the library's labelled transfer elsewhere
SYSTEMS = {"h100": "h100_sxm", "h200": "h200_sxm", "b200": "b200_sxm"}
def missing() -> str:
    """Why the tables cannot be used here ("" when they can): the extra not installed, or another version."""
    try:
        from importlib.metadata import PackageNotFoundError, version
        have = version("aiconfigurator-core")
    except PackageNotFoundError:
        return "aiconfigurator-core is not installed (pip install 'puzzlekit[tables]')"
    if have != LIBRARY_VERSION:
        return (f"aiconfigurator-core {have} is installed; the prices are pinned to {LIBRARY_VERSION} "
                f"(pip install 'puzzlekit[tables]')")
    return ""


def system_of(target: Target) -> str:
    """The tables' system for a GPU target ("" when none): h100, h200, b200 and their nodes."""
    return SYSTEMS.get(target.name.split("x", 1)[-1] if target.devices > 1 else target.name, "") \
        if target.kind == "gpu" else ""


def built_in(target: Target) -> bool:
    """Whether `target` is a built-in one, by its every figure and not its name (a target file named h100 is not)."""
    return TARGETS.get(target.name) == target


def own_figures_note(target: Target, tables: bool) -> str:
    """What prices a target file whose name the tables cover ("" for any other target): with `tables`
    (--prices tables) the tables of the GPU it names, else its own figures."""
    system = system_of(target)
    if not system or built_in(target):
        return ""
    if tables:
        return (f"target file {target.name}: its kernels are priced from the {system} tables (--prices tables), not "
                "by its bandwidth and peaks; its memory and puzzlekit's own terms use its figures")
    return f"target file {target.name}: priced by its own figures (--prices tables prices it from the {system} tables)"


@lru_cache(maxsize=None)
def _database(system: str, backend: str):
    """One database view and pricing handle per system and engine (a second load costs nothing)."""
    import logging

    from aiconfigurator_core.sdk import perf_database
    from aiconfigurator_core.sdk.engine import EngineHandle

    logging.getLogger("aiconfigurator_core").setLevel(logging.ERROR)  # its notes on fallback rows
    db = perf_database.get_database_view(system, backend, DATABASES[backend], database_mode=MODE)
    if db is None:
        raise PuzzlekitError(f"aiconfigurator-core {LIBRARY_VERSION} has no {backend} {DATABASES[backend]} "
                             f"tables for {system}; price with --prices analytic")
    return db, EngineHandle.for_database(db, systems_path=db.systems_root)



class Tables:
    """One engine's tables of one GPU, loaded on first use (a price kept from an earlier run needs none)."""

    def __init__(self, system: str, backend: str):
        self.system, self.backend = system, backend
        self._shapes = None
        self._anchors: dict = {}  # MoE format -> the shapes its table measures, and their logs
        self._nearest: dict = {}  # (format, shape) -> its anchor
        self._json: dict = {}  # id(a block's parts) -> (the parts, their ops' JSON)
        self._single: dict = {}  # (one op's JSON, call shape) -> (its row, borrowed)
        self._rows: dict = {}  # (ops' JSON, call shape) -> their rows

    @property
    def db(self):
        return _database(self.system, self.backend)[0]

    @property
    def handle(self):
        return _database(self.system, self.backend)[1]

    def anchor(self, mq, shape: tuple):
        """The nearest (top-k, experts, width, d_ff, moe tp, moe ep) the experts' table measures in this format,
        or None when it measures none in it. Nearest in the layout first (weighing most) and the model's
        experts and width (log distance); top-k and d_ff, which puzzlekit's term scales, only break ties. Were
        they weighed too, a cut layer could flip to another model's measurement and cost more than the
        uncut one (top-13 at d_ff 1792 on tp4 priced from a width-4096, d_ff-1024 model at 1.6x top-22's)."""
        if (mq, shape) not in self._nearest:
            if mq not in self._anchors:
                shapes = [tuple(s) for s in self.measured_shapes().get(mq.name, [])]
                self._anchors[mq] = shapes, np.log(np.array(shapes, dtype=float).reshape(-1, 6))
            shapes, logs = self._anchors[mq]
            far = np.abs(logs - np.log(np.array(shape, dtype=float)))
            primary, ties = far[:, [4, 5]].sum(1) * 4 + far[:, [1, 2]].sum(1), far[:, [0, 3]].sum(1)
            self._nearest[mq, shape] = min(zip(primary, ties, shapes))[2] if shapes else None
        return self._nearest[mq, shape]

    def measured_shapes(self) -> dict:
        """Per MoE format every shape the experts' table measures: read once per library version, database and
        GPU (loading the table in Python takes seconds) and kept beside puzzlekit's other caches."""
        if self._shapes is None:
            path = cache_dir("tables") / (f"moe-shapes-{LIBRARY_VERSION}-{self.system}-{self.backend}-"
                                          f"{DATABASES[self.backend]}.json")
            try:
                self._shapes = json.loads(path.read_text())
            except (OSError, ValueError):
                from aiconfigurator_core.sdk.operations.moe import MoE

                MoE.load_data(self.db)
                table = getattr(self.db, "_moe_data", None) or {}
                self._shapes = {q.name: sorted({(k, e, w, f, t, p) for dist in by_q.values()
                                                for k, by_e in dist.items() for e, by_w in by_e.items()
                                                for w, by_f in by_w.items() for f, by_t in by_f.items()
                                                for t, by_p in by_t.items() for p, rows in by_p.items() if rows})
                                for q, by_q in table.items()}
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    write_text(path, json.dumps(self._shapes))
                except OSError as e:  # an unwritable cache: read again next time, as the price cache does
                    print(f"puzzlekit: the tables' expert shapes not kept for later runs ({path}: {e})",
                          file=sys.stderr)
        return self._shapes

    def ops_json(self, parts) -> tuple:
        """A block's table ops as the engine's JSON, built once per block: (indices, JSON) of those priced in
        one call, and per expert part its own op's JSON."""
        hit = self._json.get(id(parts))
        if hit is None or hit[0] is not parts:
            from aiconfigurator_core.sdk.engine import build_ops_json

            table = [i for i, (name, o) in enumerate(parts) if not isinstance(o, tuple) and name != "experts"]
            singles = {i: build_ops_json([o if not isinstance(o, tuple) else o[2]]) for i, (name, o) in
                       enumerate(parts) if name == "experts" and (not isinstance(o, tuple) or o[0] == "scaled")}
            hit = self._json[id(parts)] = (parts, (table, build_ops_json([parts[i][1] for i in table]) if table
                                                   else None), singles)
        return hit[1:]

    def run(self, ops_json, shape: tuple) -> list:
        """The ops' rows at a call shape, once per ops and shape: a block's variants that differ only in what is
        priced apart (the experts' d_ff) share their other ops' rows."""
        key = (ops_json, shape)
        if key not in self._rows:
            is_context, batch_size, s, prefix = shape
            self._rows[key] = self.handle.evaluate_ops_json(ops_json, is_context=is_context, batch_size=batch_size,
                                                            s=s, prefix=prefix)
        return self._rows[key]

    def run_one(self, op_json, shape: tuple) -> tuple:
        """One op's row and whether the table borrowed its shape, once per op and call shape."""
        key = (op_json, shape)
        if key not in self._single:
            is_context, batch_size, s, prefix = shape
            row, = self.handle.evaluate_ops_json(op_json, is_context=is_context, batch_size=batch_size, s=s,
                                                 prefix=prefix)
            self._single[key] = row, bool(self.handle.last_provenance())
        return self._single[key]
