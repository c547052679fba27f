"""Tracing: torch module -> Program, via torch.export (non-strict), grouping nodes by nn_module_stack.

Recognised submodules (a registry: module class -> converter) become typed nodes. Before export,
each is swapped for our reference module built from the converter's spec and weights, so models
whose own code cannot export (transformers' MoE loops over nonzero()) still trace. Everything
else stays as opaque nodes holding their fx subgraph, which still runs. The Program is then
checked against the original module's outputs.

The registry of converters lives in `trace_registry`, the partitioning of the exported graph into a
Program in `trace_graph`; this module swaps, exports and checks.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

from ...errors import TraceError
from ...ir.ops.base import use_export_form
from ...ir.program import Program
from . import load_tensors
from .fake_tensors import uncached_fake_tensors
from .trace_graph import _build, _flatten
from .trace_registry import _REGISTRY, ROOT_RENAMES, Converted, Converter, _convert, register_module  # noqa: F401

try:  # transformers is optional
    from . import tracing_hf  # noqa: F401  (registers the NemotronH classes)
except ImportError:
    pass


# -- the call adapter used during export --------------------------------------------------------------
class _Stand(nn.Module):
    """Our reference block, called with the original module's signature (extra arguments ignored)."""

    def __init__(self, ref: nn.Module, original: nn.Module):
        super().__init__()
        self.ref = ref
        object.__setattr__(self, "_original", original)

    def __getattr__(self, name):  # plain attributes the caller reads (e.g. block_type) come from the original
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_original"), name)

    def forward(self, hidden_states, *args, **kwargs):
        return self.ref(hidden_states)[0]


def _swap(root: nn.Module, found: dict[str, Converted], originals: dict[str, nn.Module]) -> None:
    """Puts our reference module in place of each recognised one, recording originals as it goes."""
    for path, c in found.items():
        if not c.swap:
            continue
        ref = use_export_form(c.op.build())
        try:
            load_tensors(ref, c.weights)
        except (KeyError, ValueError) as e:
            raise TraceError(f"{path}: the converter's weights do not fit its {c.op.kind} spec: "
                             f"{str(e).splitlines()[0]}") from None
        parent, _, leaf = path.rpartition(".")
        owner = root.get_submodule(parent) if parent else root
        originals[path] = getattr(owner, leaf)
        setattr(owner, leaf, _Stand(ref, originals[path]))


def _restore(root: nn.Module, originals: dict[str, nn.Module]) -> None:
    for path, m in originals.items():
        parent, _, leaf = path.rpartition(".")
        setattr(root.get_submodule(parent) if parent else root, leaf, m)


def _recognise(root: nn.Module) -> dict[str, Converted]:
    """Outermost recognised submodules by path (a recognised module's children are not searched)."""
    found: dict[str, Converted] = {}
    for path, m in root.named_modules():
        if not path or any(path.startswith(p + ".") for p in found):
            continue
        c = _convert(m, path)
        if c is not None:
            found[path] = c
    return found


def trace(module: nn.Module, example_inputs: tuple, check: bool = True, kwargs: dict | None = None,
          atol: float = 1e-5, rtol: float = 1e-5) -> Program:
    """Traces `module(*example_inputs, **kwargs)` into a Program (dynamic batch and length).

    check: run the Program on the example inputs and require the module's outputs (atol/rtol).
    """
    example_inputs = tuple(example_inputs)
    kwargs = _without_cache(module, example_inputs, kwargs or {})
    was_training = module.training
    module.eval()
    with torch.no_grad():
        expected = module(*example_inputs, **kwargs)
    found = _recognise(module)
    originals: dict[str, nn.Module] = {}
    try:
        _swap(module, found, originals)
        bound = inspect.signature(module.forward).bind(*example_inputs, **kwargs).arguments
        dyn = {k: _dynamic(v) for k, v in bound.items()}
        try:
            with uncached_fake_tensors():
                ep = torch.export.export(module, example_inputs, kwargs, dynamic_shapes=dyn, strict=False)
        except Exception as e:
            raise TraceError(f"torch.export failed on {type(module).__name__}: {type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}") from e
        gm = ep.module()
    finally:
        _restore(module, originals)
        module.train(was_training)
    prog = _build(gm, found, module)
    if check:
        _check(prog, module, example_inputs, expected, atol, rtol)
    return prog


def _without_cache(module: nn.Module, args: tuple, kwargs: dict) -> dict:
    """Adds `use_cache=False` when forward takes it and the caller did not pass it: a returned cache object
    (transformers' DynamicCache) is no pytree torch.export can flatten, and a Program keeps its own state."""
    params = list(inspect.signature(module.forward).parameters)
    if "use_cache" in params and "use_cache" not in kwargs and params.index("use_cache") >= len(args):
        return {**kwargs, "use_cache": False}
    return kwargs


def _dynamic(v):
    """Batch and sequence dimensions of tensor inputs are dynamic."""
    if isinstance(v, torch.Tensor) and v.dim() >= 2:
        return {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO}
    return None


def _check(prog: Program, module, example_inputs, expected, atol, rtol) -> None:
    from . import materialize

    with torch.no_grad():
        got = materialize(prog)(*example_inputs)
    want = [t for t in _flatten_out(expected) if isinstance(t, torch.Tensor)]
    got = list(got) if isinstance(got, tuple) else [got]
    if len(got) != len(want):
        raise TraceError(f"the traced program has {len(got)} outputs, the module {len(want)}")
    for k, (g, w) in enumerate(zip(got, want)):
        if g.shape != w.shape or not torch.allclose(g.float(), w.float(), atol=atol, rtol=rtol):
            diff = (g.float() - w.float()).abs().max().item() if g.shape == w.shape else "shape"
            raise TraceError(f"output {k}: the traced program disagrees with the module (max abs diff {diff}); "
                             "a registered converter does not match its module")


def _flatten_out(x):
    if hasattr(x, "to_tuple"):
        x = x.to_tuple()
    yield from _flatten(x)
