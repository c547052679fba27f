"""Where each price came from: a priced step's time per op kind and part, with the source of each part.

Apart from the cost model (which sums prices) and the providers (which make them): this only asks the provider
for a step's parts and groups them, for `cost --explain`.
"""
from __future__ import annotations

from .prices import describe

OURS = "puzzlekit's term"


def explain(cm, batch: int) -> dict:
    """The decode step at `batch` and the prefill round of `cm`'s scenario, as (kind, part, source) rows with the
    seconds summed over the layers (one device), plus what the provider is."""
    s = cm.scenario
    steps = {"decode": [(n, cm.decode_parts(n.op, batch, s.decode_context)) for n in cm.prog.nodes],
             "prefill": [(n, cm.prefill_parts(n.op)) for n in cm.prog.nodes]}
    out = {"prices": describe(cm.provider), "batch": batch}
    for phase, runs in steps.items():
        rows: dict = {}
        for n, parts in runs:
            for *shape, times in parts:
                for part, seconds, source in _parts(cm, n, shape):
                    r = rows.setdefault((n.op.kind, part, source), {"kind": n.op.kind, "part": part, "source": source,
                                                                     "seconds": 0.0, "runs": 0})
                    r["seconds"] += times * seconds
                    r["runs"] += times
        out[phase] = sorted(rows.values(), key=lambda r: -r["seconds"])
        out[f"{phase}_seconds"] = sum(r["seconds"] for r in out[phase]) + cm.provider.step_overhead()
    return out


def _parts(cm, node, shape) -> list[tuple]:
    """One run's parts: the provider's own breakdown where it has one, else the op as one part of its term."""
    prec, routing = cm.precisions[node.path], cm.routing.get(node.path)
    if hasattr(cm.provider, "explain"):
        return cm.provider.explain(node.op, prec, routing, *shape, cm.deployment)
    return [("whole op", cm.provider.seconds(node.op, prec, routing, *shape, cm.deployment),
             "measured on this machine" if cm.provider.measures else OURS)]


def format_explain(ex: dict) -> str:
    """The explanation as text: the provider, then per phase the parts by time."""
    p = ex["prices"]
    head = ", ".join(f"{k} {v}" for k, v in p.items() if not isinstance(v, dict))
    lines = [f"prices: {head}"]
    for phase in ("decode", "prefill"):
        total, rows = ex[f"{phase}_seconds"], ex[phase]
        overhead = total - sum(r["seconds"] for r in rows)
        lines.append(f"{phase} ({'batch ' + str(ex['batch']) if phase == 'decode' else 'one round'}): "
                     f"{total * 1e3:.3f} ms, of which step overhead {overhead * 1e3:.3f} ms")
        lines += [f"  {r['kind']:<10} {r['part']:<20} {r['seconds'] * 1e3:10.4f} ms  x{r['runs']:<4} {r['source']}"
                  for r in rows]
    return "\n".join(lines) + "\n"
