"""Corpora of token ids in the model's own tokenization: the Python standard library's source, or the user's
documents (see documents.py for the formats), split into training text and three held-out sets by document.

Each document is tokenized once and joined as the model reads text: BOS (where the tokenizer adds one) + text +
EOS for a subword tokenizer (the fast tokenizer's batch path, with progress), UTF-8 bytes + a blank line for the
byte codec. A subword corpus is cached on disk under a key of everything that decides its tokens (the data's
content, the tokenizer, its chat template, the BOS/EOS rule, the document format and the split rule), so a second
run does not tokenize again and an edit to any of them makes it anew.

The split (`SPLIT_RULE`): about one document in HOLD_EVERY (by a hash of its name) is held out, and more (by the
same hash) while the held-out text is short, keeping at least half the tokens for training. The held-out
documents are dealt to the three sets by size, largest first, each to the set with the fewest tokens so far, so
the sets are disjoint by document and balanced by tokens. A corpus with too few documents for that (fewer than
four, or one document holding most of the text) is cut inside documents instead: its last tokens are held out,
in three equal parts, and a note says so once."""
from __future__ import annotations

import hashlib
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .documents import FORMAT as DOCUMENT_FORMAT
from .documents import TEXT_SUFFIXES, DataError, fingerprint, read_documents
from ..outputs import atomic_file, cache_dir
from .tokenizer import BYTES

__all__ = ["HELD_OUT", "TEXT_SUFFIXES", "Corpus", "DataError", "corpus_for", "covering_windows", "held_out_windows",
           "is_validation", "load_corpus", "calibration_windows", "random_windows", "require_windows",
           "sequential_windows", "stdlib_corpus", "stdlib_files"]

#: the three disjoint parts of the held-out text, each for one use, so that no figure is measured on data the
#: step it judges was chosen on: `scoring` the library's replace-one-block scores (the search minimises them),
#: `selection` distillation's keep-best evaluations, `report` every figure reported (compress's report,
#: `eval --held-out report`, `mtp-check`, the benchmarks)
HELD_OUT = ("scoring", "selection", "report")
#: about one document in this many is held out
HOLD_EVERY = 20
#: more documents are held out while a held-out set has fewer tokens than this (eight windows of 256), as long
#: as half the corpus stays for training
MIN_SET_TOKENS = 2048
#: names the rule above: part of the cache key, so a changed rule never reads an old split
SPLIT_RULE = f"by-document, dealt by size/every {HOLD_EVERY}/min set {MIN_SET_TOKENS}/v2"
#: what joins the byte codec's documents
SEPARATOR = BYTES.separator.tobytes()
#: documents tokenized per call of the fast tokenizer's batch path
TOKENIZE_BATCH = 512
#: bump when the stored form changes: old cache entries are then not read
CACHE_FORMAT = 2


