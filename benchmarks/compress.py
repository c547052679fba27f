"""The headline: the built-in model compressed to 2x its `cpu` decode throughput, side by side in one run:
the MIP child and the `uniform` baseline (one search + distillation each), and one-step against Iterative
Puzzle at the same final target and the same total distillation steps; every child then gets head-only MTP
recovery. Prints KL / top-1 agreement to the parent, bits per byte and MTP acceptance length at each stage,
measured decode throughput and its ratio to the parent's next to the search's prediction, the distillation
losses over steps and the time per stage.

Run: OMP_NUM_THREADS=1 python benchmarks/compress.py [--library DIR] [--steps 300] [--rounds 3]
Without --library the default library is built first (about 4 minutes on 2 cores). One thread keeps the
cpu provider's timings and the measured throughput comparable on a shared machine.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from puzzlekit import evaluate
from puzzlekit.backends.torch import materialize
from puzzlekit.data import load_corpus, sequential_windows
from puzzlekit.ir.printer import format_table
from puzzlekit.passes import AnalysisManager, PassError, PassManager
from puzzlekit.passes.puzzle import Library, build_library
from puzzlekit.tools.default_model import load_default
from timing import median_seconds


def measure(prog, teacher, held, prompts) -> dict:
    model = materialize(prog)
    return {**evaluate.teacher_agreement(teacher, model, held), "bpb": evaluate.bits_per_byte(model, held),
            "accept": evaluate.acceptance_length(model, prompts, 3, 32)}


@torch.no_grad()
def decode_throughput(prog, batch: int, context: int = 256) -> float:
    """Tokens per second of one decode step at `batch` after a `context`-token prefill (median)."""
    model = materialize(prog)
    ids = torch.randint(0, 256, (batch, context), generator=torch.Generator().manual_seed(0))
    _, state = model.prefill(ids)
    tok = ids[:, -1]
    return batch / median_seconds(lambda: model.decode(tok, state), repeats=15, warmup=3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--library")
    ap.add_argument("--speedup", type=float, default=2.0)
    ap.add_argument("--steps", type=int, default=300, help="distillation steps in total (split over the rounds)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--head-steps", type=int, default=100)
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()
    clock: dict[str, float] = {}

    def timed(stage, fn):
        t = time.perf_counter()
        out = fn()
        clock[stage] = clock.get(stage, 0.0) + time.perf_counter() - t
        return out

    parent = load_default()
    lib_dir = args.library or str(Path(tempfile.mkdtemp()) / "library")
    lib = Library.open(lib_dir, parent) if args.library else \
        timed("library", lambda: build_library(parent, lib_dir, progress=True))
    corpus = load_corpus(None)
    held = sequential_windows(corpus.valid, 257, limit=16)
    prompts = sequential_windows(corpus.valid[len(corpus.valid) // 2:], 64, limit=8)
    teacher = materialize(parent)
    search = f"library={lib.path},target=[cpu],scenario=chat,speedup={args.speedup}"
    kd = f"batch=8,seq=128,lr={args.lr},eval_every=50,eval_windows=8"
    head = f"distill{{head_only=true,steps={args.head_steps},{kd}}}"
    rows = [("stage", "KL", "top-1", "bits/byte", "MTP accept", "params")]
    losses, children = {}, {}

    def stage(name, prog):
        m = timed("evaluate", lambda: measure(prog, teacher, held, prompts))
        rows.append((name, f"{m['kl']:.4f}", f"{m['top1_agreement']:.3f}", f"{m['bpb']:.4f}", f"{m['accept']:.3f}",
                     f"{prog.param_counts()['total']:,}"))

    stage("parent", parent)
    strategies = (("MIP one-step", f"puzzle{{{search}}},distill{{steps={args.steps},{kd}}}"),
                  ("uniform one-step", f"puzzle{{{search},method=uniform}},distill{{steps={args.steps},{kd}}}"),
                  (f"MIP iterative x{args.rounds}", f"repeat{{n={args.rounds}}}(puzzle{{{search},parent=teacher}},"
                                                    f"distill{{steps={args.steps // args.rounds},{kd}}})"))
    for strategy, pipeline in strategies:
        prog = parent.copy()
        am = AnalysisManager(prog)
        am.snapshots["teacher"] = parent
        if "iterative" not in strategy:  # the pruned child before any recovery
            pruned = prog.copy()
            first = pipeline.split(",distill")[0]
            try:
                timed("search", lambda: PassManager(first).run(pruned, AnalysisManager(pruned)))
            except PassError as e:  # e.g. no uniform cut of the grid reaches the target
                rows.append((f"{strategy}: no child", str(e).splitlines()[0][-60:], "", "", "", ""))
                continue
            stage(f"{strategy}: pruned (BLD variants)", pruned)
        timed(strategy, lambda: PassManager(pipeline).run(prog, am))
        stage(f"{strategy}: distilled", prog)
        losses[strategy] = [r for rep in am.reports["distill"] for r in rep["log"]]
        timed("head-only", lambda: PassManager(head).run(prog, am))
        stage(f"{strategy}: + head-only MTP", prog)
        children[strategy] = (prog, am.reports["puzzle"][-1])

    print(f"Recovery at {args.speedup}x cpu decode throughput, {args.steps} distillation steps in total "
          f"(+{args.head_steps} head-only); KL / top-1 against the parent on {held.numel():,} held-out bytes:")
    print(format_table(rows), end="")
    print("\nthroughput (decode after a 256-token prompt, measured, at the search's batch for each; the search's "
          "prediction is throughput at the rate floor)")
    for name, (prog, plan) in children.items():
        ours = decode_throughput(prog, plan["batch"])
        theirs = decode_throughput(parent, plan["parent_batch"])
        predicted = plan["throughput_ratio"]
        print(f"  {name}: {ours:,.0f} tokens/s at batch {plan['batch']} against the parent's {theirs:,.0f} at batch "
              f"{plan['parent_batch']}: {ours / theirs:.2f}x measured, {predicted:.2f}x predicted (target {args.speedup}x)")
    print("\ndistillation losses (KL to the teacher, every 25 steps):")
    for name, log in losses.items():
        print(f"  {name}: " + " ".join(f"{r['kl']:.4f}" for r in log[::25]))
    print("\nseconds per stage: " + ", ".join(f"{k} {v:.0f}" for k, v in clock.items()))


if __name__ == "__main__":
    main()
