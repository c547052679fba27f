"""The base errors of puzzlekit: each says what is wrong, where, and how to fix it. Modules add their own
subclasses of PuzzlekitError (DataError, PassError, QuantError, ExportError)."""


class PuzzlekitError(Exception):
    """Base of every error puzzlekit raises on purpose."""


class CheckpointError(PuzzlekitError):
    """A checkpoint or config cannot be read, or does not match its config."""


class VerifyError(PuzzlekitError):
    """A Program breaks an invariant (names the node and the attribute)."""


class RewriteError(PuzzlekitError):
    """A rewrite would leave a node's spec and weights disagreeing."""


class TraceError(PuzzlekitError):
    """A module could not be traced into a Program, or the Program disagrees with it."""
