"""The statement of Puzzle's architecture search as a mixed-integer program: one option per layer, a score to
minimise, budgets on summed costs, groups of layers that must agree; and what a solve returns or raises."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ..core import PassError


@dataclass
class Problem:
    """Choose one option per layer; arrays are flat over all options. Construction checks the arrays and
    derives n_layers and members (the option indices of each layer)."""

    layer: np.ndarray                 # int [n]: the layer of each option, layers 0..L-1 each with >= 1 option
    score: np.ndarray                 # float [n]: minimised
    costs: dict[str, np.ndarray]      # resource -> float [n], summed over the chosen options
    limits: dict[str, float]          # resource -> upper bound on its sum
    uniform: dict[str, np.ndarray] = field(default_factory=dict)  # group -> labels [n], None or -1: not concerned
    lower: dict[str, float] = field(default_factory=dict)         # resource -> lower bound on its sum

    def __post_init__(self):
        self.layer = np.asarray(self.layer, dtype=np.int64)
        n = self.layer.size
        if self.layer.ndim != 1 or n == 0:
            raise PassError("Problem.layer must be a non-empty 1-D array of layer indices")
        self.n_layers = int(self.layer.max()) + 1
        if self.layer.min() < 0 or not np.bincount(self.layer).all():
            raise PassError("Problem.layer must number the layers 0..L-1, each with at least one option")
        self.score = _vector("score", self.score, n)
        self.costs = {r: _vector(f"costs[{r!r}]", c, n) for r, c in self.costs.items()}
        for kind, bounds in (("limits", self.limits), ("lower", self.lower)):
            unknown = set(bounds) - set(self.costs)
            if unknown:
                raise PassError(f"Problem.{kind} names resources without costs: {sorted(unknown)}")
            if not all(math.isfinite(v) for v in bounds.values()):
                raise PassError(f"Problem.{kind} must be finite: {bounds}")
        self.members = [np.flatnonzero(self.layer == l) for l in range(self.n_layers)]
        self._codes, self._labels = {}, {}
        for g, labels in self.uniform.items():
            self._codes[g], self._labels[g] = _encode(g, labels, n)
        starts = np.cumsum([n] + [len(v) for v in self._labels.values()])
        self._y_start = dict(zip(self._labels, starts[:-1].tolist()))
        self._n_vars = int(starts[-1])

    def codes(self, group: str) -> np.ndarray:
        """A uniform group's label per option as an integer code (-1: the option is not concerned)."""
        return self._codes[group]


@dataclass
class Solution:
    choice: np.ndarray          # int [L]: the option (index into the flat arrays) chosen for each layer
    objective: float            # summed score of the choice (exact)
    totals: dict[str, float]    # resource -> summed cost of the choice (exact), for every resource in costs
    status: str                 # "optimal" or "time limit"
    gap: float                  # relative gap between the objective and HiGHS's lower bound
    seconds: float


class Binding(NamedTuple):
    """A bound out of reach: `best` is the least (sense "<=") or most (">=") the resource can reach."""

    resource: str
    best: float | None
    bound: float
    sense: str


class Infeasible(PassError):
    """No choice meets every constraint. `binding` gives the numbers of the bounds at fault; `conflict`
    describes a smallest set of constraints that cannot hold together (each can alone unless binding alone)."""

    def __init__(self, message: str, binding=(), conflict=()):
        super().__init__(message)
        self.binding = list(binding)
        self.conflict = list(conflict)


class TimedOut(PassError):
    """HiGHS found no feasible choice within the time limit, so feasibility is unknown."""


def _vector(name: str, values, n: int) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64)
    if v.shape != (n,) or not np.isfinite(v).all():
        raise PassError(f"Problem.{name} must be {n} finite numbers, got shape {v.shape}")
    return v


def _encode(g: str, labels, n: int) -> tuple[np.ndarray, list]:
    """Integer codes per option (-1: not concerned) and the distinct labels they index."""
    labels = list(labels)
    if len(labels) != n:
        raise PassError(f"Problem.uniform[{g!r}] has {len(labels)} labels for {n} options")
    index: dict = {}
    codes = np.array([-1 if _unconcerned(x) else index.setdefault(x, len(index)) for x in labels], dtype=np.int64)
    return codes, list(index)


def _unconcerned(label) -> bool:
    return label is None or (isinstance(label, numbers.Integral) and label == -1)
