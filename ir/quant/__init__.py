"""Number formats (FP8 E4M3, NVFP4) and quantization recipes: data the IR records on its nodes, so they
live below the backends that read them and the passes that write them."""
from .formats import FP8Tensor, NVFP4Tensor, QuantError, fake_quantize, quantize_fp8, quantize_nvfp4
from .recipe import FORMATS, RECIPES, Recipe, Rule, get_recipe

__all__ = ["FORMATS", "FP8Tensor", "NVFP4Tensor", "QuantError", "RECIPES", "Recipe", "Rule", "fake_quantize",
           "get_recipe", "quantize_fp8", "quantize_nvfp4"]
