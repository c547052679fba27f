"""The cost model: prices a Program on a target and a deployment scenario.

Each op reports hardware-independent work (ir/ops: `work`, `state_bytes`); a provider turns work
into seconds: the analytic roofline for GPUs, or timings measured on this machine for `cpu`.
Assumptions are listed in docs/cost-model.md.

This package re-exports its modules' names (the module it was split from): scenario (TOML scenarios),
precision (bytes per format), provider (the interface), analytic (the GPU roofline), report, model
(`CostModel`), layouts (the layout search and `cost`).
"""
from ..measured import MeasuredProvider
from .analytic import KERNELS, AnalyticProvider, Efficiency
from .layouts import Unservable, best_layout, cost, layouts_of, serves_experts
from .model import CostModel
from .precision import BYTES, MATH, precision_of
from .provider import Deployment, Provider
from .report import CostReport
from .scenario import SCENARIOS_FILE, Scenario, get_scenario, scenarios

from .analytic import _math_precision, _sequence_precision  # noqa: F401  (private, importable as before)
from .model import _layout_for  # noqa: F401

__all__ = ["BYTES", "KERNELS", "MATH", "SCENARIOS_FILE", "AnalyticProvider", "CostModel", "CostReport", "Deployment",
           "Efficiency", "MeasuredProvider", "Provider", "Scenario", "best_layout", "cost", "get_scenario", "layouts_of",
           "precision_of", "scenarios", "serves_experts"]
