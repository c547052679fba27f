"""The search on the built-in model's default library: MIP against the `uniform` and `greedy` baselines at the
same throughput target, each child realised with its BLD-trained variants and measured against the parent.

Run: python benchmarks/search_default.py [--library DIR] [--target cpu] [--scenario chat] [--speedup 2]
Without --library the default library is built first (about 4 minutes on 2 cores).
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from puzzlekit import evaluation as evaluate
from puzzlekit.backends.torch import materialize
from puzzlekit.text.data import held_out_windows, load_corpus
from puzzlekit.ir.printer import format_table
from puzzlekit.passes.puzzle import Library, build_library
from puzzlekit.passes.puzzle.search import Constraints, PlanError, Search
from puzzlekit.tools.default_model import load_default


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--library")
    ap.add_argument("--target", default="cpu")
    ap.add_argument("--scenario", default="chat")
    ap.add_argument("--speedup", type=float, default=2.0)
    args = ap.parse_args()
    parent = load_default()
    lib = Library.open(args.library, parent) if args.library else \
        build_library(parent, Path(tempfile.mkdtemp()) / "library", progress=True)
    search = Search(lib, parent, [(args.target, args.scenario)], constraints=Constraints(speedup=args.speedup))
    held = held_out_windows(load_corpus(None), "report", 257, limit=16)  # not the scores' windows
    teacher = materialize(parent)
    rows = [("method", "summed score", "KL", "top-1", "params", "serving step / budget", "batch", "solve s")]
    for method in ("mip", "uniform", "greedy"):
        try:
            plan = search.plan(method)
        except PlanError as e:
            rows.append((method, "-", "-", "-", "-", str(e).splitlines()[0], "-", "-"))
            continue
        child = materialize(search.child(search.rows_of(plan), weights=True))
        r = evaluate.teacher_agreement(teacher, child, held)
        step = plan.predicted["serve_seconds"]
        rows.append((method, f"{plan.objective:.4f}", f"{r['kl']:.4f}", f"{r['top1_agreement']:.3f}",
                     f"{plan.params_total:,}", f"{step * 1e3:.2f} / {plan.limits['serve_seconds'] * 1e3:.2f} ms",
                     str(plan.batch), f"{plan.solve_seconds:.2f}"))
    print(f"{args.speedup}x throughput on {args.target} ({args.scenario}), held-out KL to the parent:")
    print(format_table(rows), end="")


if __name__ == "__main__":
    main()
