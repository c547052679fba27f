"""Layering: the ground floor (errors, outputs, memory, eta) <- ir, text <- backends, evaluation, training <- passes
<- tools; no module imports a layer above its own, at module level or inside a function. The package root holds
only the ground floor and the packages, and no module outgrows one concern (400 lines)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"errors": 0, "outputs": 0, "memory": 0, "eta": 0, "ir": 1, "text": 1, "backends": 2, "evaluation": 2, "training": 2,
          "passes": 3, "estimate": 3, "tools": 4}


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


def module_name(rel: Path) -> str:
    """`passes/distill/run.py` -> `passes.distill.run`; a package's `__init__.py` -> the package."""
    parts = list(rel.with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(text: str, rel: Path, known: set[str]) -> set[str]:
    """Every module of the package that the module at `rel` imports, at module level or inside a function: for
    `from X import name`, X.name when that is a module, else X."""
    package = list(rel.parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)] + (node.module.split(".") if node.module else [])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("puzzlekit."):
            base = node.module.split(".")[1:]
        elif isinstance(node, ast.Import):
            out |= {".".join(a.name.split(".")[1:]) for a in node.names if a.name.startswith("puzzlekit.")} & known
            continue
        else:
            continue
        mod = ".".join(base)
        for a in node.names:
            sub = f"{mod}.{a.name}" if mod else a.name
            out.add(sub if sub in known else mod)
    return out & known


def import_graph():
    import networkx as nx

    files = {module_name(f.relative_to(ROOT)): f for f in sources()}
    g = nx.DiGraph()
    for name, f in files.items():
        g.add_node(name)
        g.add_edges_from((name, m) for m in imported_modules(f.read_text(), f.relative_to(ROOT), set(files))
                         if m != name)
    return g


def test_no_import_circle():
    """No two modules import each other, directly or through others, at module level or inside functions: a
    package's `__init__` re-exporting its modules is the one allowed way back up (its modules may not import it)."""
    import networkx as nx

    cycles = sorted(sorted(c) for c in nx.simple_cycles(import_graph()))
    assert not cycles, f"import circles: {cycles[:5]}"


def test_no_circle_between_sibling_packages():
    """Packages (`passes.distill`, `passes.puzzle`, `ir.ops`, `ir.quant`, ...) do not import each other both ways
    either, through any of their modules."""
    import networkx as nx

    def package(module: str) -> str:
        parts = module.split(".")
        return ".".join(parts[:2]) if len(parts) > 2 else module

    g = nx.DiGraph((package(a), package(b)) for a, b in import_graph().edges() if package(a) != package(b))
    cycles = sorted(sorted(c) for c in nx.simple_cycles(g))
    assert not cycles, f"package circles: {cycles[:5]}"


def test_the_circle_check_sees_function_level_imports():
    known = {"passes.distill", "passes.puzzle.library", "passes.puzzle", "ir"}
    text = "from .. import ir\ndef f():\n    from .puzzle.library import parent_hash\n"
    assert imported_modules(text, Path("passes/distill.py"), known) == {"ir", "passes.puzzle.library"}


#: what the package root holds besides the layers: the tests, the benchmarks and the package's own files
NOT_CODE = {"__init__.py", "tests", "benchmarks", "docs", "runs", "README.md", "pyproject.toml"}


def test_the_root_holds_the_ground_floor_and_the_packages():
    """A new concern gets a package (and a floor in LAYERS), not a module beside them."""
    tracked = {p.name for p in ROOT.iterdir() if not p.name.startswith(".") and p.name not in NOT_CODE
               and (p.suffix == ".py" or (p / "__init__.py").exists())}
    loose = sorted(n for n in tracked if n.removesuffix(".py") not in LAYERS)
    assert not loose, f"modules or packages outside the floors: {loose}: give them a floor in LAYERS"
    upstairs = sorted(n for n in tracked if n.endswith(".py") and LAYERS[n.removesuffix(".py")] > 0)
    assert not upstairs, f"only ground-floor modules stand at the root, not {upstairs}: move them into a package"


@pytest.mark.parametrize("file", list(sources()), ids=lambda f: str(f.relative_to(ROOT)))
def test_no_module_over_400_lines(file):
    lines = len(file.read_text().splitlines())
    assert lines <= 400, f"{file.relative_to(ROOT)} has {lines} lines: split it by concern"
