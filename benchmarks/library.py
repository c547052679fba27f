"""Builds the built-in model's default block library (every layer, the default grid, BLD, scores) and prints
its run time per stage, next to the goal of 15 minutes on 2 cores.

Run: python benchmarks/library.py [--out DIR] [--bld-tokens 65536]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from puzzlekit.ir.printer import format_table
from puzzlekit.passes.puzzle import LibrarySettings, build_library
from puzzlekit.tools.default_model import load_default
from puzzlekit.tools.puzzle import summary_rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="library directory (default: a fresh temporary one)")
    ap.add_argument("--bld-tokens", type=int, default=65536)
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp()) / "library"
    start = time.perf_counter()
    lib = build_library(load_default(), out, settings=LibrarySettings(bld_tokens=args.bld_tokens), progress=True)
    total = time.perf_counter() - start
    stages = json.loads((out / "timings.json").read_text())
    per_layer = {k: len(v) for k, v in lib.layers().items()}
    trained = [r for r in lib.rows if r["bld"]["trained"]]
    print(f"default library: {len(per_layer)} layers, {len(lib.rows)} variants "
          f"({min(per_layer.values())}-{max(per_layer.values())} per layer), {len(trained)} improved by BLD")
    print(format_table([("stage", "seconds", "share")] + [(k, f"{v:.1f}", f"{v / total:.0%}") for k, v in
                                                          sorted(stages.items(), key=lambda kv: -kv[1])]), end="")
    print(f"total {total:.1f} s ({total / 60:.1f} min; goal: under 15 min on 2 cores)")
    print(format_table(summary_rows(lib)), end="")


if __name__ == "__main__":
    main()
