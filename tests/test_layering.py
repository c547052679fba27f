"""Layering: ir <- backends <- passes <- tools, with the leaf modules (errors, outputs) below all; no module
imports a layer above its own, at module level or inside a function."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"errors": 0, "outputs": 0, "memory": 0, "hub": 0, "ir": 1, "tokenizer": 1, "documents": 1, "data": 1, "backends": 2, "evaluate": 2, "training": 2, "passes": 3, "tools": 4}


def imported_packages(text: str, rel: Path) -> list[tuple[int, str]]:
    """(line, top-level puzzlekit module) of every import in `text`, a module at `rel` in the package."""
    parts = rel.parts[:-1]
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(parts[: len(parts) - (node.level - 1)])
            target = base + (node.module.split(".") if node.module else [])
            names = [a.name for a in node.names] if not target else []
            found += [(node.lineno, t) for t in (target[:1] or names)]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("puzzlekit."):
            found.append((node.lineno, node.module.split(".")[1]))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".")[1]) for a in node.names if a.name.startswith("puzzlekit.")]
    return found


def sources():
    for top in LAYERS:
        path = ROOT / top
        yield from (sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")])


@pytest.mark.parametrize("file", list(sources()), ids=lambda f: str(f.relative_to(ROOT)))
def test_no_upward_import(file):
    rel = file.relative_to(ROOT)
    own = LAYERS[rel.parts[0].removesuffix(".py")]
    upward = [f"line {line}: imports {pkg}" for line, pkg in imported_packages(file.read_text(), rel)
              if LAYERS.get(pkg, -1) > own]
    assert not upward, f"{file.relative_to(ROOT)} imports a higher layer: {upward}"


def test_the_check_sees_upward_imports():
    text = "from ...passes.quant import Quantize\nimport torch\ndef f():\n    from ... import tools\n"
    assert imported_packages(text, Path("ir/ops/mlp.py")) == [(1, "passes"), (4, "tools")]
    assert imported_packages("from puzzlekit.backends.torch import materialize\n", Path("ir/x.py")) == [(1, "backends")]
