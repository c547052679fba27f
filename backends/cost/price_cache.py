"""Prices kept between runs: a provider that prices ahead from tables (no timing here) gives the same seconds for
the same op, shapes and deployment every time, so `plan` and `cost` read what an earlier run priced instead of
pricing it again (the 8xB200 question: about 3 s of its 7). The file is keyed by what the prices depend on: the
provider's own identity (library version, GPU, engine database, its constants) and the text of puzzlekit's
pricing code, so a changed formula or library never reads a stale price. Written once, when the process ends;
a cache that cannot be read is priced again, one that cannot be written is said once and skipped.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import sys
from functools import lru_cache
from pathlib import Path

from ...outputs import cache_dir, write_text

#: the code the prices come from (relative to the package root)
SOURCES = ("backends/cost", "backends/layout.py", "backends/targets.py", "ir/ops", "ir/quant")
PACKAGE = Path(__file__).resolve().parent.parent.parent  # puzzlekit's own root: backends/cost/ is two below


@lru_cache(maxsize=None)
def code_digest() -> str:
    """A digest of the pricing code's text."""
    root, h = PACKAGE, hashlib.sha256()
    for name in SOURCES:
        path = root / name
        for f in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


_OPEN: dict = {}  # path -> its PriceCache: one per file in a process, shared by the providers that use it


def kept_prices(name: str, identity: str) -> PriceCache:
    """The prices kept for a provider named `name` whose prices depend on `identity` (a stable text)."""
    digest = hashlib.sha256((identity + code_digest()).encode()).hexdigest()[:20]
    path = cache_dir("prices") / f"{name}-{digest}.json"
    if path not in _OPEN:
        _OPEN[path] = PriceCache(path)
        atexit.register(_OPEN[path].save)
    return _OPEN[path]


class PriceCache:
    """Prices by key (any value with a stable repr: frozen dataclasses, tuples, numbers, strings)."""

    def __init__(self, path: Path):
        self.path = path
        self._data: dict | None = None
        self._new: dict = {}

    def get(self, key):
        if self._data is None:
            self._data = self._read()
        k = repr(key)
        return self._new.get(k, self._data.get(k))

    def put(self, key, value) -> None:
        self._new[repr(key)] = value

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def save(self) -> None:
        """Merges what this run priced into the file (a longer decode curve wins) and writes it atomically."""
        if not self._new:
            return
        data = self._read()
        for k, v in self._new.items():
            old = data.get(k)
            if not (isinstance(old, list) and isinstance(v, list) and len(old) > len(v)):
                data[k] = v
        self._new = {}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_text(self.path, json.dumps(data, separators=(",", ":")))
        except OSError as e:
            print(f"puzzlekit: prices not kept for later runs ({self.path}: {e})", file=sys.stderr)
