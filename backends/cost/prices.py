"""Which provider prices a target, by one rule said once:

- a built-in GPU target (h100, h200, b200 and their nodes) is priced from NVIDIA's measured tables where the
  extra is installed (`--prices auto`, the default), else by puzzlekit's analytic roofline;
- a target of the user's own (a target file) describes their GPU, so it is priced analytically by its own
  figures, whatever its name, unless `--prices tables` asks for the tables of the GPU its name names (and then
  `cost` and `--explain` say that its bandwidth and peaks are not what prices the kernels);
- `--prices tables` where the tables cannot price (another GPU, the extra missing) is refused, naming why;
- the cpu target is timed on this machine: `--prices` chooses how a GPU target is priced, and is refused there.

Apart so that the cost model, the search and the CLI choose alike, and the tables' library is imported only
when a tables provider is made. `PUZZLEKIT_PRICES` (auto, tables, analytic) sets the default for a process
(it is ignored on the cpu target, which has no choice).
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
    from .tables_db import SYSTEMS, built_in, missing, system_of

    if not system_of(target):
        return (f"the measured tables cover {', '.join(SYSTEMS)} and their nodes (8xh100, ...), not {target.name}"
                + (" (a target file is matched to them by its name)" if not built_in(target) else ""))
    return missing()


def source_of(target: Target, prices: str | None = None) -> str:
    """What prices `target` ("measured" for the cpu target, "tables" or "analytic"), by the rule above; a
    `--prices` the target cannot take is refused here, before any work. `prices` None: `PUZZLEKIT_PRICES`."""
    if prices is not None and prices not in CHOICES:
        raise UsageError(f"--prices {prices!r}: use one of {', '.join(CHOICES)}")
    if target.kind == "cpu":
        if prices in ("tables", "analytic"):
            raise UsageError(f"--prices {prices}: the cpu target is timed op by op on this machine (--prices chooses "
                             "how a GPU target is priced); drop --prices, or name a GPU target")
        return "measured"
    prices = prices or default_prices()
    if prices == "analytic":
        return "analytic"
    from .tables_db import built_in

    why = tables_cover(target)
    if prices == "tables" and why:
        raise UsageError(f"--prices tables: {why}; use --prices analytic")
    return "analytic" if why or (prices == "auto" and not built_in(target)) else "tables"


def provider_for(target: Target, prices: str | None = None, engine: str = "all") -> Provider | None:
    """The provider of a target as `source_of` chooses (None for the cpu target, whose measured provider each
    cost model makes)."""
    source = source_of(target, prices)
    if source == "measured":
        return None
    if source == "analytic":
        return AnalyticProvider(target)
    from .tables import TablesProvider

    return TablesProvider(target, engine)


def describe(provider) -> dict:
    """What a report records of its prices: the provider's own account (for the tables their version, database
    and mode); None stands for the cpu target's measured provider, which each cost model makes."""
    return provider.describe() if provider is not None else MeasuredProvider.describe()
