"""The headline, measured on text no method saw: the built-in model compressed for a load-independent target
(h100, decode-heavy, --speedup times the parent's predicted serving throughput; analytic, so the same children
on any machine), under the default engine profile (what vLLM, SGLang and TensorRT-LLM all load).

1. Learning rate: the MIP child distilled at each --lrs for the middle budget, judged by distillation's own
   keep-best evaluations (the `selection` set); the best is used below.
2. Recovery against budget: the MIP, greedy and uniform children, each distilled for every --budgets steps and
   then given head-only MTP recovery, per seed. Report-set KL to the parent, top-1 agreement, bits per byte and
   MTP acceptance length; the share of the pruned child's KL that distillation recovered.
3. Iterative Puzzle: one step against 2 and 3 rounds (--rounds) at the same target and the same total steps
   (--iterative-steps, default the largest budget), per seed: mean and spread. The rounds before the last
   repair milder cuts and take their own learning rate (--early-lrs, chosen on the selection set); each
   round's distillation is listed (selection-set KL pruned and best, and the best step). `by-damage` splits the
   steps by the damage each round's search predicts instead of equally.
4. Throughput: the search's predicted h100 ratio, and decode tokens/s measured here against the cpu cost
   model's prediction for the same step (tools.compress_outputs.decode_figures).

Held-out text: the library scored on the `scoring` set, keep-best chose on the `selection` set, every figure of
2-4 is on the `report` set (data.HELD_OUT); the script prints the byte ranges. Each finished cell is stored in
--results (JSON) as it ends, so a rerun resumes.

Run: python benchmarks/compress.py [--library DIR] [--budgets 75,300,1200] [--seeds 0,1,2] [--results FILE]
(--methods and --seeds split the cells over processes, each with its own --results; a run given every
results file merged runs no cell again and prints the tables.)
Without --library the default library is built first (a few minutes on 2 cores).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from puzzlekit import evaluation as evaluate
from puzzlekit.backends.cost import get_scenario
from puzzlekit.backends.torch import materialize
from puzzlekit.text.data import HELD_OUT, held_out_windows, load_corpus
from puzzlekit.ir.printer import format_table
from puzzlekit.outputs import write_json
from puzzlekit.passes import AnalysisManager, PassError, PassManager
from puzzlekit.passes.puzzle import Library, build_library
from puzzlekit.tools.compress_outputs import decode_figures
from puzzlekit.tools.default_model import load_default

METHODS = ("mip", "greedy", "uniform")


def report_figures(model, teacher, windows, prompts) -> dict:
    """KL / top-1 to the parent, bits per byte and MTP acceptance on the report set."""
    return {**evaluate.teacher_agreement(teacher, model, windows), "bpb": evaluate.bits_per_byte(model, windows),
            "accept": evaluate.acceptance_length(model, prompts, 3, 32)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--library")
    ap.add_argument("--speedup", type=float, default=2.0)
    ap.add_argument("--budgets", default="75,300,1200", help="distillation steps (batch 8 x 128 tokens)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--rounds", default="2,3")
    ap.add_argument("--methods", default=",".join(METHODS), help="which children's recovery curves to run")
    ap.add_argument("--iterative-steps", type=int, help="total steps of the Iterative Puzzle comparison "
                    "(default: the largest budget)")
    ap.add_argument("--lrs", default="3e-4,1e-3,3e-3")
    ap.add_argument("--early-lrs", default="1e-4,3e-4,1e-3", help="learning rates for Iterative Puzzle's rounds "
                    "before the last, chosen on the selection set")
    ap.add_argument("--lr", type=float, help="use this learning rate (an earlier sweep's choice) instead of sweeping")
    ap.add_argument("--parts", default="budgets,iterative,decode",
                    help="which of budgets, iterative, by-damage (Iterative Puzzle, steps by damage), decode to run")
    ap.add_argument("--head-steps", type=int, default=100)
    ap.add_argument("--results", default="compress-results.json")
    args = ap.parse_args()
    budgets, seeds = [int(b) for b in args.budgets.split(",")], [int(s) for s in args.seeds.split(",")]
    rounds, lrs = [int(r) for r in args.rounds.split(",")], [float(x) for x in args.lrs.split(",")]
    results = json.loads(Path(args.results).read_text()) if Path(args.results).exists() else {}

    def cell(key: str, fn):
        if key not in results:
            t = time.perf_counter()
            results[key] = {**fn(), "seconds": round(time.perf_counter() - t, 1)}
            write_json(Path(args.results), results)
            print(f"  {key}: {results[key]}", flush=True)
        return results[key]

    parent = load_default()
    lib = Library.open(args.library, parent) if args.library else \
        build_library(parent, Path(tempfile.mkdtemp()) / "library", progress=True)
    corpus = load_corpus(None)
    windows = held_out_windows(corpus, "report", 257, limit=16)
    prompts = held_out_windows(corpus, "report", 64, limit=8)
    teacher = materialize(parent)
    start = 0
    for role in HELD_OUT:
        n = len(corpus.held_out(role))
        print(f"{role} set: held-out bytes {start:,}..{start + n:,}")
        start += n
    print(f"report figures: {len(windows)} windows of 257 bytes and {len(prompts)} prompts of 64 bytes from the "
          f"start of the report set; library {lib.path} scored on {lib.manifest.get('scored_on')}\n")
    search = f"library={lib.path},target=[h100],scenario=decode-heavy,speedup={args.speedup}"

    def run(prog, pipeline: str):
        am = AnalysisManager(prog)
        am.snapshots["teacher"] = parent
        PassManager(pipeline).run(prog, am)
        return am

    def kd(steps: int, lr: float, seed: int) -> str:
        return f"batch=8,seq=128,lr={lr},eval_every={max(steps // 6, 1)},eval_windows=8,seed={seed}"

    pruned, plans = {}, {}
    cell("parent", lambda: report_figures(teacher, teacher, windows, prompts))
    for m in METHODS:
        prog = parent.copy()
        try:
            am = run(prog, f"puzzle{{{search},method={m}}}")
        except PassError as e:  # e.g. no uniform cut of the grid reaches the target under the profile
            print(f"{m}: no child ({str(e).splitlines()[0]})")
            continue
        pruned[m], plans[m] = prog, am.reports["puzzle"][-1]
        cell(f"{m}/pruned", lambda: {**report_figures(materialize(prog), teacher, windows, prompts),
                                     "params": prog.param_counts()["total"],
                                     "predicted_ratio": plans[m]["throughput_ratio"]})

    # 1. the learning rate, on the selection set
    mid = budgets[len(budgets) // 2]

    def sweep(lr):
        rep = run(pruned["mip"].copy(), f"distill{{steps={mid},{kd(mid, lr, 0)}}}").reports["distill"][-1]
        return {"selection_kl": (rep["best"] or rep["after"])["kl"]}

    lr = args.lr
    if lr is None:
        by_lr = {lr: cell(f"lr/{lr:g}", lambda: sweep(lr))["selection_kl"] for lr in lrs}
        lr = min(by_lr, key=by_lr.get)
        print(f"learning rate {lr:g}: least selection-set KL after {mid} steps ({by_lr})")
    parts = args.parts.split(",")

    # 2. recovery against budget
    def distilled(m, steps, seed):
        prog = pruned[m].copy()
        head = f"distill{{head_only=true,steps={args.head_steps},{kd(args.head_steps, lr, seed)}}}"
        run(prog, f"distill{{steps={steps},{kd(steps, lr, seed)}}},{head}")
        return report_figures(materialize(prog), teacher, windows, prompts)

    for steps in budgets if "budgets" in parts else ():
        for seed in seeds:
            for m in [m for m in pruned if m in args.methods.split(",")]:
                cell(f"{m}/{steps}/{seed}", lambda: distilled(m, steps, seed))

    # 3. Iterative Puzzle at the same total steps. The rounds before the last repair a milder cut than one step
    # does and take their own learning rate, chosen like the one-step's on the selection set: round 1 of 2
    # distilled for its share of the steps at each --early-lrs.
    top = args.iterative_steps or budgets[-1]

    def rounds_of(n, seed, early_lr, last=None, by_damage=False):
        """Rounds 1..last of n (puzzle, then distill at early_lr before the last round, lr in it), with each
        round's distillation on the selection set: pruned, best, at which step. Steps: equal per round, or
        (`by_damage`) a round before the last takes the share of the total that its search's objective (the
        damage it predicts) is of the one-step search's, and the last round the rest."""
        prog, log, spent = parent.copy(), [], 0
        am = AnalysisManager(prog)
        am.snapshots["teacher"] = parent
        for i in range(1, (last or n) + 1):
            am.round = (i, n)
            r_lr = lr if i == n else early_lr
            PassManager(f"puzzle{{{search},parent=teacher}}").run(prog, am)
            share = am.reports["puzzle"][-1]["objective"] / plans["mip"]["objective"]
            steps = top // n if not by_damage else top - spent if i == n else max(6, round(top * share))
            spent += steps
            PassManager(f"distill{{steps={steps},{kd(steps, r_lr, seed)}}}").run(prog, am)
            d = am.reports["distill"][-1]
            log.append({"lr": r_lr, "steps": steps, "best_step": d["best"]["step"],
                        "selection_kl": [round(d["before"]["kl"], 5), round(d["best"]["kl"], 5)]})
        return prog, am, log

    early = None
    if "iterative" in parts or "by-damage" in parts:
        def round_one(x):
            return {"selection_kl": rounds_of(2, 0, x, last=1)[2][0]["selection_kl"][1]}

        by_lr = {x: cell(f"early-lr/{x:g}", lambda: round_one(x))["selection_kl"]
                 for x in [float(v) for v in args.early_lrs.split(",")]}
        early = min(by_lr, key=by_lr.get)
        print(f"rounds before the last at learning rate {early:g}: least selection-set KL of round 1 of 2 after "
              f"{top // 2} steps ({by_lr})")

    def iterative(n, seed, by_damage=False):
        prog, am, log = rounds_of(n, seed, early, by_damage=by_damage)
        run(prog, f"distill{{head_only=true,steps={args.head_steps},{kd(args.head_steps, lr, seed)}}}")
        return {**report_figures(materialize(prog), teacher, windows, prompts),
                "params": prog.param_counts()["total"], "predicted_ratio": am.reports["puzzle"][-1]["throughput_ratio"],
                "rounds": log, "bld": [r.get("bld") for r in am.reports["puzzle"]]}

    for n in rounds if "iterative" in parts else ():
        for seed in seeds:
            cell(f"iterative{n}/{top}/{seed}", lambda: iterative(n, seed))
    for n in rounds if "by-damage" in parts else ():
        for seed in seeds:
            cell(f"iterative{n}-by-damage/{top}/{seed}", lambda: iterative(n, seed, by_damage=True))

    # 4. throughput: decode at batch 8 after 256 tokens, measured here and predicted by the cpu cost model
    chat = get_scenario("chat")
    speed = {m: cell(f"{m}/decode", lambda: decode_figures(p, "cpu", chat, 8, 256))
             for m, p in ({"parent": parent, **pruned} if "decode" in parts else {}).items()}
    print_tables(results, budgets, seeds, rounds, lr, top, speed)


