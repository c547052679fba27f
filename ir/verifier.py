"""The verifier: structural and numeric invariants a Program must keep between passes."""
from __future__ import annotations

import torch

from ..errors import VerifyError
from .ops.base import QUANT_FORMATS
from .program import Program


def problems(prog: Program, check_finite: bool = False) -> list[str]:
    """Every broken invariant, each naming the node (value, path, op) and the attribute."""
    out: list[str] = []
    defined = set(prog.inputs)
    paths: set[str] = set()
    embeds, heads = prog.find("embed"), prog.find("lm_head")
    hidden = embeds[0].op.hidden if embeds else None
    vocab = embeds[0].op.vocab if embeds else None

    for n in prog.nodes:
        where = f"node %{n.name} ({n.path}, {n.op.kind})"
        out += [f"{where}: attribute {attr}: {msg}" for attr, msg in n.op.check()]
        if len(n.args) != len(n.op.inputs):
            out.append(f"{where}: takes {len(n.op.inputs)} inputs {list(n.op.inputs)}, got {len(n.args)}")
        out += [f"{where}: input %{a} is not defined before it" for a in n.args if a not in defined]
        for a, role in zip(n.args, n.op.inputs):
            if (role == "ids") != (a in prog.inputs) and a in defined:
                want = "a program input (token ids)" if role == "ids" else "a hidden state, not a program input"
                out.append(f"{where}: input %{a} is in the {role!r} position and must be {want}")
        if n.name in defined:
            out.append(f"{where}: value %{n.name} is defined twice")
        if n.path in paths:
            out.append(f"{where}: path {n.path!r} is used by another node")
        defined.add(n.name)
        paths.add(n.path)
        if hidden is not None and hasattr(n.op, "hidden") and n.op.hidden != hidden:
            out.append(f"{where}: attribute hidden: {n.op.hidden} differs from the embedding's hidden {hidden}")
        if n.op.kind == "lm_head" and vocab is not None and n.op.vocab != vocab:
            out.append(f"{where}: attribute vocab: {n.op.vocab} differs from the embedding's vocab {vocab}")
        if n.op.kind == "lm_head" and n.op.tied and not embeds:
            out.append(f"{where}: attribute tied: a tied LM head needs an embed node")
        if n.op.kind == "mtp" and (len(embeds) != 1 or len(heads) != 1):
            out.append(f"{where}: the MTP head shares the embedding and LM head: needs exactly one of each")
    out += [f"output %{o} is not defined" for o in prog.outputs if o not in defined]
    out += _weight_problems(prog, check_finite)
    return out


def _weight_problems(prog: Program, check_finite: bool) -> list[str]:
    out, owned = [], set()
    w = prog.weights
    for n in prog.nodes:
        quant = dict(n.op.quant)
        for local, shape in n.op.stored_params().items():
            full = f"{n.path}.{local}"
            owned.add(full)
            want = QUANT_FORMATS[quant[local]][0] if quant.get(local) in QUANT_FORMATS else None
            if full in w and w.format(full) != want:
                out.append(f"node %{n.name} ({n.path}, {n.op.kind}): weight {local!r} is stored as "
                           f"{w.format(full) or 'unquantised'} but the spec's quant says {want or 'unquantised'}")
            elif full not in w:
                out.append(f"node %{n.name} ({n.path}, {n.op.kind}): weight {local!r} is missing")
            elif tuple(w.shape(full)) != tuple(shape):
                out.append(f"node %{n.name} ({n.path}, {n.op.kind}): weight {local!r} has shape "
                           f"{list(w.shape(full))}, the spec implies {list(shape)}")
            elif not (w.dtype(full).is_floating_point or n.op.kind == "opaque"):
                out.append(f"node %{n.name} ({n.path}, {n.op.kind}): weight {local!r} has dtype "
                           f"{str(w.dtype(full)).replace('torch.', '')}; a floating-point type is needed")
            elif check_finite and not w.is_meta(full) and w.dtype(full).is_floating_point:
                t = w.get(full)
                t = t.dequantize() if w.is_quantized(full) else t
                if not bool(torch.isfinite(t.float() if t.dtype.itemsize == 1 else t).all()):
                    out.append(f"node %{n.name} ({n.path}, {n.op.kind}): weight {local!r} has NaN or inf values")
    out += [f"weight {k!r} belongs to no node" for k in sorted(set(w.names()) - owned)]
    return out


def verify(prog: Program, check_finite: bool = False) -> Program:
    """Raises VerifyError listing every problem; returns the program when it is sound."""
    found = problems(prog, check_finite)
    if found:
        raise VerifyError(f"{len(found)} problem(s):\n  " + "\n  ".join(found))
    return prog
