"""Storage precisions: bytes per element of each format, and a parameter's format by recipe or program.

Apart because the scenarios (their dtypes), the providers and the cost model all read these tables.
"""
from __future__ import annotations

from ...ir.quant.recipe import get_recipe

BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "nvfp4": 0.5 + 1 / 16,  # NVFP4: E4M3 scale per 16
         "fp8-weight": 1.0, "nvfp4-weight": 0.5 + 1 / 16}

#: math precision of a weight format: weight-only formats compute in BF16
MATH = {"fp8-weight": "bf16", "nvfp4-weight": "bf16"}


def precision_of(path: str, param: str, op, recipe: str = "") -> str:
    """A parameter's storage precision: a recipe's format when one is named, else the program's own."""
    if param in op.fp32_params():
        return "fp32"
    if recipe:
        fmt = get_recipe(recipe).format_of(path, param)
    else:
        fmt = dict(op.quant).get(param, "none")
    return "bf16" if fmt == "none" else fmt
