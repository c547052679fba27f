"""A program's identity: one hash of its text and every tensor, which stages, libraries, distillation runs and
caches compare to know they hold the same model."""
from __future__ import annotations

import hashlib

import torch

from .printer import print_program
from .program import Program


def program_hash(prog: Program) -> str:
    """sha256 of the program text and every tensor's dtype, shape and bytes (the text alone for meta weights)."""
    h = hashlib.sha256(print_program(prog).encode())
    w = prog.weights
    for name in sorted(w.names()):
        if w.is_meta(name):
            continue
        t = w.get(name)
        t = t if isinstance(t, torch.Tensor) else t.dequantize()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
