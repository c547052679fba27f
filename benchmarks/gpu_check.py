"""The prepared GPU check: one command that, on a machine with one CUDA GPU or more, within about 8 minutes

1. runs the device tests there: the CUDA variants of tests/test_device.py (bf16 on the GPU against float32
   on the CPU) and tests/test_gpu_paths.py; the 2-rank run (NCCL, one GPU per rank) only with 2 GPUs or more;
2. builds a small block library of the built-in model and distils a pruned child, in bf16 on the GPU and in
   float32 on the CPU, and prints the time of each stage on both;
3. times a decode step of the parent and of a 2x child (planned for the analytic `--target`, h200 by default:
   an H200 is Hopper) at batch 1..256 on the GPU, and compares the measured tokens/s and child/parent ratio
   with the analytic provider's prediction for that target;
4. runs benchmarks/vs_transformers.py when it is there;

then writes one JSON (`--out`) and prints a table. Without a CUDA GPU it says so and exits 0, having done
nothing.

    python benchmarks/gpu_check.py --out gpu_check.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from puzzlekit.backends.cost import CostModel, get_scenario
from puzzlekit.backends.torch import materialize
from puzzlekit.backends.torch.device import CPU, median_seconds, resolve, use_threads
from puzzlekit.passes import PassManager
from puzzlekit.passes.distill import Distill, distill
from puzzlekit.passes.puzzle import LibrarySettings, build_library
from puzzlekit.passes.puzzle.search import Constraints, PlanError, Search
from puzzlekit.tools.default_model import load_default

ROOT = Path(__file__).resolve().parents[1]
GRID = "[mamba2]\nheads = [0.5]\n[moe]\nexperts = [0.5]\ntop_k = [0.5]\n[attention]\nq_heads = [0.5]\n" \
       "[mlp]\nd_ff = [0.5]\n[replacements]\nkinds = [\"noop\", \"linear\"]\n"
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEADLINE_S = 450  # the whole check: benchmarks/vs_transformers.py gets what is left of it (a minute at least)
#: the device tests: every CUDA-parametrised test of test_device.py (and, with two GPUs, its 2-rank run), and
#: all of test_gpu_paths.py (its CPU checks of the CUDA paths and its CUDA tests)
DEVICE_TESTS = ["tests/test_device.py", "tests/test_gpu_paths.py", "-k", "cuda or diverges or gpu_paths",
                "-m", "not slow"]


def device_tests(gpus: int, seconds: float = 300) -> dict:
    """The device tests in a subprocess (one intra-op thread, as the built-in model runs best), for at most
    `seconds`."""
    t = time.perf_counter()
    two = "run" if gpus >= 2 else f"skipped: {gpus} GPU (the 2-rank run needs one GPU per rank)"
    try:
        p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *DEVICE_TESTS],
                           cwd=ROOT, capture_output=True, text=True, timeout=seconds,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        return {"returncode": None, "summary": [f"stopped after {seconds:.0f} s"], "failed": [], "two_ranks": two,
                "tail": out[-2000:], "seconds": time.perf_counter() - t}
    failed = [line for line in p.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    return {"returncode": p.returncode, "summary": p.stdout.strip().splitlines()[-1:], "failed": failed,
            "two_ranks": two, "seconds": time.perf_counter() - t}


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
    settings = Distill(steps=40, batch=8, seq=128, eval_every=20, eval_windows=4, lr=1e-3)
    cuda = compute.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(compute.device)
    t = time.perf_counter()
    rep = distill(child, parent, settings, compute=compute)
    distill_s = time.perf_counter() - t
    out = {"compute": str(compute), "library_s": library_s, "distill_s": distill_s,
           "distill_kl_before": rep["before"]["kl"], "distill_kl_after": rep["after"]["kl"]}
    if cuda:  # the GPU formulas of --estimate against this run (estimate/stages.py; the CUDA context apart)
        from puzzlekit.estimate import estimate, parse_hardware
        from puzzlekit.estimate.hardware import GPU_RESERVED

        stage = estimate([settings], child, parse_hardware(None, "cuda"), 2**62).stages[0]
        out["estimate"] = {"peak_bytes": stage.peak_memory_bytes - GPU_RESERVED, "seconds": stage.seconds,
                           "measured_peak_reserved_bytes": torch.cuda.max_memory_reserved(compute.device),
                           "measured_seconds": distill_s}
    return out, lib


#: the distillation's state modes, each run on the GPU beside its --estimate (offload needs 2 processes: left out)
MODES = {"fp32 AdamW": {}, "bf16 + adamw-bf16": {"params": "bf16", "optimizer": "adamw-bf16"},
         "bf16 + adamw-8bit": {"params": "bf16", "optimizer": "adamw-8bit"}, "fp8 teacher": {"teacher_dtype": "fp8"},
         "checkpointing": {"checkpointing": True}, "best on disk": {"best": "disk"}}


def state_modes(parent, compute, work: Path) -> list[dict]:
    """Each of `MODES` for a short distillation of the pruned child on the GPU: peak reserved memory and seconds
    beside the estimate's, and the held-out KL it reaches (the same steps and seeds)."""
    from puzzlekit.estimate import estimate, parse_hardware
    from puzzlekit.estimate.hardware import GPU_RESERVED

    rows = []
    for name, options in MODES.items():
        child = parent.copy()
        PassManager("set-topk{k=1},drop-blocks{layers=[2]}").run(child)
        settings = Distill(steps=40, batch=8, seq=256, eval_every=20, eval_windows=4, lr=1e-3,
                           state=str(work / f"state-{len(rows)}") if options.get("best") == "disk" else "", **options)
        torch.cuda.reset_peak_memory_stats(compute.device)
        t = time.perf_counter()
        try:
            rep = distill(child, parent, settings, Path(settings.state) if settings.state else None, compute=compute)
        except Exception as e:  # a mode that fails here is a finding, not the end of the check
            rows.append({"mode": name, "error": f"{type(e).__name__}: {e}"[:300]})
            continue
        stage = estimate([settings], child, parse_hardware(None, "cuda"), 2**62).stages[0]
        rows.append({"mode": name, "seconds": time.perf_counter() - t, "kl_after": rep["after"]["kl"],
                     "peak_reserved_bytes": torch.cuda.max_memory_reserved(compute.device),
                     "estimate_bytes": stage.peak_memory_bytes - GPU_RESERVED, "estimate_seconds": stage.seconds})
    return rows


