"""puzzlekit: a compiler for hybrid Mamba / MoE / attention language models."""
from . import ir
from .errors import CheckpointError, PuzzlekitError, RewriteError, TraceError, VerifyError

__version__ = "0.1.0"
__all__ = ["CheckpointError", "PuzzlekitError", "RewriteError", "TraceError", "VerifyError", "ir"]
