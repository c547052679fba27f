"""The ONNX optimizer on the built-in model's two graphs, with each rewrite rule tried only on nodes of its
pattern's root op (puzzlekit's) and with every rule tried on every node (onnxscript's own loop), side by side:
best of --repeats, alternating, and whether the two give the same graph byte for byte.

Run: python benchmarks/onnx_optimize.py [--repeats 3]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import puzzlekit.backends.onnx.export as export
from puzzlekit.tools.default_model import load_default


def graphs() -> list:
    """The graphs export_onnx hands to the optimizer (its input is left as it is)."""
    seen, real = [], export._optimize
    export._optimize = lambda model: seen.append(model) or real(model)
    try:
        export.export_onnx(load_default(), Path(tempfile.mkdtemp()) / "onnx", target="cpu")
    finally:
        export._optimize = real
    return seen


def optimized(model, rooted: bool) -> tuple[float, bytes]:
    keep = export._rooted
    if not rooted:
        export._rooted = lambda rule: rule
    try:
        t0 = time.perf_counter()
        out = export._optimize(model)
        return time.perf_counter() - t0, out.SerializeToString()
    finally:
        export._rooted = keep


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"{'graph':>12} {'rooted s':>9} {'every rule s':>13} {'ratio':>6}  same graph")
    for model in graphs():
        best = {True: float("inf"), False: float("inf")}
        out = {}
        for _ in range(args.repeats):
            for rooted in (False, True):
                seconds, out[rooted] = optimized(model, rooted)
                best[rooted] = min(best[rooted], seconds)
        print(f"{len(model.graph.node):>6} nodes {best[True]:>9.2f} {best[False]:>13.2f} "
              f"{best[False] / best[True]:>5.2f}x  {out[True] == out[False]}")


if __name__ == "__main__":
    main()
