"""Byte-level text corpora: the Python standard library's own source, or the user's files and JSONL."""
from __future__ import annotations

import hashlib
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .errors import PuzzlekitError

TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".json", ".jsonl", ".c", ".h", ".toml", ".cfg", ".ini", ".html"}
SEPARATOR = b"\n\n"


class DataError(PuzzlekitError):
    """Training or evaluation data cannot be read."""


def stdlib_files() -> list[Path]:
    """The running interpreter's standard library sources, sorted (no site-packages)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())


def is_validation(name: str, every: int = 20) -> bool:
    """Deterministic split by path: about one file in `every` is held out."""
    return int(hashlib.sha1(name.encode()).hexdigest(), 16) % every == 0


#: the three disjoint parts of the held-out text, each for one use, so that no figure is measured on data the
#: step it judges was chosen on: `scoring` the library's replace-one-block scores (the search minimises them),
#: `selection` distillation's keep-best evaluations, `report` every figure reported (compress's report, `eval`,
#: `mtp-check`, the benchmarks)
HELD_OUT = ("scoring", "selection", "report")


@dataclass
class Corpus:
    """One byte stream per split (documents joined by a blank line)."""

    train: np.ndarray  # uint8
    valid: np.ndarray

    def held_out(self, role: str) -> np.ndarray:
        """The `role` third of the held-out stream (see HELD_OUT): consecutive, disjoint parts, each cut at the
        first blank line past its third where there is one (documents are joined by one)."""
        if role not in HELD_OUT:
            raise DataError(f"unknown held-out set {role!r}; known: {', '.join(HELD_OUT)}")
        cuts = [0, *(_boundary(self.valid, len(self.valid) * k // 3) for k in (1, 2)), len(self.valid)]
        i = HELD_OUT.index(role)
        return self.valid[cuts[i]:cuts[i + 1]]


def _boundary(stream: np.ndarray, at: int) -> int:
    """The end of the first SEPARATOR at or after byte `at` (`at` itself when none follows)."""
    sep = np.frombuffer(SEPARATOR, dtype=np.uint8)
    starts = np.flatnonzero((stream[at:len(stream) - 1] == sep[0]) & (stream[at + 1:] == sep[1]))
    return at + int(starts[0]) + len(sep) if len(starts) else at


def _join(docs: list[bytes]) -> np.ndarray:
    return np.frombuffer(SEPARATOR.join(docs), dtype=np.uint8).copy()


def stdlib_corpus(limit_bytes: int | None = None) -> Corpus:
    """The standard library as a corpus; split by file path (relative to the stdlib root)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, valid, size = [], [], 0
    for f in stdlib_files():
        rel = f.relative_to(root).as_posix()
        data = f.read_bytes()
        (valid if is_validation(rel) else train).append(data)
        size += len(data)
        if limit_bytes and size >= limit_bytes:
            break
    return Corpus(_join(train), _join(valid))


def _documents(path: Path, name: str | None = None) -> list[tuple[str, bytes]]:
    """(name, bytes) per document; names are relative to the argument, so the split does not depend on
    how the path was spelled."""
    name = name or path.name
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        return [d for f in files for d in _documents(f, f.relative_to(path).as_posix())]
    if not path.exists():
        raise DataError(f"{path} does not exist; pass text files, directories or .jsonl files")
    if path.suffix == ".jsonl":
        docs = []
        try:
            text = path.read_text()
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text (byte {e.start})") from None
        for i, line in enumerate(text.splitlines()):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{i + 1}: not valid JSON ({e.msg})") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                raise DataError(f"{path}:{i + 1}: each JSONL record needs a string field \"text\"")
            docs.append((f"{name}:{i + 1}", rec["text"].encode()))
        return docs
    return [(name, path.read_bytes())]


def user_corpus(paths: list[str | Path]) -> Corpus:
    """The user's text files, directories (recursively, text suffixes) and JSONL ({"text": ...} per line)."""
    train, valid = [], []
    for p in paths:
        try:
            docs = _documents(Path(p))
        except OSError as e:  # unreadable file or directory
            raise DataError(f"cannot read {e.filename or p}: {e.strerror or e}") from None
        for name, data in docs:
            (valid if is_validation(name) else train).append(data)
    if not train and not valid:
        raise DataError(f"no text found in {[str(p) for p in paths]} (suffixes read: {sorted(TEXT_SUFFIXES)})")
    if not train or not valid:  # few documents: hold out the tail of the stream instead
        joined = _join(train + valid)
        cut = max(1, len(joined) // 20)
        return Corpus(joined[:-cut], joined[-cut:])
    return Corpus(_join(train), _join(valid))


def load_corpus(paths: list[str] | None = None, limit_bytes: int | None = None) -> Corpus:
    return user_corpus(paths) if paths else stdlib_corpus(limit_bytes)


def random_windows(stream: np.ndarray, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """`batch` random windows of `length` bytes as int64 token ids [batch, length]."""
    if batch < 1 or length < 1:
        raise DataError(f"windows need batch >= 1 and length >= 1 (got batch {batch}, length {length})")
    if len(stream) <= length:
        raise DataError(f"the text ({len(stream)} bytes) is shorter than one window of {length} bytes")
    starts = torch.randint(0, len(stream) - length, (batch,), generator=generator).numpy()
    return torch.from_numpy(np.stack([stream[s:s + length] for s in starts]).astype(np.int64))


def held_out_windows(corpus: Corpus, role: str, length: int, limit: int | None = None) -> torch.Tensor:
    """`sequential_windows` of one held-out set (`Corpus.held_out`), naming the set when it is too short."""
    try:
        return sequential_windows(corpus.held_out(role), length, limit)
    except DataError as e:
        raise DataError(f"the {role} set (a third of the held-out text): {e}") from None


def sequential_windows(stream: np.ndarray, length: int, limit: int | None = None) -> torch.Tensor:
    """Consecutive non-overlapping windows [n, length] covering the stream (up to `limit` windows; None: all).

    A limit below 1 is refused: 0 once silently meant "every window"."""
    if length < 1 or (limit is not None and limit < 1):
        raise DataError(f"windows need length >= 1 and a limit >= 1 or None (got length {length}, limit {limit})")
    n = len(stream) // length
    if limit is not None:
        n = min(n, limit)
    if n == 0:
        raise DataError(f"the held-out text ({len(stream)} bytes) is shorter than one window of {length} bytes; "
                        "give more text or a shorter window")
    return torch.from_numpy(stream[: n * length].astype(np.int64).reshape(n, length))
