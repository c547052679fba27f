"""The base errors of puzzlekit: each says what is wrong, where, and how to fix it. Modules add their own
subclasses of PuzzlekitError (DataError, PassError, QuantError, ExportError)."""
from pathlib import Path


class PuzzlekitError(Exception):
    """Base of every error puzzlekit raises on purpose."""


class UsageError(PuzzlekitError):
    """A command was asked for something it cannot do as given (exit code 2)."""


class CheckpointError(PuzzlekitError):
    """A checkpoint or config cannot be read, or does not match its config."""


class VerifyError(PuzzlekitError):
    """A Program breaks an invariant (names the node and the attribute)."""


class RewriteError(PuzzlekitError):
    """A rewrite would leave a node's spec and weights disagreeing."""


class TraceError(PuzzlekitError):
    """A module could not be traced into a Program, or the Program disagrees with it."""


def read_text(path, what: str, error: type[PuzzlekitError] = PuzzlekitError) -> str:
    """A user's text file (a pipeline, a target, a grid) as text, or `error` naming the file and why not."""
    try:
        return Path(path).read_bytes().decode("utf-8")
    except OSError as e:
        raise error(f"cannot read the {what} {path} ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise error(f"the {what} {path} is not UTF-8 text (byte {e.start})") from None
