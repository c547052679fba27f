"""Corpora of token ids in the model's own tokenization: the Python standard library's source, or the user's
documents (see documents.py for the formats), split into training text and held-out text by document.

A subword tokenizer's documents are tokenized once (the fast tokenizer's batch path, with progress), joined as
BOS (where the tokenizer adds one) + text + EOS, and cached on disk by a content hash of the data and the
tokenizer, so a second run does not tokenize again. The byte codec's documents are their UTF-8 bytes joined by
a blank line, as the built-in model was trained on."""
from __future__ import annotations

import hashlib
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .documents import TEXT_SUFFIXES, DataError, fingerprint, read_documents
from .outputs import atomic_file, cache_dir
from .tokenizer import BYTES

__all__ = ["HELD_OUT", "TEXT_SUFFIXES", "Corpus", "DataError", "corpus_for", "held_out_windows", "is_validation",
           "load_corpus", "calibration_windows", "random_windows", "sequential_windows", "stdlib_corpus", "stdlib_files"]

#: the three disjoint parts of the held-out text, each for one use, so that no figure is measured on data the
#: step it judges was chosen on: `scoring` the library's replace-one-block scores (the search minimises them),
#: `selection` distillation's keep-best evaluations, `report` every figure reported (compress's report, `eval`,
#: `mtp-check`, the benchmarks)
HELD_OUT = ("scoring", "selection", "report")
#: a corpus of a subword tokenizer keeps at least this many held-out documents (one per held-out set)
MIN_HELD_OUT_DOCS = len(HELD_OUT)
#: what joins the byte codec's documents
SEPARATOR = BYTES.separator.tobytes()
#: documents tokenized per call of the fast tokenizer's batch path
TOKENIZE_BATCH = 512
#: bump when the tokenized form changes: old cache entries are then not read
CACHE_FORMAT = 1


