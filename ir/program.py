"""Program: an SSA graph of block-level nodes plus the WeightStore holding their tensors."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import RewriteError
from .ops import OpSpec
from .weights import WeightStore


@dataclass(frozen=True)
class Node:
    """One op application: `%name = op(%args...)`; its weights live under `path.` in the store."""

    name: str
    op: OpSpec
    args: tuple[str, ...]
    path: str

    def weight_names(self) -> dict[str, str]:
        """Local parameter name -> full store name."""
        return {k: f"{self.path}.{k}" for k in self.op.params()}


@dataclass
class Program:
    nodes: list[Node]
    weights: WeightStore
    inputs: tuple[str, ...] = ("input_ids",)
    outputs: tuple[str, ...] = ("logits",)
    #: model-level facts that are not ops (dtype, source, extra config keys to carry along)
    meta: dict = field(default_factory=dict)

    # -- queries ------------------------------------------------------------------------------------
    def node(self, key: str) -> Node:
        """By SSA name or by path."""
        for n in self.nodes:
            if key in (n.name, n.path):
                return n
        raise KeyError(f"no node named or at path {key!r}")

    def blocks(self, kind: str | None = None) -> list[Node]:
        """Residual blocks of the trunk, in order (the MTP head's blocks are inside its node)."""
        return [n for n in self.nodes if n.op.is_block and (kind is None or n.op.kind == kind)]

    def find(self, kind: str) -> list[Node]:
        return [n for n in self.nodes if n.op.kind == kind]

    def node_weights(self, node: Node) -> dict[str, torch.Tensor]:
        return {k: self.weights.get(v) for k, v in node.weight_names().items()}

    @property
    def is_meta(self) -> bool:
        return any(self.weights.is_meta(n) for n in self.weights.names())

    def input_paths(self) -> set[Path]:
        """Where this program was read from (its checkpoint or config, and the directories of its lazy
        tensors): what no output may replace."""
        w = self.weights
        found = {Path(w.source(k)).parent for k in w.names() if w.source(k) is not None}
        return found | ({Path(self.meta["source"])} if self.meta.get("source") else set())

    def copy(self) -> Program:
        """An independent Program; tensors are shared (treated as immutable)."""
        return Program(list(self.nodes), self.weights.copy(), self.inputs, self.outputs, dict(self.meta))

    # -- the one rewriter -----------------------------------------------------------------------------
    def rewrite(self, node: Node | str, op: OpSpec | None = None,
                weights: dict[str, torch.Tensor] | None = None) -> Node:
        """Replaces a node's spec and its weights together, so the two can never disagree.

        `weights` maps local names to new tensors. A parameter of the new spec that is not given keeps
        its old tensor only if the old spec had it with the same shape; anything else is an error.
        Weights the new spec no longer has are dropped.
        """
        try:
            old = self.node(node if isinstance(node, str) else node.path)
        except KeyError:
            raise RewriteError(f"rewrite: no node at {node!r}") from None
        if not isinstance(node, str) and old is not node:
            raise RewriteError(f"rewrite: {node.path} was rewritten since this Node was read; use the current one")
        idx = self.nodes.index(old)
        new = Node(old.name, op or old.op, old.args, old.path)
        given = dict(weights or {})
        old_shapes, new_shapes = old.op.stored_params(), new.op.stored_params()
        extra = sorted(set(given) - set(new_shapes))
        if extra:
            raise RewriteError(f"{old.path} ({new.op.kind}): weights {extra} are not parameters of the new spec")
        for local, shape in new_shapes.items():
            if local in given:
                if tuple(given[local].shape) != tuple(shape):
                    raise RewriteError(f"{old.path}: weight {local!r} has shape {list(given[local].shape)}, "
                                       f"the new {new.op.kind} spec needs {list(shape)}")
            elif dict(old.op.quant).get(local) != dict(new.op.quant).get(local):
                raise RewriteError(f"{old.path}: {local!r} changes its quantization; pass the new tensor in `weights=`")
            elif old_shapes.get(local) != shape:
                raise RewriteError(f"{old.path}: the new {new.op.kind} spec needs {local!r} with shape "
                                   f"{list(shape)}; pass it in `weights=`")
        for local in old_shapes:
            if local not in new_shapes:
                self.weights.delete(f"{old.path}.{local}")
        for local, t in given.items():
            self.weights.set(f"{new.path}.{local}", t)
        self.nodes[idx] = new
        return new

    # -- sizes ------------------------------------------------------------------------------------------
    def param_counts(self) -> dict:
        """Total and active (per token) parameters of the trunk, embedding and LM head included; MTP apart."""
        total = active = mtp_total = mtp_active = 0
        by_kind: dict[str, dict] = {}
        for n in self.nodes:
            t = n.op.param_count()
            a = n.op.active_params()
            if n.op.kind == "mtp":
                mtp_total, mtp_active = mtp_total + t, mtp_active + a
                continue
            total, active = total + t, active + a
            k = by_kind.setdefault(n.op.kind, {"count": 0, "total": 0, "active": 0})
            k["count"] += 1
            k["total"] += t
            k["active"] += a
        return {"total": total, "active": active, "mtp_total": mtp_total, "mtp_active": mtp_active,
                "by_kind": by_kind}
