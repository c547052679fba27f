"""The records the parts of the hardware-costed search (search.py) pass between them: the deployment
`Constraints`, the chosen `Plan`, a named constraint `Row` with its per-option costs, and `Priced`, the MIP of one
span of layouts and batches. They live apart from `Search` so that the modules that build rows, cut batch
ranges, explain infeasibility and run the baselines can share them without importing `Search`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..core import PassError
from .mip import Problem


@dataclass
class Constraints:
    """Deployment constraints; 0 or empty means "not constrained"."""

    speedup: float = 0.0  # server throughput >= speedup x the parent's, at the scenario's rate floor
    decode_ms: float = 0.0  # decode-step latency at batch 1
    prefill_s: float = 0.0  # prefill of the scenario's input at batch 1
    concurrency: int = 0  # requests that must fit in memory at `context` tokens each
    context: int = 0  # 0: the scenario's context length
    max_params: float = 0.0
    max_active: float = 0.0
    mtp_acceptance: float = 0.0  # the child's head's acceptance length when drafting; 0: the scenario's
    keep: tuple = ()  # block kinds kept intact, e.g. ("attention",)
    uniform: tuple = ()  # "kind.axis" sizes equal in every layer of that kind, e.g. ("mamba2.state",)


@dataclass
class Plan:
    """A chosen architecture with its predicted figures next to the parent's."""

    feasible: bool
    layers: list  # per layer: {"layer", "path", "id", "spec"}
    predicted: dict  # constraint -> the child's figure
    parent: dict  # constraint -> the parent's figure
    limits: dict  # constraint -> the bound it must meet
    params_total: int
    params_active: int
    objective: float
    score_source: str  # "measured <metric>" or "prior"
    status: str
    gap: float
    solve_seconds: float
    batch: int = 0  # the decode batch (over all replicas) the throughput constraint was met at
    alternatives: list = field(default_factory=list)
    layout: str = ""  # the child's parallel layout on the first target
    layouts: list = field(default_factory=list)  # one per target
    prices: list = field(default_factory=list)  # per target what priced it (provider, tables' version, database)

    def to_json(self) -> dict:
        from dataclasses import asdict

        return asdict(self)


class PlanError(PassError):
    """No architecture meets the constraints (the message names the binding one and the best reachable)."""


@dataclass
class Row:
    """One named constraint: its per-option costs, the fixed part outside the blocks, the bound and the
    parent's figure (bound and figure include the fixed part; the MIP's limit is net of it)."""

    costs: np.ndarray
    fixed: float
    bound: float
    parent: float


@dataclass
class Priced:
    """The MIP of one span of deployments: per target a layout and a range of batches per replica (b1..b2; one
    batch when equal). Over a range the rows are relaxed to what every batch in it implies, so its solutions
    bound those of every batch in it from below."""

    rows: dict = field(default_factory=dict)
    spans: tuple = ()  # per target: (layout index, b1, b2)
    problem: Problem | None = None

    @property
    def costs(self) -> dict:
        return {k: r.costs for k, r in self.rows.items()}

    @property
    def bound(self) -> dict:
        return {k: r.bound for k, r in self.rows.items()}

    @property
    def fixed(self) -> dict:
        return {k: r.fixed for k, r in self.rows.items()}

    @property
    def parent(self) -> dict:
        return {k: r.parent for k, r in self.rows.items()}

    @property
    def exact(self) -> bool:
        return all(b1 == b2 for _, b1, b2 in self.spans)


def _total(row: Row, choice) -> float:
    return math.fsum(row.costs[choice])
