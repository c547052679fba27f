"""Stable text form of a Program (golden-tested): one line per node, attributes that differ from defaults."""
from __future__ import annotations

import dataclasses

from .ops import OpSpec
from .program import Program


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(v)


def format_attrs(op: OpSpec) -> str:
    if dataclasses.is_dataclass(op) and op.kind != "opaque":
        items = {}
        for f in dataclasses.fields(op):
            v = getattr(op, f.name)
            if f.name == "blocks" or (f.default is not dataclasses.MISSING and v == f.default):
                continue
            items[f.name] = v
        if op.kind == "mtp":
            items["pattern"] = op.pattern
        if op.quant:
            items.pop("quant", None)
            counts: dict[str, int] = {}
            for _, fmt in op.quant:
                counts[fmt] = counts.get(fmt, 0) + 1
            items["quant"] = ",".join(f"{f}x{c}" for f, c in sorted(counts.items()))
    else:
        items = op.attrs()
    return "{" + ", ".join(f"{k}={_value(v)}" for k, v in items.items()) + "}"


def print_program(prog: Program) -> str:
    lines = []
    for n in prog.nodes:
        args = ", ".join(f"%{a}" for a in n.args)
        lines.append(f"%{n.name} = {n.op.kind}({args}) {format_attrs(n.op)}  # {n.path}")
        for i, b in enumerate(getattr(n.op, "blocks", ()) if n.op.kind == "mtp" else ()):
            lines.append(f"    layers.{i} = {b.kind} {format_attrs(b)}")
    lines.append("return " + ", ".join(f"%{o}" for o in prog.outputs))
    return "\n".join(lines) + "\n"


def format_params(prog: Program) -> str:
    """A table of parameters per block kind: count, total and active."""
    c = prog.param_counts()
    rows = [("kind", "count", "total", "active")]
    rows += [(k, str(v["count"]), _human(v["total"]), _human(v["active"])) for k, v in c["by_kind"].items()]
    rows.append(("trunk", "", _human(c["total"]), _human(c["active"])))
    if c["mtp_total"]:
        rows.append(("mtp head", "", _human(c["mtp_total"]), _human(c["mtp_active"])))
    return format_table(rows)


def format_table(rows: list[tuple[str, ...]]) -> str:
    """Aligned columns: the first left-aligned, the rest right-aligned (numbers)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r))
                     for r in rows) + "\n"


def _human(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)