def child_plan(lib, parent, target: str, scenario: str, speedups=(2.0, 1.75, 1.5, 1.25)):
    """The MIP child at 2x the parent's predicted throughput on `target`, or the largest of `speedups` the
    small library reaches. No serving engine's rules (engine none): the decode is timed in puzzlekit's own
    forward, and under the default profile's rules this library reaches about 1.03x."""
    for x in speedups:
        search = Search(lib, parent, [(target, scenario)], constraints=Constraints(speedup=x), engine="none")
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


def decode_rows(parent, child, gpu, target: str, scenario) -> list[dict]:
    """Measured decode steps of parent and child per batch, beside the analytic target's prediction."""
    rows = []
    for b in BATCHES:
        mp, mc = decode_step_seconds(parent, gpu, b), decode_step_seconds(child, gpu, b)
        pp = CostModel(parent, target, scenario).decode_step_seconds(b)
        pc = CostModel(child, target, scenario).decode_step_seconds(b)
        rows.append({"batch": b, "parent_ms": mp * 1e3, "child_ms": mc * 1e3, "parent_tok_s": b / mp,
                     "child_tok_s": b / mc, "measured_ratio": mp / mc, "predicted_ratio": pp / pc,
                     "predicted_parent_ms": pp * 1e3, "predicted_child_ms": pc * 1e3})
    return rows


