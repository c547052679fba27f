"""TensorRT-RTX engine builds of the default model: build time and engine size per graph and precision.

Run: python benchmarks/engine_build.py [--scenario chat] [--cases fp32:rtx-sm120 fp8:rtx-sm120 ...]
Needs TensorRT-RTX (pip install --no-deps tensorrt_rtx_cu12_libs==1.7.1.116 tensorrt_rtx_cu12_bindings==1.7.1.116).
Each case quantizes the model (2 calibration windows), writes a bundle and builds its engines ahead of time;
the export time (torch.onnx, the optimizer, golden outputs) is reported beside the build.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from puzzlekit.backends.cost import get_scenario
from puzzlekit.backends.targets import TARGETS
from puzzlekit.backends.tensorrt import write_bundle
from puzzlekit.ir.printer import format_table
from puzzlekit.passes import PassManager
from puzzlekit.tools.default_model import load_default

CASES = ("fp32:rtx-sm120", "fp8:rtx-sm120", "nvfp4-weight:rtx-sm120", "nvfp4:rtx-sm120", "fp8:rtx-sm89")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="chat")
    ap.add_argument("--cases", nargs="*", default=list(CASES), help="recipe:target pairs (fp32: not quantized)")
    args = ap.parse_args()
    rows = [("precision", "target", "graph", "profiles", "build s", "engine MB", "bundle s")]
    with tempfile.TemporaryDirectory() as d:
        for case in args.cases:
            recipe, target = case.split(":")
            prog = load_default()
            if recipe != "fp32":
                PassManager(f"quantize{{recipe={recipe},samples=2,seq=64}}").run(prog)
            t0 = time.perf_counter()
            rep = write_bundle(prog, Path(d) / case.replace(":", "-"), TARGETS[target], get_scenario(args.scenario),
                               build="yes")
            total = time.perf_counter() - t0
            for graph, e in rep.engines.items():
                rows.append((rep.precision, target, graph, ",".join(e["profiles"]), f"{e['build_seconds']:.1f}",
                             f"{e['bytes'] / 1e6:.1f}", f"{total:.0f}"))
            print(f"{case}: done in {total:.0f} s", flush=True)
    print(format_table(rows), end="")


if __name__ == "__main__":
    main()
