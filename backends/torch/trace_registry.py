"""The tracing registry: module class -> converter (the op and weights a recognised submodule becomes), the
built-in converters for our own reference modules, and the path renames per root class. Kept apart from
`tracing` so that converter modules (`tracing_hf`) register into it without importing the tracer."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ...ir.ops import Embed, LMHead, Norm, OpSpec
from ...ir.ops.base import Block, RMSNorm
from ...ir.ops.mtp import MTPHead
from ...ir.ops.routed import split_experts


@dataclass
class Converted:
    op: OpSpec
    weights: dict[str, torch.Tensor]  # local names as in op.params()
    path: str | None = None  # canonical path, when it differs from the module path
    swap: bool = False  # export our reference module in its place (its own code does not export)


Converter = Callable[[nn.Module, str], "Converted | None"]
_REGISTRY: dict[type, Converter] = {}
#: path renames per root class: transformers names the trunk `model.`, checkpoints `backbone.`
ROOT_RENAMES: dict[str, list[tuple[str, str]]] = {"NemotronHForCausalLM": [(r"^model\.", "backbone.")]}


def register_module(cls: type, converter: Converter | None = None):
    """Maps a module class to an op. `converter(module, path)` returns Converted or None (stay opaque).

    Usable as a decorator on a converter: `@register_module(MyBlock)`.
    """
    if converter is None:
        return lambda fn: register_module(cls, fn) or fn
    _REGISTRY[cls] = converter
    return None


def _convert(m: nn.Module, path: str) -> Converted | None:
    for cls in type(m).__mro__:
        if cls in _REGISTRY:
            return _REGISTRY[cls](m, path)
    return None


# -- built-in converters ----------------------------------------------------------------------------
register_module(Block, lambda m, p: Converted(m.spec, split_experts(m.state_dict())))
register_module(MTPHead, lambda m, p: Converted(m.spec, split_experts(m.state_dict())))
register_module(nn.Embedding, lambda m, p: Converted(Embed(m.num_embeddings, m.embedding_dim),
                                                     {"weight": m.weight.detach()}))
register_module(RMSNorm, lambda m, p: Converted(Norm(m.weight.shape[0], m.eps), {"weight": m.weight.detach()}))
register_module(nn.Linear, lambda m, p: Converted(LMHead(m.out_features, m.in_features), {"weight": m.weight.detach()})
                if m.bias is None and p.rsplit(".", 1)[-1] == "lm_head" else None)
