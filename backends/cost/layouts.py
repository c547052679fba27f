"""Parallel layouts: those a scenario may use, the best of them by throughput, and `cost`, the one-call entry.

Apart from `CostModel`, which prices one layout: these price several and pick.
"""
from __future__ import annotations

import dataclasses

from ...errors import PuzzlekitError
from ...ir import Program
from ..layout import Layout, layouts
from ..targets import Target, get_target
from .model import CostModel
from .provider import Provider
from .report import CostReport
from .scenario import Scenario, get_scenario


def layouts_of(target: Target, scenario: Scenario) -> list[Layout]:
    """The scenario's pinned layout, or every layout of the GPUs it uses."""
    return [Layout.parse(scenario.layout)] if scenario.layout else layouts(scenario.gpus or target.devices)


def best_layout(prog: Program, target: Target | str, scenario: Scenario, provider: Provider | None = None,
                routing: dict | None = None, fits=None) -> tuple[CostModel, CostReport]:
    """The scenario's pinned layout, or every layout of its GPUs tried (those `fits(layout)` admits, when
    given): the one with the highest throughput meeting the rate floor (ties: the fewest devices per replica),
    its report listing every layout tried."""
    target = get_target(target) if isinstance(target, str) else target
    scenario = scenario.check()
    tried = []
    for layout in layouts_of(target, scenario):
        if fits is None or fits(layout):
            cm = CostModel(prog, target, scenario, provider, routing, layout)
            tried.append((cm, cm.report()))
    if not tried:
        raise PuzzlekitError(f"no layout of {target.name} admitted for {scenario.name}")
    cm, best = max(tried, key=lambda t: (t[1].throughput_tokens_per_second, t[1].max_concurrency,
                                         -t[0].layout.group))
    best.layouts = [r.summary() for _, r in tried]
    return cm, best


def cost(prog: Program, target: str | Target, scenario: str | Scenario, provider=None, **overrides) -> CostReport:
    """One call: `cost(prog, "h100", "long-1m", recipe="fp8").max_concurrency` (the best layout's figures)."""
    sc = get_scenario(scenario, **overrides) if isinstance(scenario, str) else \
        dataclasses.replace(scenario, **{k: v for k, v in overrides.items() if v is not None})
    return best_layout(prog, target, sc, provider)[1]
