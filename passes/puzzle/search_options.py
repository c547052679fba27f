"""The options of a library as the search (search.py) sees them: their scores (measured, or the prior for
weightless libraries), their labels in a uniform group, and what the engines refuse to split over a layout.
Pure functions of the library's rows and specs, apart from `Search` so that its constructor only assembles them.
"""
from __future__ import annotations

import numpy as np

from ..core import PassError

#: prior score weights per block kind, for weightless libraries (see `prior_score`)
PRIOR_WEIGHT = {"attention": 4.0, "mamba2": 2.0, "moe": 1.0, "mlp": 1.0}


def prior_score(row: dict, parent_row: dict, layer: int, layers: int) -> float:
    """A stand-in score for weightless libraries: the squared share of the block removed (parameters and
    active parameters, half each), weighted per kind and more at the ends of the stack (the first and last
    layers are the most sensitive). Squared because measured KL grows about quadratically with the cut."""
    if row["id"] == "parent":
        return 0.0
    removed = 0.5 * (1 - row["params"] / parent_row["params"]) + \
        0.5 * (1 - row["active_params"] / max(parent_row["active_params"], 1))
    edge = abs(2 * layer / max(layers - 1, 1) - 1)
    return PRIOR_WEIGHT.get(parent_row["kind"], 1.0) * (1 + edge) * removed ** 2


def option_scores(lib, rows: list[dict], parents: dict, metric: str) -> tuple[np.ndarray, str]:
    """Per option its score under `metric` (the prior for a weightless library), and where the scores come from."""
    if lib.weightless:
        n = len(parents)
        return np.array([prior_score(r, parents[r["layer"]], r["layer"], n) for r in rows]), "prior"
    missing = [r for r in rows if metric not in r.get("scores", {})]
    if missing:
        known = sorted(rows[0].get("scores", {}))
        raise PassError(f"library {lib.path} has no {metric!r} score for variant {missing[0]['layer']}/"
                        f"{missing[0]['id']}; recorded: {known or 'none'}")
    return np.array([r["scores"][metric] for r in rows]), f"measured {metric}"


def uniform_labels(rows: list[dict], specs: list, name: str) -> np.ndarray:
    """Per option its values of a uniform group "kind.attr" or "kind.attr+attr+..." (None: another kind)."""
    kind, _, attrs = name.partition(".")
    known = {a for r, s in zip(rows, specs) if r["kind"] == kind for a in s.attrs()}
    for axis in attrs.split("+"):
        if not axis or axis not in known or axis == "quant":
            raise PassError(f"uniform={name!r}: {kind or '?'} has no attribute {axis!r}; "
                            f"known: {', '.join(sorted(known - {'quant'})) or 'no layer of that kind'}")
    return np.array([tuple(getattr(s, a) for a in attrs.split("+")) if r["kind"] == kind else None
                     for r, s in zip(rows, specs)], dtype=object)


def refused(engine, ops, recipes: str):
    """layout -> why `engine` does not split one of `ops` over it ("" : it splits them all)."""
    ops = list(ops)
    return lambda L: next((why for op in ops if (why := engine.unsplit(op, L, recipes))), "")
