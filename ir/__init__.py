"""The IR: Programs of block-level nodes, their weights, number formats, checkpoints, printing and verifying."""
from .checkpoint import assemble, load, meta_weights, save
from .ops import OPS, OpSpec
from .printer import format_params, print_program
from .program import Node, Program
from .verifier import problems, verify
from .weights import WeightStore

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
    "save",
    "verify",
]
