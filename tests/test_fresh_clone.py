"""What a fresh clone needs: the package imported once per process, custom torch ops registered where they are
used (once), nothing read from outside the repository, and a CI run that fails when a test oracle is missing."""
from __future__ import annotations

import importlib
import os
import pkgutil
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import puzzlekit

REPOSITORY = Path(__file__).resolve().parents[1]


def _run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env}, cwd=REPOSITORY)


def test_every_module_of_the_package_is_imported_once():
    for info in pkgutil.walk_packages(puzzlekit.__path__, "puzzlekit."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
    names = defaultdict(list)
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        path = Path(file).resolve() if file and Path(file).is_absolute() else None
        if path and path.is_relative_to(REPOSITORY) and not {"tests", "site-packages"} & set(path.parts):
            names[path].append(name)
    assert names, "no module of the package was found in sys.modules"
    twice = {str(f): n for f, n in names.items() if len(n) > 1}
    assert not twice, f"modules imported under two names: {twice}"
    strangers = {str(f): n for f, n in names.items() if not all(m.split(".")[0] == "puzzlekit" for m in n)}
    assert not strangers, f"package files imported outside the puzzlekit namespace: {strangers}"


def test_the_nvfp4_export_op_is_registered_on_first_use_once_and_computes_the_format():
    """In a fresh process; importing the CLI and the ONNX backend loads no transformers (seconds of imports that
    only a trace of a transformers model needs)."""
    r = _run("""
import sys, torch
import puzzlekit, puzzlekit.ir, puzzlekit.backends.torch, puzzlekit.passes, puzzlekit.tools.cli
assert not hasattr(torch.ops.puzzlekit, "nvfp4_qdq"), "registered as a side effect of importing the package"
from puzzlekit.backends.onnx.trt_ops import nvfp4_qdq_op
assert "transformers" not in sys.modules, "the ONNX backend imported transformers"
from puzzlekit.ir.quant.formats import nvfp4_qdq
first = nvfp4_qdq_op()
nvfp4_qdq_op.cache_clear()
assert nvfp4_qdq_op() is first, "a second registration replaced the first op"
x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
s = x.abs().amax() / (6 * 448)
assert torch.equal(first(x, s), nvfp4_qdq(x, s))
print("ok")
""")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_no_source_file_reads_outside_the_repository():
    outside = re.compile(r"""\.\./shared|/shared/config|["']/work/|parents\[[2-9]\]""")
    hits = [f"{p.relative_to(REPOSITORY)}:{i}: {line.strip()}"
            for p in sorted(REPOSITORY.rglob("*.py"))
            if p != Path(__file__).resolve() and not {".venv", "build"} & set(p.relative_to(REPOSITORY).parts)
            for i, line in enumerate(p.read_text().splitlines(), 1) if outside.search(line)]
    assert not hits, "paths outside the repository:\n" + "\n".join(hits)


def test_in_ci_a_missing_test_oracle_fails_the_run_instead_of_skipping(tmp_path):
    shim = tmp_path / "transformers"
    shim.mkdir()
    (shim / "__init__.py").write_text("raise ImportError('transformers is hidden by the test')\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_hf_parity.py"],
                       capture_output=True, text=True, timeout=300, cwd=REPOSITORY,
                       env={**os.environ, "CI": "true", "PYTHONPATH": str(tmp_path)})
    assert r.returncode != 0, r.stdout[-2000:]
    assert "test oracle transformers cannot be imported" in r.stdout + r.stderr
