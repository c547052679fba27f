"""The block-library grid: which sizes of which axes become variants of which layer.

A grid is a TOML file (passes/puzzle/default-grid.toml is the default): one table per block kind mapping
axis names to candidate sizes (a float is a ratio of the parent's size, an integer an absolute size),
and `[replacements] kinds = [...]` for whole-block replacements (`noop`, `linear`) in every layer. Each
combination of a kind's axis values is one variant; steps that change nothing are dropped and variants
with the same steps are merged.
"""
from __future__ import annotations

import itertools
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

from ...errors import read_text
from ...ir.ops import OPS, OpSpec
from ..core import PassError

DEFAULT_GRID = Path(__file__).with_name("default-grid.toml")
REPLACEMENTS = ("noop", "linear")


class GridError(PassError):
    """A grid file, or one of its values for a layer, is wrong."""


@dataclass(frozen=True)
class Variant:
    """One candidate for a layer: shrink steps (axis, units kept) applied to the parent block in order,
    or a whole-block replacement."""

    steps: tuple[tuple[str, int], ...] = ()
    replacement: str = ""

    @property
    def id(self) -> str:
        return self.replacement or ",".join(f"{a}={n}" for a, n in self.steps) or "parent"


def load_grid(path=None) -> dict:
    """{kind: {axis: [values]}, "replacements": [...]} from a TOML file or a shipped grid's name (`default`,
    `planning`), checked for shape and types."""
    path = Path(path) if path else DEFAULT_GRID
    if not path.exists() and path.name == str(path) and DEFAULT_GRID.with_name(f"{path}-grid.toml").exists():
        path = DEFAULT_GRID.with_name(f"{path}-grid.toml")
    try:
        raw = tomllib.loads(read_text(path, "grid", GridError))
    except tomllib.TOMLDecodeError as e:
        raise GridError(f"grid {path}: not valid TOML ({e})") from None
    kinds = sorted(k for k, c in OPS.items() if c.is_block and k not in REPLACEMENTS)
    grid = {}
    for kind, table in raw.items():
        if kind == "replacements":
            reps = table.get("kinds") if isinstance(table, dict) else None
            if not isinstance(reps, list) or any(r not in REPLACEMENTS for r in reps) or set(table) != {"kinds"}:
                raise GridError(f"grid {path}: [replacements] takes `kinds = [...]` from {list(REPLACEMENTS)}, "
                                f"got {table!r}")
            grid["replacements"] = list(dict.fromkeys(reps))
            continue
        if kind not in kinds:
            raise GridError(f"grid {path}: unknown block kind [{kind}]; known: {', '.join(kinds)}, replacements")
        if not isinstance(table, dict):
            raise GridError(f"grid {path}: [{kind}] must be a table of axis = [sizes]")
        for axis, values in table.items():
            if not isinstance(values, list) or not values:
                raise GridError(f"grid {path}: {kind}.{axis} must be a non-empty list of sizes, got {values!r}")
            for v in values:
                ok = (isinstance(v, float) and 0 < v <= 1) or (isinstance(v, int) and not isinstance(v, bool) and v > 0)
                if not ok:
                    raise GridError(f"grid {path}: {kind}.{axis} value {v!r} is neither a ratio in (0, 1] (a float) "
                                    "nor a positive size (an integer)")
        grid[kind] = dict(table)
    if not any(grid.get(k) for k in grid):
        raise GridError(f"grid {path} is empty: it names no axis sizes and no replacements")
    return grid


def check_grid(grid: dict, prog) -> None:
    """Every axis a grid names must exist in some layer of its kind in this program."""
    for kind, table in grid.items():
        ops = [n.op for n in prog.blocks(kind)] if kind != "replacements" else []
        if not ops:
            continue
        known = sorted({a for op in ops for a in op.axes()})
        for axis in table:
            if axis not in known:
                raise GridError(f"grid: {kind} has no axis {axis!r}; its axes: {', '.join(known)}")


def units(op: OpSpec, axis: str, value, layer: str) -> int:
    """The number of units `value` (ratio or absolute size) keeps along `axis` of the parent block `op`."""
    ax = op.axes()[axis]
    size, groups = ax.size, ax.groups
    if isinstance(value, float):
        n = max(1, math.floor(value * size / groups + 1e-9)) * groups
    else:
        n = value
        if n > size:
            raise GridError(f"{layer} ({op.kind}): {axis}={n} exceeds the parent's {size}")
        if n % groups:
            raise GridError(f"{layer} ({op.kind}): {axis}={n} is not a multiple of its {groups} groups")
    return n


def variants(op: OpSpec, grid: dict, layer: str) -> list[Variant]:
    """The layer's variants: the parent itself, every combination of its kind's axis sizes, replacements."""
    table = {a: v for a, v in grid.get(op.kind, {}).items() if a in op.axes()}
    order = [a for a in op.axes() if a in table]  # the op's application order
    out = [Variant()]
    for combo in itertools.product(*(table[a] for a in order)):
        steps, spec = [], op
        for axis, value in zip(order, combo):
            n = units(op, axis, value, layer)
            if n >= spec.axes()[axis].size:
                continue  # nothing to cut (or already cut further by an earlier step)
            if axis == "experts" and n < spec.top_k:
                raise GridError(f"{layer} (moe): experts={n} is below top_k={spec.top_k}; "
                                "add a smaller top_k to the grid or keep more experts")
            steps.append((axis, n))
            spec = spec.resized(axis, n)
        v = Variant(tuple(steps))
        if v not in out:
            out.append(v)
    out += [Variant(replacement=r) for r in grid.get("replacements", []) if op.kind != r]
    return out

