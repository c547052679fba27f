"""Storage precisions: bytes per element of each format, and a parameter's format by recipe or program.

Apart because the scenarios (their dtypes), the providers and the cost model all read these tables.
"""
from __future__ import annotations

from fnmatch import fnmatch

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


#: (recipe, op, path signature) -> per parameter its precision, shared by every cost model of the recipe
_PRECISIONS: dict = {}
#: (recipe, op, path signature) -> a number standing for its precision table (`RecipePrecisions.token`)
_TOKENS: dict = {}


class RecipePrecisions:
    """Every parameter's storage precision under one recipe, looked up by which of the recipe's path patterns a
    node's path matches: paths that match the same ones get the same precisions. Shared by every cost model of
    the recipe (a 512-expert MoE has a thousand parameters, and a search prices its variants on every layout)."""

    def __init__(self, recipe: str = ""):
        self.recipe = recipe
        self._globs = [r.path for r in get_recipe(recipe).rules] if recipe else []
        self._signatures: dict = {}  # path -> which recipe patterns it matches
        self._formats: dict = {}  # (path, parameter) -> its format

    def signature(self, path: str) -> tuple:
        """Which of the recipe's path patterns `path` matches."""
        sig = self._signatures.get(path)
        if sig is None:
            sig = self._signatures[path] = tuple(fnmatch(path, glob) for glob in self._globs)
        return sig

    def of(self, path: str, op) -> dict:
        """Per parameter of the node at `path` its storage precision."""
        key = (self.recipe, op, self.signature(path))
        if key not in _PRECISIONS:
            if len(_PRECISIONS) > 1 << 16:
                _PRECISIONS.clear()
            if op.kind == "lm_head" and op.tied:
                _PRECISIONS[key] = {"weight": "bf16"}
            else:
                fp32 = op.fp32_params()
                _PRECISIONS[key] = {k: "fp32" if k in fp32 else self._format(path, k, op) for k in op.params()}
        return _PRECISIONS[key]

    def token(self, path: str, op) -> int:
        """A number standing for `of(path, op)` in memo keys: hashing a 512-expert MoE's thousand entries at
        every price would be most of what a search spends."""
        return _TOKENS.setdefault((self.recipe, op, self.signature(path)), len(_TOKENS))

    def _format(self, path: str, param: str, op) -> str:
        if not self.recipe:
            return precision_of(path, param, op)
        key = (path, param)
        if key not in self._formats:
            self._formats[key] = precision_of(path, param, op, self.recipe)
        return self._formats[key]


def weights_label(prog, recipe: str | None) -> str:
    """The weight formats a model is priced in, as `cost` states them: the recipe's where one is named, else the
    formats the checkpoint declares (its quantization config), else bf16."""
    stored = sorted({fmt for n in prog.nodes for _, fmt in n.op.quant if fmt != "none"})
    if recipe:
        return recipe + (f" (--recipe; the checkpoint stores {'+'.join(stored)})" if stored else "")
    return f"{'+'.join(stored)} as the checkpoint declares them (bf16 elsewhere)" if stored else "bf16"
