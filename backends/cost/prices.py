"""Which provider prices a GPU target: NVIDIA's measured tables where the extra is installed and covers the GPU,
puzzlekit's analytic roofline elsewhere (`--prices auto`, the default), or either one asked for by name.

Apart so that the cost model, the search and the CLI choose alike, and the tables' library is imported only
when a tables provider is made. `PUZZLEKIT_PRICES` (auto, tables, analytic) sets the default for a process.
"""
from __future__ import annotations

import os

from ...errors import UsageError
from ..measured import MeasuredProvider
from ..targets import Target
from .analytic import AnalyticProvider
from .provider import Provider

CHOICES = ("auto", "tables", "analytic")


def default_prices() -> str:
    """`PUZZLEKIT_PRICES`, else auto."""
    prices = os.environ.get("PUZZLEKIT_PRICES", "auto") or "auto"
    if prices not in CHOICES:
        raise UsageError(f"PUZZLEKIT_PRICES={prices!r}: use one of {', '.join(CHOICES)}")
    return prices


def tables_cover(target: Target) -> str:
    """Why the measured tables cannot price `target` here ("" when they can)."""
    from .tables_db import missing, system_of

    if not system_of(target):
        return f"the measured tables have no {target.name}"
    return missing()


def provider_for(target: Target, prices: str | None = None, engine: str = "all") -> Provider | None:
    """The provider of a GPU target (None for the cpu target, whose measured provider each cost model makes):
    `tables` (refused, naming why, where they cannot), `analytic`, or `auto`: the tables where they can."""
    prices = prices or default_prices()
    if prices not in CHOICES:
        raise UsageError(f"--prices {prices!r}: use one of {', '.join(CHOICES)}")
    if target.kind == "cpu":
        return None
    why = tables_cover(target) if prices != "analytic" else "analytic asked for"
    if prices == "tables" and why:
        raise UsageError(f"--prices tables: {why}; use --prices analytic")
    if why:
        return AnalyticProvider(target)
    from .tables import TablesProvider

    return TablesProvider(target, engine)


def describe(provider) -> dict:
    """What a report records of its prices: the provider's own account (for the tables their version, database
    and mode); None stands for the cpu target's measured provider, which each cost model makes."""
    return provider.describe() if provider is not None else MeasuredProvider.describe()