def stdlib_files() -> list[Path]:
    """The running interpreter's standard library sources, sorted (no site-packages)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())


def is_validation(name: str, every: int = 20) -> bool:
    """Deterministic split by document name: about one document in `every` is held out."""
    return int(hashlib.sha1(name.encode()).hexdigest(), 16) % every == 0


@dataclass
class Corpus:
    """The training and held-out token streams; `starts` are the held-out documents' first positions (None for
    the byte codec, whose held-out sets are cut at blank lines as they always were)."""

    train: np.ndarray
    valid: np.ndarray
    starts: np.ndarray | None = None
    tokenizer: object = BYTES

    @property
    def token_bytes(self) -> np.ndarray:
        """UTF-8 bytes per token id (for bits per byte)."""
        return self.tokenizer.token_bytes

    def held_out(self, role: str) -> np.ndarray:
        """The `role` third of the held-out stream (see HELD_OUT): consecutive, disjoint parts, each cut at the
        first document start past its third (the byte codec: the first blank line, where there is one)."""
        if role not in HELD_OUT:
            raise DataError(f"unknown held-out set {role!r}; known: {', '.join(HELD_OUT)}")
        n = len(self.valid)
        if self.starts is None:
            inner = [_blank_line_after(self.valid, n * k // 3) for k in (1, 2)]
        else:
            inner = [int(self.starts[i]) if (i := np.searchsorted(self.starts, n * k // 3)) < len(self.starts) else n
                     for k in (1, 2)]
        cuts = [0, *inner, n]
        i = HELD_OUT.index(role)
        return self.valid[cuts[i]:cuts[i + 1]]


def _blank_line_after(stream: np.ndarray, at: int) -> int:
    """The end of the first blank line ("\\n\\n") at or after byte `at` (`at` itself when none follows)."""
    sep = BYTES.separator
    starts = np.flatnonzero((stream[at:len(stream) - 1] == sep[0]) & (stream[at + 1:] == sep[1]))
    return at + int(starts[0]) + len(sep) if len(starts) else at


def _stdlib_documents(limit_bytes: int | None):
    root, size = Path(sysconfig.get_paths()["stdlib"]), 0
    for f in stdlib_files():
        data = f.read_bytes()
        yield f.relative_to(root).as_posix(), data.decode("utf-8", errors="surrogateescape")
        size += len(data)
        if limit_bytes and size >= limit_bytes:
            return


def _documents(paths: list[str], tokenizer, limit_bytes: int | None) -> list[tuple[str, str]]:
    if not paths:
        return list(_stdlib_documents(limit_bytes))
    docs = []
    for p in paths:
        try:
            docs += read_documents(p, tokenizer.render_chat)
        except OSError as e:  # unreadable file or directory
            raise DataError(f"cannot read {e.filename or p}: {e.strerror or e}") from None
    if not docs:
        raise DataError(f"no text found in {[str(p) for p in paths]} (suffixes read: {sorted(TEXT_SUFFIXES)})")
    return docs


def _byte_corpus(docs: list[tuple[str, str]]) -> Corpus:
    """Bytes joined by a blank line; with too few documents for both splits, the stream's last twentieth is
    held out."""
    parts = {True: [], False: []}
    for name, text in docs:
        parts[is_validation(name)].append(BYTES.encode(text).tobytes())

    def join(blobs):
        return np.frombuffer(BYTES.separator.tobytes().join(blobs), dtype=np.uint8).copy()

    if not parts[True] or not parts[False]:
        joined = join(parts[False] + parts[True])
        cut = max(1, len(joined) // 20)
        return Corpus(joined[:-cut], joined[-cut:])
    return Corpus(join(parts[False]), join(parts[True]))


def _tokenized(docs: list[tuple[str, str]], tok, progress: bool) -> Corpus:
    """Each document as BOS + text + EOS; held out by document (at least one per held-out set)."""
    from tqdm import tqdm

    held = [is_validation(name) for name, _ in docs]
    if sum(held) < MIN_HELD_OUT_DOCS <= len(docs) - MIN_HELD_OUT_DOCS:
        ranked = sorted((i for i, h in enumerate(held) if not h),
                        key=lambda i: hashlib.sha1(docs[i][0].encode()).digest())
        for i in ranked[:MIN_HELD_OUT_DOCS - sum(held)]:
            held[i] = True
    streams = {True: [], False: []}
    bar = tqdm(total=len(docs), desc="tokenize", unit="doc", disable=not progress)
    for at in range(0, len(docs), TOKENIZE_BATCH):
        chunk = docs[at:at + TOKENIZE_BATCH]
        for (_, text), ids, h in zip(chunk, tok.encode_batch([t for _, t in chunk]), held[at:]):
            streams[h].append(np.asarray(tok.document(ids, text), dtype=np.int32))
        bar.update(len(chunk))
    bar.close()
    if not streams[True] or not streams[False]:  # too few documents to hold whole ones out: the stream's tail
        joined = np.concatenate(streams[False] + streams[True])
        cut = max(3, len(joined) // 20)
        return Corpus(joined[:-cut], joined[-cut:], np.array([0, cut // 3, 2 * cut // 3]), tok)
    lengths = np.array([len(s) for s in streams[True]])
    return Corpus(np.concatenate(streams[False]), np.concatenate(streams[True]),
                  np.concatenate([[0], np.cumsum(lengths)[:-1]]), tok)


def _cache_key(paths: list[str], tok, limit_bytes: int | None) -> str:
    data = fingerprint(paths) if paths else f"stdlib {sys.version} {sysconfig.get_paths()['stdlib']} {limit_bytes}"
    return hashlib.sha256(f"{CACHE_FORMAT}|{data}|{tok.identity}".encode()).hexdigest()[:40]


def _cached(key: str, make) -> Corpus:
    from safetensors.numpy import load_file, save_file

    f = cache_dir("tokens") / f"{key}.safetensors"
    if f.exists():
        try:
            t = load_file(str(f))
            return Corpus(t["train"], t["valid"], t["starts"])
        except Exception:  # a damaged entry is made again
            pass
    c = make()
    f.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(f) as tmp:
        save_file({"train": c.train, "valid": c.valid, "starts": c.starts.astype(np.int64)}, str(tmp))
    return c


_CORPORA: dict[tuple, Corpus] = {}


def load_corpus(paths: list[str] | None = None, limit_bytes: int | None = None, tokenizer=BYTES,
                progress: bool | None = None) -> Corpus:
    """The corpus of `paths` (default: the standard library, up to `limit_bytes` of it) in `tokenizer`'s ids,
    made once per process (and, for a subword tokenizer, once per machine: see the module's docstring). A
    progress bar while tokenizing: `progress`, or by default when stderr is a terminal."""
    progress = sys.stderr.isatty() if progress is None else progress
    paths = [str(p) for p in paths or []]
    key = (tokenizer.identity, fingerprint(paths) if paths else None, limit_bytes)
    if key not in _CORPORA:
        if tokenizer is BYTES:
            _CORPORA[key] = _byte_corpus(_documents(paths, tokenizer, limit_bytes))
        else:
            made = _cached(_cache_key(paths, tokenizer, limit_bytes),
                           lambda: _tokenized(_documents(paths, tokenizer, limit_bytes), tokenizer, progress))
            made.tokenizer = tokenizer
            _CORPORA[key] = made
    return _CORPORA[key]


def stdlib_corpus(limit_bytes: int | None = None) -> Corpus:
    """The standard library as a byte-level corpus, split by file path (relative to the stdlib root)."""
    return load_corpus(None, limit_bytes)


def corpus_for(prog, paths: list[str] | None = None, progress: bool | None = None) -> Corpus:
    """`load_corpus` in the program's own tokenization (tokenizer.tokenizer_of: refused for a subword model
    without a tokenizer, before any text is read)."""
    from .tokenizer import tokenizer_of

    return load_corpus(paths, tokenizer=tokenizer_of(prog), progress=progress)


def calibration_windows(data: list[str] | None, samples: int, seq: int, prog) -> torch.Tensor:
    """`samples` consecutive windows of `seq` tokens, in the program's own tokenization, from the training split
    (evaluation scores the held-out split): what importance, the library's BLD, quantization and the KV cache
    calibrate on."""
    return sequential_windows(corpus_for(prog, data or None).train, seq, limit=samples)


def random_windows(stream: np.ndarray, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """`batch` random windows of `length` tokens as int64 token ids [batch, length]."""
    if batch < 1 or length < 1:
        raise DataError(f"windows need batch >= 1 and length >= 1 (got batch {batch}, length {length})")
    if len(stream) <= length:
        raise DataError(f"the text ({len(stream)} tokens) is shorter than one window of {length} tokens")
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
        raise DataError(f"the held-out text ({len(stream)} tokens) is shorter than one window of {length} tokens; "
                        "give more text or a shorter window")
    return torch.from_numpy(stream[: n * length].astype(np.int64).reshape(n, length))
