"""Quantization: FP8 and NVFP4 formats, calibration, recipes, the `quantize` pass and checkpoint export."""
from __future__ import annotations

import enum
import sys
from dataclasses import field
from typing import ClassVar

from ...text.data import calibration_windows
from ..core import ComputePass, PassError, Preserved, pipeline_data, register
from ..manager import progress
from .calibrate import ActivationAmax, input_scale, quantize_weight, quantize_weights
from .export import quantize_checkpoint
from ...ir.quant.formats import FP8Tensor, NVFP4Tensor, QuantError, fake_quantize, quantize_fp8, quantize_nvfp4
from ...ir.quant.recipe import FORMATS, RECIPES, Recipe, Rule, get_recipe

__all__ = [
    "calibration_windows",
    "FORMATS",
    "RECIPES",
    "FP8Tensor",
    "NVFP4Tensor",
    "QuantError",
    "Quantize",
    "Recipe",
    "Rule",
    "fake_quantize",
    "get_recipe",
    "quantize_checkpoint",
    "quantize_fp8",
    "quantize_nvfp4",
    "quantize_weight",
]


class Calib(enum.Enum):
    amax = "amax"
    mse = "mse"


@register("quantize")
class Quantize(ComputePass):
    """Quantise weights (and calibrate static activation scales) by a recipe; report KL to the original."""

    recipe: str = "fp8"
    calib: Calib = Calib.amax
    samples: int = 16  # calibration windows (of `seq` tokens each: 2,048 tokens by default)
    seq: int = 128  # tokens per window
    target: str = ""  # refuse a recipe this GPU cannot run (e.g. W4A4 NVFP4 on h100)
    data: list[str] = field(default_factory=list)  # calibration text (default: the Python stdlib)
    minimum: ClassVar[dict] = {"samples": 1, "seq": 1}  # samples=0 once meant "every window": refused now

    def run(self, prog, am):
        from ...backends.targets import get_target
        from ...backends.torch.stream import StreamedProgram
        from ...evaluation import teacher_agreement

        recipe = get_recipe(self.recipe)
        recipe.check_target(get_target(self.target) if self.target else None)
        plan = recipe.assign(prog)
        if not plan:
            return Preserved.all()
        if prog.is_meta:
            raise PassError("quantize needs real weights; this program has meta tensors only")
        windows = calibration_windows(pipeline_data(self.data, am), self.samples, self.seq, prog)
        compute = self.compute(am)  # calibration and the report's KL, layer by layer within the memory budget
        teacher = StreamedProgram(prog.copy(), compute)  # the weights as they were (shared, not copied)
        act_modules = [f"{path}.{local.rsplit('.', 1)[0]}" for path, params in plan.items()
                       for local, fmt in params.items() if FORMATS[fmt][1]]
        calib = ActivationAmax(act_modules) if act_modules else None
        # one run of the original: its activations calibrated, its final hidden states kept for the report (the
        # logits are built from them a chunk of tokens at a time; the recipes never quantise the LM head)
        original = teacher.record(windows, 4, prog.outputs[:1], attach=calib.attach if calib else None,
                                  project=False)
        teacher.release()  # the original is not run again: its kept layers give their room to the new weights
        amax = calib.amax if calib else {}
        for path, params in progress(plan.items(), am, "quantize", total=len(plan)):  # a bar, or lines in a log
            node = prog.node(path)
            new = {}
            by_format: dict = {}  # a layer's experts read in one go and quantised as one batch
            for local, fmt in params.items():
                by_format.setdefault(FORMATS[fmt][0], []).append(local)
            for wfmt, locals_ in by_format.items():
                names = [f"{path}.{local}" for local in locals_]
                new.update(zip(locals_, quantize_weights(prog.weights.get_many(names), wfmt, self.calib.value,
                                                         names)))
            for local, fmt in params.items():
                act = FORMATS[fmt][1]
                if act:
                    module = f"{path}.{local.rsplit('.', 1)[0]}"
                    new[f"{local.rsplit('.', 1)[0]}.input_scale"] = input_scale(amax[module], act)
            prog.rewrite(node, op=node.op.replace(quant=dict(node.op.quant) | params), weights=new)
            prog.weights.spill_over(compute.budget // 4)  # past a quarter of the budget, to scratch files
        report = {"recipe": self.recipe, "calib": self.calib.value, "weights": sum(len(p) for p in plan.values()),
                  **teacher_agreement(original, StreamedProgram(prog, compute), windows, batch=4)}
        am.reports["quantize"] = report
        print(f"quantize{{recipe={self.recipe}}}: {report['weights']} weights; KL to the original "
              f"{report['kl']:.5f} nats/token, top-1 agreement {report['top1_agreement']:.4f}", file=sys.stderr)
        return Preserved.none()
