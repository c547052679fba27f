"""The cost report: a priced program's figures on one target, scenario and layout.

Apart because it is plain data, built by the cost model and read by the CLI, the search and the engines.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .scenario import Scenario


@dataclass
class CostReport:
    target: str
    scenario: Scenario
    params_total: int
    params_active: int
    weight_bytes: float
    state_bytes_per_request: float
    reserve_bytes: float
    memory_available_bytes: float
    max_concurrency: int
    max_batch: int
    decode_step_seconds: float
    decode_step_seconds_batch1: float
    prefill_seconds: float
    serve_step_seconds: float
    throughput_tokens_per_second: float
    binding: str = ""
    headroom: dict = field(default_factory=dict)
    by_kind: dict = field(default_factory=dict)
    infeasible: str = ""
    layout: str = "tp1"
    tokens_per_step: float = 1.0  # per user: 1, or the MTP head's acceptance length
    user_tokens_per_second: float = 0.0
    device_weight_bytes: float = 0.0
    device_state_bytes_per_request: float = 0.0
    layouts: list = field(default_factory=list)  # every layout tried: {"layout", "max_batch", "throughput", ...}
    prices: dict = field(default_factory=dict)  # what priced it: the provider (and its tables' version and mode)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["scenario"] = dataclasses.asdict(self.scenario)
        return d

    def summary(self) -> dict:
        return {"layout": self.layout, "max_batch": self.max_batch, "max_concurrency": self.max_concurrency,
                "throughput": self.throughput_tokens_per_second, "user_rate": self.user_tokens_per_second,
                "serve_step_ms": self.serve_step_seconds * 1e3, "binding": self.binding, "infeasible": self.infeasible}