def stdlib_files() -> list[Path]:
    """The running interpreter's standard library sources, sorted (no site-packages)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())


def _name_hash(name: str) -> int:
    return int(hashlib.sha1(name.encode()).hexdigest(), 16)


def is_validation(name: str, every: int = HOLD_EVERY) -> bool:
    """Deterministic split by document name: about one document in `every` is held out."""
    return _name_hash(name) % every == 0


@dataclass
class Corpus:
    """Token ids of every document: the training documents, then the scoring, selection and report sets (each in
    file order), `bounds` the end of each of those four parts. `lengths` are the stored documents' tokens and
    `order` their places in the files; `inside` when the held-out sets were cut inside documents."""

    tokens: np.ndarray
    bounds: np.ndarray
    lengths: np.ndarray
    order: np.ndarray
    tokenizer: object = BYTES
    inside: bool = False
    source: str = "the text"

    @property
    def train(self) -> np.ndarray:
        return self.tokens[:int(self.bounds[0])]

    @property
    def valid(self) -> np.ndarray:
        """The three held-out sets, one after another."""
        return self.tokens[int(self.bounds[0]):]

    @property
    def documents(self) -> int:
        return len(self.lengths)

    @property
    def token_bytes(self) -> np.ndarray:
        """UTF-8 bytes per token id (for bits per byte)."""
        return self.tokenizer.token_bytes

    def held_out(self, role: str) -> np.ndarray:
        """One held-out set (see HELD_OUT)."""
        if role not in HELD_OUT:
            raise DataError(f"unknown held-out set {role!r}; known: {', '.join(HELD_OUT)}")
        if self.inside and self.source not in _SAID:  # once per process, when a held-out set is first used
            _SAID.add(self.source)
            print(f"note: {self.source} has too few documents ({self.documents}) to hold whole ones out: the held-out "
                  f"sets are its last {len(self.valid):,} tokens, cut inside documents", file=sys.stderr)
        i = HELD_OUT.index(role)
        return self.tokens[int(self.bounds[i]):int(self.bounds[i + 1])]

    def set_documents(self, role: str, tokens: int | None = None) -> int:
        """How many documents the set holds (a part of one counts), or its first `tokens` tokens touch."""
        i = HELD_OUT.index(role)
        lo, hi = int(self.bounds[i]), int(self.bounds[i + 1])
        hi = hi if tokens is None else min(hi, lo + tokens)
        starts = np.concatenate([[0], np.cumsum(self.lengths)[:-1]])
        return int(((starts < hi) & (starts + self.lengths > lo)).sum())

    def in_file_order(self) -> tuple[np.ndarray, np.ndarray]:
        """Every document as the files hold them, one after another, and each one's tokens: what `eval --data`
        scores."""
        if self.inside:
            return self.tokens, self.lengths
        pieces = np.split(self.tokens, np.cumsum(self.lengths)[:-1])
        at = np.argsort(self.order, kind="stable")
        return np.concatenate([pieces[i] for i in at]), self.lengths[at]


def _deal(lengths: np.ndarray, chosen: list[int], rank: dict[int, int]) -> list[list[int]]:
    """The held-out documents dealt to the three sets by size: largest first, each to the set with the fewest
    tokens so far (the first three to the three empty sets)."""
    sets, sizes = [[], [], []], [0, 0, 0]
    for i in sorted(chosen, key=lambda i: (-int(lengths[i]), rank[i])):
        k = sizes.index(min(sizes))
        sets[k].append(i)
        sizes[k] += int(lengths[i])
    return sets


def split_documents(names: list[str], lengths: np.ndarray) -> list[list[int]] | None:
    """The documents of each held-out set (see the module's docstring), or None when there are too few
    documents to hold whole ones out."""
    n, total = len(names), int(lengths.sum())
    want_held = max(total // HOLD_EVERY, min(3 * MIN_SET_TOKENS, total // 4))
    want_set = min(MIN_SET_TOKENS, want_held // 3)
    order = sorted(range(n), key=lambda i: (_name_hash(names[i]), i))
    rank = {i: r for r, i in enumerate(order)}
    chosen = [i for i in order if is_validation(names[i])]
    spare = [i for i in order if not is_validation(names[i])]
    held = int(lengths[chosen].sum()) if chosen else 0
    while True:
        sets = _deal(lengths, chosen, rank)
        short = min(int(lengths[s].sum()) if s else 0 for s in sets) < want_set
        if len(chosen) >= 3 and held >= want_held and not short:
            break
        fit = next((i for i in spare if held + int(lengths[i]) <= total // 2 and len(spare) > 1), None)
        if fit is None:
            break
        spare.remove(fit)
        chosen.append(fit)
        held += int(lengths[fit])
    if len(chosen) < 3 or not spare or short:
        return None
    return [sorted(s) for s in sets]


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


def _encoded(docs: list[tuple[str, str]], tok, progress: bool) -> list[np.ndarray]:
    """Each document's ids as it is joined (tokenizer.document: BOS + text + EOS, or bytes + a blank line)."""
    from tqdm import tqdm

    dtype = np.uint8 if tok is BYTES else np.int32
    out = []
    bar = tqdm(total=len(docs), desc="tokenize", unit="doc", disable=not progress or tok is BYTES)
    for at in range(0, len(docs), TOKENIZE_BATCH):
        chunk = docs[at:at + TOKENIZE_BATCH]
        for (_, text), ids in zip(chunk, tok.encode_batch([t for _, t in chunk])):
            out.append(np.asarray(tok.document(ids, text), dtype=dtype))
        bar.update(len(chunk))
    bar.close()
    return out


def _make(docs: list[tuple[str, str]], tok, progress: bool) -> Corpus:
    """The corpus of `docs`: split by document (split_documents), or cut inside documents when too few."""
    arrays = _encoded(docs, tok, progress)
    lengths = np.array([len(a) for a in arrays], dtype=np.int64)
    sets = split_documents([name for name, _ in docs], lengths)
    if sets is None:
        tokens = np.concatenate(arrays)
        n = len(tokens)
        held = max(3, n // HOLD_EVERY, min(3 * MIN_SET_TOKENS, n // 4))
        bounds = np.array([n - held, n - 2 * held // 3, n - held // 3, n], dtype=np.int64)
        return Corpus(tokens, bounds, lengths, np.arange(len(arrays)), tok, inside=True)
    held = {i for s in sets for i in s}
    stored = [i for i in range(len(arrays)) if i not in held] + [i for s in sets for i in s]
    bounds = np.cumsum([sum(int(lengths[i]) for i in part) for part in
                        ([i for i in range(len(arrays)) if i not in held], *sets)])
    return Corpus(np.concatenate([arrays[i] for i in stored]), bounds.astype(np.int64), lengths[stored],
                  np.array(stored, dtype=np.int64), tok)


def _cache_key(paths: list[str], tok, limit_bytes: int | None) -> str:
    data = fingerprint(paths) if paths else f"stdlib {sys.version} {sysconfig.get_paths()['stdlib']} {limit_bytes}"
    key = f"{CACHE_FORMAT}|{data}|{tok.identity}|{DOCUMENT_FORMAT}|{SPLIT_RULE}"
    return hashlib.sha256(key.encode()).hexdigest()[:40]


_FIELDS = ("tokens", "bounds", "lengths", "order", "inside")


def _cached(key: str, make) -> Corpus:
    from safetensors.numpy import load_file, save_file

    f = cache_dir("tokens") / f"{key}.safetensors"
    if f.is_file():
        try:
            t = load_file(str(f))
            return Corpus(t["tokens"], t["bounds"], t["lengths"], t["order"], inside=bool(t["inside"][0]))
        except Exception:  # a damaged or older entry is made again
            pass
    c = make()
    f.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(f) as tmp:
        save_file({"tokens": c.tokens, "bounds": c.bounds, "lengths": c.lengths, "order": c.order.astype(np.int64),
                   "inside": np.array([int(c.inside)], dtype=np.int64)}, str(tmp))
    return c


_CORPORA: dict[tuple, Corpus] = {}
#: the corpora whose cut inside documents has been said (Corpus.held_out)
_SAID: set[str] = set()


def load_corpus(paths: list[str] | None = None, limit_bytes: int | None = None, tokenizer=BYTES,
                progress: bool | None = None) -> Corpus:
    """The corpus of `paths` (default: the standard library, up to `limit_bytes` of it) in `tokenizer`'s ids,
    made once per process (and, for a subword tokenizer, once per machine: see the module's docstring). A
    progress bar while tokenizing: `progress`, or by default when stderr is a terminal."""
    progress = sys.stderr.isatty() if progress is None else progress
    paths = [str(p) for p in paths or []]
    key = (tokenizer.identity, fingerprint(paths) if paths else None, limit_bytes)
    if key not in _CORPORA:
        make = lambda: _make(_documents(paths, tokenizer, limit_bytes), tokenizer, progress)
        made = make() if tokenizer is BYTES else _cached(_cache_key(paths, tokenizer, limit_bytes), make)
        made.tokenizer, made.source = tokenizer, ", ".join(paths) or "the standard library"
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


def require_windows(corpus: Corpus, role: str, length: int, use: str = "") -> None:
    """Refuses, before any work, a held-out set shorter than one window of `length` tokens, naming the set, its
    tokens and what to change (`use`: what the windows are for)."""
    n = len(corpus.held_out(role))
    if n >= length:
        return
    how = "a third of its last tokens, cut inside documents" if corpus.inside else \
        f"{corpus.set_documents(role)} of its {corpus.documents:,} documents"
    raise DataError(f"the {role} set{f' ({use})' if use else ''} has {n:,} tokens ({how}), shorter than one window "
                    f"of {length:,} tokens; give more text with --data, or shorter windows")


def held_out_windows(corpus: Corpus, role: str, length: int, limit: int | None = None,
                     use: str = "") -> torch.Tensor:
    """`sequential_windows` of one held-out set (`Corpus.held_out`), refused by `require_windows` when the set
    is too short."""
    require_windows(corpus, role, length, use)
    return sequential_windows(corpus.held_out(role), length, limit)


def sequential_windows(stream: np.ndarray, length: int, limit: int | None = None) -> torch.Tensor:
    """Consecutive non-overlapping windows [n, length] covering the stream (up to `limit` windows; None: all).

    A limit below 1 is refused: 0 once silently meant "every window"."""
    if length < 1 or (limit is not None and limit < 1):
        raise DataError(f"windows need length >= 1 and a limit >= 1 or None (got length {length}, limit {limit})")
    n = len(stream) // length
    if limit is not None:
        n = min(n, limit)
    if n == 0:
        raise DataError(f"the text ({len(stream)} tokens) is shorter than one window of {length} tokens; "
                        "give more text or a shorter window")
    return torch.from_numpy(stream[: n * length].astype(np.int64).reshape(n, length))


def covering_windows(stream: np.ndarray, length: int, limit: int | None = None) -> list[torch.Tensor]:
    """Windows of `length` tokens that overlap by one, so that every token after the first is predicted once:
    [n, length] and, when the stream does not end on a window, its shorter last window [1, r] (up to `limit`
    windows in all; None: the whole stream)."""
    if length < 2 or (limit is not None and limit < 1):
        raise DataError(f"windows need length >= 2 and a limit >= 1 or None (got length {length}, limit {limit})")
    step = length - 1
    full = max(0, (len(stream) - 1) // step)
    n = full if limit is None else min(full, limit)
    out = []
    if n:
        idx = np.arange(n)[:, None] * step + np.arange(length)[None]
        out.append(torch.from_numpy(stream[idx].astype(np.int64)))
    if n == full and len(stream) - full * step > 1 and (limit is None or n < limit):
        out.append(torch.from_numpy(stream[full * step:].astype(np.int64))[None])
    if not out:
        raise DataError(f"the text ({len(stream)} tokens) has nothing to score: it needs two tokens or more")
    return out
