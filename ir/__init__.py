"""The IR: Programs of block-level nodes, their weights, checkpoints, tracing, printing and verifying."""
from .checkpoint import assemble, load, meta_weights, save
from .ops import OPS, OpSpec
from .printer import format_params, print_program
from .program import Node, Program
from .verifier import problems, verify
from .weights import WeightStore


def trace(module, example_inputs, check: bool = True, **kw) -> Program:
    """Traces a torch module into a Program via torch.export (see ir.tracing)."""
    from .tracing import trace as _trace

    return _trace(module, example_inputs, check=check, **kw)


def register_module(cls, converter=None):
    """Maps a module class to an op for tracing (see ir.tracing.register_module)."""
    from .tracing import register_module as _reg

    return _reg(cls, converter)


__all__ = [
    "OPS",
    "Node",
    "OpSpec",
    "Program",
    "WeightStore",
    "assemble",
    "format_params",
    "load",
    "meta_weights",
    "print_program",
    "problems",
    "register_module",
    "save",
    "trace",
    "verify",
]
