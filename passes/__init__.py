"""Passes over Programs: the pass API, textual pipelines, the manager, and the built-in passes."""
from .core import ANALYSES, PASSES, Analysis, AnalysisManager, Pass, PassError, Preserved, analysis, register
from .manager import Instrumentation, PassManager, progress
from .pipeline import PipelineSyntaxError, parse_pipeline, print_pipeline, resolve_pipeline
from . import builtin  # noqa: F401,E402  (registers the built-in passes)

__all__ = ["Pass", "Preserved", "register", "PASSES", "Analysis", "analysis", "ANALYSES", "AnalysisManager",
           "PassManager", "Instrumentation", "progress", "PassError", "PipelineSyntaxError", "parse_pipeline",
           "print_pipeline", "resolve_pipeline"]
