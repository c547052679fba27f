"""Quantising a checkpoint on disk, one tensor at a time, so that models larger than memory fit."""
from __future__ import annotations

import math
from pathlib import Path

from ... import ir
from ...ir.weights import Deferred
from .calibrate import input_scale, quantize_weight
from ...ir.quant.formats import QuantError
from ...ir.quant.recipe import FORMATS, get_recipe


def _stored_bytes(shape, fmt: str) -> int:
    n = math.prod(shape)
    return n // 2 + n // 16 + 4 if fmt.startswith("nvfp4") else n + 4


def quantize_checkpoint(src, dst, recipe: str = "fp8", calib: str = "amax", act_amax: dict | None = None,
                        max_shard_bytes: int | None = None, overwrite: bool = False, extended: bool = False) -> Path:
    """Reads `src` lazily, quantises each weight when its shard is written, writes `dst` atomically.

    Peak memory is about one output shard plus one source tensor; shards default to the size of the
    largest tensor. Recipes with activation formats need `act_amax` ({module path: amax}, e.g. from
    calibrate.ActivationAmax on a machine that can run the model); weight-only recipes do not. `extended`
    writes puzzlekit's extended form (see `ir.save`).
    """
    prog = ir.load(src)
    rec = get_recipe(recipe)
    plan = rec.assign(prog)
    source = prog.weights
    out = prog.copy()
    for path, params in plan.items():
        node = out.node(path)
        new = {}
        for local, fmt in params.items():
            full, wfmt, act = f"{path}.{local}", FORMATS[fmt][0], FORMATS[fmt][1]
            shape = source.shape(full)
            new[local] = Deferred(lambda full=full, wfmt=wfmt: quantize_weight(source.get(full), wfmt, calib, name=full),
                                  tuple(shape), source.dtype(full), wfmt, _stored_bytes(shape, wfmt))
            if act:
                module = f"{path}.{local.rsplit('.', 1)[0]}"
                if act_amax is None or module not in act_amax:
                    raise QuantError(f"recipe {recipe!r} quantises the inputs of {module}: pass its activation amax "
                                     "(act_amax), or use a weight-only format such as nvfp4-weight / fp8-weight")
                new[f"{local.rsplit('.', 1)[0]}.input_scale"] = input_scale(act_amax[module], act)
        out.rewrite(node, op=node.op.replace(quant=dict(node.op.quant) | params), weights=new)
    largest = max(source.nbytes(n) for n in source.names())
    return ir.save(out, dst, max_shard_bytes=max_shard_bytes or largest, overwrite=overwrite, extended=extended)

