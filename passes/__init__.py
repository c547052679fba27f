"""Passes over Programs: the pass API, textual pipelines, the manager, and the built-in passes."""
from . import builtin, distill, mtp, puzzle, quant  # noqa: F401  (register the built-in passes)
from .core import (ANALYSES, PASSES, Analysis, AnalysisManager, ComputePass, Pass, PassError, Preserved, analysis,
                   register)
from .manager import Instrumentation, PassManager, progress
from .pipeline import PipelineSyntaxError, parse_pipeline, print_pipeline, resolve_pipeline

__all__ = [
           "ANALYSES",
           "PASSES",
           "Analysis",
           "AnalysisManager",
           "ComputePass",
           "Instrumentation",
           "Pass",
           "PassError",
           "PassManager",
           "PipelineSyntaxError",
           "Preserved",
           "analysis",
           "parse_pipeline",
           "print_pipeline",
           "progress",
           "register",
           "resolve_pipeline",
]
