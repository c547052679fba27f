"""A traced piece the registry did not recognise: it keeps its fx graph, runs and exports, and passes leave it alone."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

from .base import OpSpec


@dataclass(frozen=True)
class Opaque(OpSpec):
    kind = "opaque"
    module: str  # class name (or "glue") of what it came from
    roles: tuple = ("hidden",)
    graph: object = field(default=None, compare=False, repr=False)  # torch.fx.GraphModule

    @property
    def inputs(self):
        return self.roles

    def attrs(self):
        ops = 0 if self.graph is None else sum(n.op == "call_function" for n in self.graph.graph.nodes)
        return {"module": self.module, "ops": ops}

    def params(self):
        if self.graph is None:
            return {}
        return {k: tuple(v.shape) for k, v in self.graph.state_dict().items()}

    def build(self):
        return copy.deepcopy(self.graph)
