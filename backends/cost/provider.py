"""The provider interface: what `CostModel` asks of whatever turns an op's work into seconds.

Apart so that the analytic provider, the measured one and the cost model share it without importing each other.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..layout import Layout


@dataclass(frozen=True)
class Deployment:
    """What pricing an op needs besides its shapes: the parallel layout and the state and activation widths."""

    layout: Layout = Layout()
    act_bytes: float = 2.0
    kv_bytes: float = 2.0
    ssm_bytes: float = 4.0
    ssm_copies: int = 1  # SSM states kept per request: d + 1 with d drafted tokens (one per verified position)
    graphs: bool = True  # decode replayed from CUDA graphs (the launch floor: Efficiency.launch_seconds)


class PricedAhead:
    """What a provider that prices from numbers it already has (no timing on this machine) does for the parts
    of the interface that concern timing: nothing to check, fetch or time together, no batch bound of its own."""

    max_batch = 1 << 20
    measures = False

    def check(self, items) -> None:
        return None

    def prefetch(self, items) -> None:
        return None

    def prepare(self, items) -> bool:
        return False

    def batch_limit(self, ops, context: int) -> int:
        return self.max_batch


class Provider(Protocol):
    """Turns an op's work at a shape into seconds. `CostModel` prices through this interface only."""

    max_batch: int
    measures: bool  # times this machine (whole-model checks and re-timing apply)

    def step_overhead(self) -> float: ...

    def check(self, items: list[tuple]) -> None:
        """Raises for (op, batch, tokens, context, decode) shapes it cannot price."""

    def prefetch(self, items: list[tuple]) -> None:
        """Prices the `items` (a step's runs) it has not priced yet together."""

    def prepare(self, items: list[tuple]) -> bool:
        """Prices `items` together (the measured provider times them in one round-robin); True when times
        priced before may have changed."""

    def batch_limit(self, ops, context: int) -> int: ...

    def seconds(self, op, precisions: dict, routing, batch: int, tokens: int, context: int, decode: bool,
                deployment: Deployment) -> float: ...
