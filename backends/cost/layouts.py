"""Parallel layouts: those a scenario may use, the best of them by throughput, and `cost`, the one-call entry.

Apart from `CostModel`, which prices one layout: these price several and pick.
"""
from __future__ import annotations

import dataclasses

from collections import Counter

from ...errors import PuzzlekitError, UsageError
from ...ir import Program
from ..layout import Layout, layouts, no_experts_refusal, split_refusal
from ..targets import Target, get_target
from .model import CostModel, _layout_for, shared_provider
from .provider import Provider
from .report import CostReport
from .scenario import Scenario, get_scenario


class Unservable(UsageError):
    """A pinned layout, or every layout of a target, that the serving engines cannot split the model over (or,
    pinned, one spreading routed experts over a model serving none)."""


def serves_experts(prog: Program, scenario: Scenario) -> bool:
    """Whether serving `prog` in `scenario` loads routed experts: a MoE block in the trunk, or in the MTP head
    when the head is loaded (drafting, or `mtp_resident`; plain decoding does not load it, as `CostModel`
    prices it)."""
    head = scenario.mtp_draft > 0 or scenario.mtp_resident
    return any(n.op.kind == "moe" or (head and n.op.kind == "mtp" and any(b.kind == "moe" for b in n.op.blocks))
               for n in prog.nodes)


def layouts_of(target: Target, scenario: Scenario, prog: Program | None = None) -> list[Layout]:
    """The scenario's pinned layout, or every layout of the GPUs it uses, following `prog`: without routed
    experts (`serves_experts`) no expert or attention data parallel (`layouts`), and such a layout pinned is
    refused naming the one to use (`no_experts_refusal`). Without `prog`, every layout."""
    experts = prog is None or serves_experts(prog, scenario)
    if not scenario.layout:
        return layouts(scenario.gpus or target.devices, experts=experts)
    layout = Layout.parse(scenario.layout)
    if not experts and (why := no_experts_refusal(layout, _none(prog))):
        raise Unservable(why)
    return [layout]


def _none(prog: Program) -> str:
    """How a model serving no routed experts has none: none at all, or only in its MTP head, not loaded."""
    head = any(b.kind == "moe" for n in prog.find("mtp") for b in n.op.blocks)
    return ("the model serves none (its MTP head's are loaded only when drafting, --mtp)" if head
            else "the model has none")


def unsplit(prog: Program, layout: Layout, recipes: str = "") -> str:
    """Every distinct reason the serving engines do not split `prog` over `layout` (`split_refusal`: heads or
    widths that do not divide), each with the layers it holds, or "" when they split all of it."""
    why = Counter(r for n in prog.nodes if (r := split_refusal(n.op, layout, recipes)))
    return ", ".join(f"{r} ({k} layer{'s' * (k > 1)})" for r, k in why.items())


def _recipes(prog: Program, scenario: Scenario) -> str:
    """The precisions the split rule reads: the scenario's recipe and the formats the program is quantized in."""
    return " ".join([scenario.recipe or "", *sorted({f for n in prog.nodes for _, f in n.op.quant})]).strip()


def best_layout(prog: Program, target: Target | str, scenario: Scenario, provider: Provider | None = None,
                routing: dict | None = None, fits=None, engines: bool = False) -> tuple[CostModel, CostReport]:
    """The scenario's pinned layout, or every layout of its GPUs tried (those `fits(layout)` admits, when
    given): the one with the highest throughput meeting the rate floor (ties: the fewest devices per replica),
    its report listing every layout tried.

    With `engines`, the split rule the search keeps to applies here too: a layout the serving engines cannot
    split the model over is not priced (a figure for it would be no deployment): pinned, it is refused naming
    what does not divide and the layouts that do; searched, its row in `layouts` says why ("unservable")."""
    target = get_target(target) if isinstance(target, str) else target
    scenario = scenario.check()
    recipes = _recipes(prog, scenario)
    provider = shared_provider(target, provider)
    tried, refused, rows = [], [], []  # rows: every layout in order, its report or why no engine splits it
    for layout in layouts_of(target, scenario, prog):
        if fits is not None and not fits(layout):
            continue
        if scenario.layout:  # a layout of other GPUs than the target's is refused for that first
            _layout_for(target, scenario, layout)
        if engines and (why := unsplit(prog, layout, recipes)):
            refused.append({"layout": str(layout), "unservable": why})
            rows.append(refused[-1])
            continue
        cm = CostModel(prog, target, scenario, provider, routing, layout)
        tried.append((cm, cm.report()))
        rows.append(tried[-1][1])
    if refused and scenario.layout:
        gpus = Layout.parse(scenario.layout).gpus
        ok = [str(L) for L in layouts(gpus, experts=serves_experts(prog, scenario)) if not unsplit(prog, L, recipes)]
        raise Unservable(f"layout {scenario.layout}: no serving engine splits the model over it: "
                         f"{refused[0]['unservable']}; pin a layout whose tp divides them"
                         + (f" (of {gpus} GPUs: {', '.join(ok)})" if ok else "")
                         + ", or leave the layout out to price the best one the engines split")
    if refused and not tried:
        raise Unservable(f"no layout of {scenario.gpus or target.devices} {target.name} GPUs splits the model as the "
                         "serving engines do: "
                         + "; ".join(f"{r['layout']}: {r['unservable']}" for r in refused))
    if not tried:
        raise PuzzlekitError(f"no layout of {target.name} admitted for {scenario.name}")
    cm, best = max(tried, key=lambda t: (t[1].throughput_tokens_per_second, t[1].max_concurrency,
                                         -t[0].layout.group))
    best.layouts = [r if isinstance(r, dict) else r.summary() for r in rows]
    return cm, best


def cost(prog: Program, target: str | Target, scenario: str | Scenario, provider=None, **overrides) -> CostReport:
    """One call: `cost(prog, "h100", "long-1m", recipe="fp8").max_concurrency` (the best layout's figures)."""
    sc = get_scenario(scenario, **overrides) if isinstance(scenario, str) else \
        dataclasses.replace(scenario, **{k: v for k, v in overrides.items() if v is not None})
    return best_layout(prog, target, sc, provider)[1]
