"""Quantization recipes: ordered rules over node paths and parameter names; deny-all first, last match wins."""
from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatch

from .formats import QUANT_FORMATS as FORMATS  # noqa: F401  (format -> (weights, activations))
from .formats import QuantError


@dataclass(frozen=True)
class Rule:
    path: str  # glob over node paths ("backbone.layers.*", "mtp")
    param: str  # glob over parameter names within the node ("mixer.experts.*.weight")
    format: str  # a key of FORMATS, or "none"

    def matches(self, path: str, param: str) -> bool:
        return fnmatch(path, self.path) and fnmatch(param, self.param)


@dataclass(frozen=True)
class Recipe:
    name: str
    rules: tuple[Rule, ...]

    def format_of(self, path: str, param: str) -> str:
        fmt = "none"
        for r in self.rules:
            if r.matches(path, param):
                fmt = r.format
        return fmt

    def assign(self, prog) -> dict[str, dict[str, str]]:
        """node path -> {parameter: format} for every quantised 2-D weight (MTP blocks included)."""
        out: dict[str, dict[str, str]] = {}
        for n in prog.nodes:
            done = dict(n.op.quant)
            for local, shape in n.op.params().items():
                fmt = self.format_of(n.path, local)
                if fmt != "none" and len(shape) == 2 and local not in done:  # already quantized: left as is
                    out.setdefault(n.path, {})[local] = fmt
        return out

    def check_target(self, target) -> None:
        """Refuses W4A4 NVFP4 on GPUs without FP4 tensor cores (Hopper)."""
        if target is None:
            return
        w4a4 = [r for r in self.rules if r.format == "nvfp4"]
        if w4a4 and not target.supports("nvfp4"):
            raise QuantError(f"recipe {self.name!r} runs NVFP4 activations (W4A4), which {target.name} cannot: "
                             "it has no FP4 tensor cores. Use the `fp8` recipe, or weight-only NVFP4 "
                             "(format `nvfp4-weight`, e.g. recipe `nvfp4-weight`) on this GPU")


def _rules(*triples) -> tuple[Rule, ...]:
    return (Rule("*", "*", "none"),) + tuple(Rule(*t) for t in triples)


_LINEARS = ("mixer.*_proj.weight", "mixer.experts.*.weight", "mixer.shared_experts.*.weight", "mixer.linear.weight")
RECIPES = {
    "bf16": Recipe("bf16", _rules()),  # nothing quantised
    "fp8": Recipe("fp8", _rules(*(("backbone.layers.*", p, "fp8") for p in _LINEARS))),
    "nvfp4": Recipe("nvfp4", _rules(*(("backbone.layers.*", p, "nvfp4") for p in _LINEARS))),
    "nvfp4-weight": Recipe("nvfp4-weight", _rules(*(("backbone.layers.*", p, "nvfp4-weight") for p in _LINEARS))),
    # the public Nemotron-3-Super recipe: routed experts NVFP4 W4A4; shared experts and Mamba in/out
    # projections FP8; attention, latent projections, conv1d, router, embeddings, LM head, MTP head BF16
    "nvfp4-hybrid": Recipe("nvfp4-hybrid", _rules(
        ("backbone.layers.*", "mixer.experts.*.weight", "nvfp4"),
        ("backbone.layers.*", "mixer.shared_experts.*.weight", "fp8"),
        ("backbone.layers.*", "mixer.in_proj.weight", "fp8"),
        ("backbone.layers.*", "mixer.out_proj.weight", "fp8"),
    )),
}


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise QuantError(f"unknown recipe {name!r}; built-in: {', '.join(RECIPES)}")
    return RECIPES[name]
