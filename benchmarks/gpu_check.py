"""The prepared GPU check: one command that, on a CUDA machine, within a few minutes

1. runs the device tests (tests/test_device.py) there;
2. builds a small block library of the built-in model and distils a pruned child, in bf16 on the GPU and in
   float32 on the CPU, and prints the time of each stage on both;
3. times a decode step of the parent and of a 2x child (planned for the analytic `--target`, h200 by default:
   an H200 is Hopper) at batch 1..256 on the GPU, and compares the measured child/parent ratio with the
   analytic provider's prediction for that target;

then writes one JSON (`--out`) and prints a table. Without CUDA it says so, writes the JSON, and exits 0.

    python benchmarks/gpu_check.py --out gpu_check.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from puzzlekit.backends.cost import CostModel, get_scenario
from puzzlekit.backends.torch import materialize
from puzzlekit.backends.torch.device import CPU, median_seconds, resolve
from puzzlekit.passes import PassManager
from puzzlekit.passes.distill import Distill, distill
from puzzlekit.passes.puzzle import LibrarySettings, build_library
from puzzlekit.passes.puzzle.search import Constraints, PlanError, Search
from puzzlekit.tools.default_model import load_default

ROOT = Path(__file__).resolve().parents[1]
GRID = "[mamba2]\nheads = [0.5]\n[moe]\nexperts = [0.5]\ntop_k = [0.5]\n[attention]\nq_heads = [0.5]\n" \
       "[mlp]\nd_ff = [0.5]\n[replacements]\nkinds = [\"noop\", \"linear\"]\n"
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def stages(parent, compute, work: Path) -> tuple[dict, object]:
    """Seconds of a small library build and a short distillation of a pruned child on `compute`."""
    grid = work / "grid.toml"
    grid.write_text(GRID)
    settings = LibrarySettings(calib_windows=16, score_windows=4, seq=128, bld_tokens=16384)
    t = time.perf_counter()
    lib = build_library(parent, work / f"lib-{compute.device.type}", grid, settings, compute=compute)
    library_s = time.perf_counter() - t
    child = parent.copy()
    PassManager("set-topk{k=1},drop-blocks{layers=[2]}").run(child)
    t = time.perf_counter()
    rep = distill(child, parent, Distill(steps=40, batch=8, seq=128, eval_every=20, eval_windows=4, lr=1e-3),
                  compute=compute)
    distill_s = time.perf_counter() - t
    return {"library_s": library_s, "distill_s": distill_s, "distill_kl_before": rep["before"]["kl"],
            "distill_kl_after": rep["after"]["kl"]}, lib


def child_plan(lib, parent, target: str, scenario: str, speedups=(2.0, 1.75, 1.5, 1.25)):
    """The MIP child at 2x the parent's predicted throughput on `target`, or the largest of `speedups` the
    small library reaches."""
    for x in speedups:
        search = Search(lib, parent, [(target, scenario)], constraints=Constraints(speedup=x))
        try:
            return search, search.plan()
        except PlanError:
            continue
    raise PlanError(f"the check's library reaches none of the speedups {speedups} on {target}")


def decode_step_seconds(prog, compute, batch: int, context: int = 256, steps: int = 20) -> float:
    """Median device time of one decode step at `batch` after a `context`-token prefill (CUDA events)."""
    model = materialize(prog, compute=compute)
    ids = torch.randint(0, 256, (batch, context), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, state = model.prefill(ids)
        tok = ids[:, -1].to(compute.device)
        return median_seconds(lambda: model.decode(tok, state), compute, repeats=steps, warmup=3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu_check.json")
    ap.add_argument("--target", default="h200", help="the analytic target matching this GPU")
    ap.add_argument("--scenario", default="decode-heavy")
    args = ap.parse_args()
    result = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if not torch.cuda.is_available():
        print(f"no CUDA device (torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}): nothing to check")
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        return 0
    gpu = resolve("cuda", "bfloat16")
    result["gpu"] = torch.cuda.get_device_name(gpu.device)
    t = time.perf_counter()
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_device.py"],
                           cwd=ROOT, capture_output=True, text=True)
    result["device_tests"] = {"returncode": tests.returncode, "summary": tests.stdout.strip().splitlines()[-1:],
                              "seconds": time.perf_counter() - t}
    parent = load_default()
    with tempfile.TemporaryDirectory() as d:
        result["cpu"], _ = stages(parent, CPU, Path(d))
        result["cuda_bf16"], lib = stages(parent, gpu, Path(d))
    search, plan = child_plan(lib, parent, args.target, args.scenario)
    child = search.child(search.rows_of(plan), weights=True)
    scenario = get_scenario(args.scenario)
    rows = []
    for b in BATCHES:
        mp, mc = decode_step_seconds(parent, gpu, b), decode_step_seconds(child, gpu, b)
        pp = CostModel(parent, args.target, scenario).decode_step_seconds(b)
        pc = CostModel(child, args.target, scenario).decode_step_seconds(b)
        rows.append({"batch": b, "parent_ms": mp * 1e3, "child_ms": mc * 1e3, "measured_ratio": mp / mc,
                     "predicted_ratio": pp / pc, "predicted_parent_ms": pp * 1e3, "predicted_child_ms": pc * 1e3})
    result["decode"] = {"target": args.target, "speedup": search.c.speedup, "child_params": plan.params_total,
                        "parent_params": parent.param_counts()["total"], "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['gpu']}, torch {torch.__version__}; device tests: {result['device_tests']['summary']}")
    print(f"{'stage':<10}{'cpu fp32 s':>12}{'cuda bf16 s':>13}{'speed-up':>10}")
    for k in ("library_s", "distill_s"):
        print(f"{k[:-2]:<10}{result['cpu'][k]:>12.1f}{result['cuda_bf16'][k]:>13.1f}"
              f"{result['cpu'][k] / result['cuda_bf16'][k]:>9.1f}x")
    print(f"\ndecode step, parent vs {search.c.speedup:g}x child ({plan.params_total:,} params) on {result['gpu']}; "
          f"predicted: analytic {args.target}")
    print(f"{'batch':>6}{'parent ms':>11}{'child ms':>10}{'measured':>10}{'predicted':>11}")
    for r in rows:
        print(f"{r['batch']:>6}{r['parent_ms']:>11.3f}{r['child_ms']:>10.3f}{r['measured_ratio']:>9.2f}x"
              f"{r['predicted_ratio']:>10.2f}x")
    print(f"wrote {args.out}")
    return 0 if tests.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
