"""puzzlekit: a compiler for hybrid Mamba / MoE / attention language models."""
from . import ir
from .errors import CheckpointError, PuzzlekitError, RewriteError, TraceError, VerifyError

__version__ = "0.1.0"
__all__ = ["CheckpointError", "PuzzlekitError", "RewriteError", "TraceError", "VerifyError", "ir", "register_module",
           "trace"]


def trace(module, example_inputs, check: bool = True, **kw):
    """Traces a torch module into a checked Program via torch.export (see backends.torch.tracing)."""
    from .backends.torch.tracing import trace as _trace

    return _trace(module, example_inputs, check=check, **kw)


def register_module(cls, converter=None):
    """Maps a module class to an op for tracing (see backends.torch.tracing.register_module)."""
    from .backends.torch.tracing import register_module as _register

    return _register(cls, converter)