def vs_transformers(work: Path, seconds: float) -> dict:
    """benchmarks/vs_transformers.py, when it is there, for at most `seconds` (its JSON rows and the end of
    its output)."""
    script = ROOT / "benchmarks" / "vs_transformers.py"
    if not script.exists():
        return {"skipped": f"{script.relative_to(ROOT)} is not there"}
    out = work / "vs_transformers.json"
    t = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, str(script), "--json", str(out)], cwd=ROOT, capture_output=True,
                           text=True, timeout=seconds)
    except subprocess.TimeoutExpired:
        return {"returncode": None, "tail": f"stopped after {seconds:.0f} s (the check's time is up)",
                "seconds": time.perf_counter() - t}
    return {"returncode": p.returncode, "tail": (p.stdout + p.stderr)[-2000:], "seconds": time.perf_counter() - t,
            "rows": json.loads(out.read_text()) if out.exists() else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu_check.json")
    ap.add_argument("--target", default="h200", help="the analytic target matching this GPU")
    ap.add_argument("--scenario", default="decode-heavy")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA GPU on this machine (torch {torch.__version__}, CUDA build: "
              f"{torch.version.cuda or 'no'}): nothing checked, nothing written. Run it on a machine with a GPU.",
              file=sys.stderr)
        return 0
    start = time.perf_counter()
    gpus = torch.cuda.device_count()
    gpu = resolve("cuda", "bfloat16")
    result = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "cuda": torch.version.cuda,
              "gpu": torch.cuda.get_device_name(gpu.device), "gpus": gpus}
    print(f"{result['gpu']} x{gpus}, torch {torch.__version__} (CUDA {torch.version.cuda})", flush=True)
    result["device_tests"] = tests = device_tests(gpus)
    print(f"device tests: {tests['summary']} in {tests['seconds']:.0f} s; 2-rank run: {tests['two_ranks']}",
          flush=True)
    for line in tests["failed"]:
        print(f"  {line}")
    parent = load_default()
    with tempfile.TemporaryDirectory() as d:
        threads = use_threads(parent.param_counts()["total"])  # the CPU run as the CLI runs it
        result["cpu"], _ = stages(parent, CPU, Path(d))
        result["cpu"]["threads"] = threads
        result["cuda_bf16"], lib = stages(parent, gpu, Path(d))
        print(f"{'stage':<10}{'cpu fp32 s':>12}{'cuda bf16 s':>13}{'speed-up':>10}{'KL after cpu/cuda':>20}")
        for k in ("library_s", "distill_s"):
            kl = (f"{result['cpu']['distill_kl_after']:.4f}/{result['cuda_bf16']['distill_kl_after']:.4f}"
                  if k == "distill_s" else "")
            print(f"{k[:-2]:<10}{result['cpu'][k]:>12.1f}{result['cuda_bf16'][k]:>13.1f}"
                  f"{result['cpu'][k] / result['cuda_bf16'][k]:>9.1f}x{kl:>20}", flush=True)
        e = result["cuda_bf16"]["estimate"]
        print(f"distill --estimate on this GPU: {e['peak_bytes'] / 1e9:.2f} GB (measured, reserved: "
              f"{e['measured_peak_reserved_bytes'] / 1e9:.2f} GB), {e['seconds']:.1f} s "
              f"(measured {e['measured_seconds']:.1f} s)", flush=True)
        result["state_modes"] = modes = state_modes(parent, gpu, Path(d))
        print(f"\n{'distill mode':<20}{'peak GB':>9}{'est. GB':>9}{'s':>7}{'est. s':>8}{'KL after':>10}")
        for r in modes:
            print(f"{r['mode']:<20}" + (r["error"] if "error" in r else
                  f"{r['peak_reserved_bytes'] / 1e9:>9.2f}{r['estimate_bytes'] / 1e9:>9.2f}{r['seconds']:>7.1f}"
                  f"{r['estimate_seconds']:>8.1f}{r['kl_after']:>10.4f}"), flush=True)
        search, plan = child_plan(lib, parent, args.target, args.scenario)
        child = search.child(search.rows_of(plan), weights=True)
        rows = decode_rows(parent, child, gpu, args.target, get_scenario(args.scenario))
        result["decode"] = {"target": args.target, "speedup": search.c.speedup, "child_params": plan.params_total,
                            "parent_params": parent.param_counts()["total"], "rows": rows}
        print(f"\ndecode step, parent vs {search.c.speedup:g}x child ({plan.params_total:,} params) on {result['gpu']};"
              f" predicted: analytic {args.target}")
        print(f"{'batch':>6}{'parent ms':>11}{'child ms':>10}{'parent tok/s':>14}{'child tok/s':>13}"
              f"{'measured':>10}{'predicted':>11}")
        for r in rows:
            print(f"{r['batch']:>6}{r['parent_ms']:>11.3f}{r['child_ms']:>10.3f}{r['parent_tok_s']:>14.0f}"
                  f"{r['child_tok_s']:>13.0f}{r['measured_ratio']:>9.2f}x{r['predicted_ratio']:>10.2f}x")
        left = DEADLINE_S - (time.perf_counter() - start)
        result["vs_transformers"] = vt = vs_transformers(Path(d), max(60.0, left))
    ran = f"exit {vt.get('returncode')} in {vt.get('seconds', 0):.0f} s"
    print(f"\nvs_transformers: {vt.get('skipped') or ran}")
    if vt.get("tail"):
        print(vt["tail"][-1200:])
    result["seconds"] = time.perf_counter() - start
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out} ({result['seconds']:.0f} s)")
    return 0 if tests["returncode"] == 0 and vt.get("returncode") in (0, None) else 1  # (None: skipped, or cut)


if __name__ == "__main__":
    sys.exit(main())