def _stats(values) -> str:
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values) if len(values) > 1 else 0.0:.4f}"


def print_tables(results, budgets, seeds, rounds, lr, top, speed) -> None:
    """The recovery table with the goals at the largest budget; Iterative Puzzle at `top` steps in total."""
    largest, parent = budgets[-1], results["parent"]
    methods = [m for m in METHODS if f"{m}/pruned" in results]
    rows = [("child", "steps", "KL (mean ± sd)", "top-1", "bits/byte", "MTP accept", "KL recovered")]
    for m in methods:
        p = results[f"{m}/pruned"]
        rows.append((m, "0 (pruned)", f"{p['kl']:.4f}", f"{p['top1_agreement']:.3f}", f"{p['bpb']:.4f}",
                     f"{p['accept']:.3f}", "-"))
        for steps in budgets:
            cells = [results[f"{m}/{steps}/{s}"] for s in seeds if f"{m}/{steps}/{s}" in results]
            if cells:
                rec = [1 - c["kl"] / p["kl"] for c in cells]
                rows.append((m, str(steps), _stats([c["kl"] for c in cells]),
                             f"{np.mean([c['top1_agreement'] for c in cells]):.3f}",
                             f"{np.mean([c['bpb'] for c in cells]):.4f}", _stats([c["accept"] for c in cells]),
                             f"{np.mean(rec):.0%}"))
    print(f"\nReport-set figures (parent: bits/byte {parent['bpb']:.4f}, MTP acceptance {parent['accept']:.3f}); "
          f"distillation at lr {lr:g} + head-only MTP recovery; {len(seeds)} seeds")
    print(format_table(rows), end="")
    pairs = {m: [(results[f"mip/{largest}/{s}"]["kl"], results[f"{m}/{largest}/{s}"]["kl"]) for s in seeds
                 if f"{m}/{largest}/{s}" in results and f"mip/{largest}/{s}" in results] for m in methods if m != "mip"}
    mip = [results[f"mip/{largest}/{s}"] for s in seeds if f"mip/{largest}/{s}" in results]
    if mip:
        rec = np.mean([1 - c["kl"] / results["mip/pruned"]["kl"] for c in mip])
        print(f"goals at {largest} steps: MIP recovers {rec:.0%} of its pruned KL (goal >= 50%); its MTP acceptance "
              f"{np.mean([c['accept'] for c in mip]):.3f} against the parent's {parent['accept']:.3f} (goal >=); "
              + "; ".join(f"MIP beats {m} in {sum(a < b for a, b in p)} of {len(p)} seeds" for m, p in pairs.items()))
    rows = [("strategy", "KL (mean ± sd)", "top-1", "MTP accept", "params", "predicted h100 ratio")]
    for name, key in [("one step", "mip/{}/{}")] + [(f"{n} rounds", f"iterative{n}/{{}}/{{}}") for n in rounds] + \
            [(f"{n} rounds, steps by damage", f"iterative{n}-by-damage/{{}}/{{}}") for n in rounds]:
        cells = [results[key.format(top, s)] for s in seeds if key.format(top, s) in results]
        if cells:
            extra = results["mip/pruned"] if name == "one step" else cells[0]
            rows.append((name, _stats([c["kl"] for c in cells]), f"{np.mean([c['top1_agreement'] for c in cells]):.3f}",
                         _stats([c["accept"] for c in cells]), f"{extra['params']:,}", f"{extra['predicted_ratio']:.2f}"))
    print(f"\nIterative Puzzle at {top} distillation steps in total")
    print(format_table(rows), end="")
    if not speed:
        return
    print("\nDecode at batch 8 after 256 tokens, tokens/s: measured here, and the cpu cost model's prediction of the "
          "same step")
    base = speed.get("parent")
    for name, s in speed.items():
        print(f"  {name}: measured {s['measured']:,.0f} ({s['measured'] / base['measured']:.2f}x), predicted "
              f"{s['predicted']:,.0f} ({s['predicted'] / base['predicted']:.2f}x)")


if __name__ == "__main__":
    main()
