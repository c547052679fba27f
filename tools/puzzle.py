"""`puzzlekit library`: build a model's block library (Puzzle's expensive, target-independent half)."""
from __future__ import annotations

import math
import time
from pathlib import Path

from ..outputs import atomic_file

#: help of --extended (run, plan)
EXTENDED_HELP = ("write puzzlekit's extended form (puzzlekit_nemotron_h) for programs the published nemotron_h_puzzle "
                 "schema cannot express (noop or linear blocks, Mamba layers that differ); no serving engine loads it")
#: most solutions `plan --alternatives` asks for: each is one more MIP solve
MAX_ALTERNATIVES = 100
#: most speedups one `plan --sweep` plans at (each is a MIP solve)
MAX_SWEEP_POINTS = 100
#: what matplotlib writes, by suffix (`--report`)
PLOT_SUFFIXES = (".png", ".pdf", ".svg")
#: size classes of the summary: a variant's parameters as a share of its parent block's, at most
SIZE_CLASSES = ((0.25, "<=25%"), (0.5, "<=50%"), (0.75, "<=75%"), (0.999999, "<100%"))


def summary_rows(lib) -> list[tuple]:
    """Per layer: kind, variant count, and the best score (KL) in each size class."""
    rows = [("layer", "kind", "variants", *(f"best KL {name}" for _, name in SIZE_CLASSES))]
    for layer, vs in lib.layers().items():
        parent = next(r for r in vs if r["id"] == "parent")
        best = {}
        for r in vs:
            share = r["params"] / max(parent["params"], 1)
            cls = next((name for hi, name in SIZE_CLASSES if share <= hi), None)
            if cls:
                best[cls] = min(best.get(cls, float("inf")), r["scores"]["kl"])
        rows.append((str(layer), parent["kind"], str(len(vs)),
                     *(f"{best[name]:.4f}" if name in best else "-" for _, name in SIZE_CLASSES)))
    return rows


def run_library(args) -> int:
    from ..ir.printer import format_table
    from ..passes.puzzle import LibrarySettings, build_library
    from .common import compute_of, emit, load_model

    from .estimate import check_before_run, library_passes

    compute = compute_of(args)
    prog = load_model(args)
    if args.estimate:  # from the config and the options alone
        check_before_run(args, library_passes(args), prog, writes=False)
        return 0
    if not prog.is_meta:  # a weightless library (a bare config) reads no text and has no stage to check
        from ..text.data import corpus_for, require_windows

        require_windows(corpus_for(prog, args.data or None), "scoring", args.seq + 1, "library --seq")
        check_before_run(args, library_passes(args), prog, writes=False, announce=True)
    settings = LibrarySettings(calib_windows=args.calib_windows, score_windows=args.score_windows, seq=args.seq,
                               bld_tokens=args.bld_tokens, bld_lr=args.bld_lr, data=list(args.data or []))
    start = time.monotonic()
    lib = build_library(prog, Path(args.output), args.grid, settings, progress=not args.json, compute=compute)
    seconds = time.monotonic() - start
    mode = "weightless (sizes only: no BLD, no scores)" if lib.weightless else "trained and scored"
    text = f"{len(lib.layers())} layers, {len(lib.rows)} variants, {mode}, in {seconds:.1f} s\n"
    if not lib.weightless:
        text += format_table(summary_rows(lib))
    text += f"wrote {lib.path}\n"
    emit(args, {"library": str(lib.path), "layers": len(lib.layers()), "variants": len(lib.rows),
                "weightless": lib.weightless, "seconds": seconds, "rows": lib.rows}, text)
    return 0


def add_parser(sub, model_help: str, positive_int, positive_float):
    from .estimate import add_estimate_arguments

    p = sub.add_parser("library", help="build a model's block library: variants per layer, BLD, scores")
    p.add_argument("model", nargs="?", help=model_help)
    p.add_argument("--output", "-o", required=True, help="library directory (the same command again resumes)")
    p.add_argument("--grid", help="grid TOML file (default: passes/puzzle/default-grid.toml)")
    p.add_argument("--bld-tokens", type=positive_int, default=65536, help="BLD training tokens per variant")
    p.add_argument("--bld-lr", type=positive_float, default=1e-3, help="BLD peak learning rate")
    p.add_argument("--calib-windows", type=positive_int, default=64, help="calibration windows of --seq tokens "
                                                                               "(importance, BLD)")
    p.add_argument("--score-windows", type=positive_int, default=16, help="held-out windows for scoring")
    p.add_argument("--seq", type=positive_int, default=256, help="tokens per window")
    p.add_argument("--data", nargs="*", help="text files, directories, .jsonl, .parquet, a datasets directory or a hub "
                                             "dataset (default: the Python stdlib)")
    add_estimate_arguments(p)
    p.set_defaults(run=run_library)
    return p


def _alternatives_line(plan, args) -> str:
    if args.alternatives == 1:
        return ""
    asked, found = args.alternatives - 1, len(plan.alternatives)
    why = "" if found == asked else f" (no more differ in >= {args.min_distance} layers, or " \
                                     f"--alternatives-seconds {args.alternatives_seconds:g} ran out)"
    return f"\nrunners-up: {found} of {asked} found{why}; --json lists them"


def run_plan(args) -> int:
    from .. import ir
    from ..ir.printer import format_table
    from ..passes.puzzle import Library
    from ..passes.puzzle.search import Search
    from ..errors import UsageError
    from .common import emit, scenario_of, warn_unrunnable_recipe

    report_path(args)  # before any work, as the sweep's points are
    if args.sweep:
        sweep_points(args.sweep)
    lib = Library.open(args.library)
    parent = ir.load(args.parent or lib.manifest["parent"]["source"])
    lib.check(parent)
    scenarios = args.scenario or ["decode-heavy"]
    if len(scenarios) not in (1, len(args.target)):
        raise UsageError(f"give one --scenario for all targets or one per --target ({len(args.target)})")
    scenarios = [scenario_of(args, parent, s) for s in scenarios]
    targets = list(zip(args.target, scenarios * len(args.target) if len(scenarios) == 1 else scenarios))
    warn_unrunnable_recipe(args.recipe, args.target)
    if args.sweep:  # the sweep's speedups are its constraint
        args.speedup = sweep_points(args.sweep)[0]
    c = constraints_of(args)
    if args.sweep:
        return _sweep(args, lib, parent, targets, c)
    search = Search(lib, parent, targets, args.recipe or "", args.metric, c, engine=args.engine, prices=args.prices)
    plan = search.plan(args.method, args.alternatives, args.min_distance,
                       alternatives_seconds=args.alternatives_seconds)
    if args.output:
        child = search.child(search.rows_of(plan), weights=not lib.weightless)
        child.meta["provenance"] = {"plan": plan.to_json(), "library": str(lib.path),
                                    "parent": lib.manifest["parent"]["hash"]}
        ir.save(child, args.output, overwrite=args.overwrite, extended=args.extended)
    rows = [("layer", "parent", "child")] + [
        (str(p["layer"]), lib.rows[[r["layer"] for r in lib.rows].index(p["layer"])]["kind"], p["label"])
        for p in plan.layers]
    figures = [("constraint", "parent", "child", "bound")] + [
        (k, f"{plan.parent[k]:.6g}", f"{plan.predicted[k]:.6g}", f"{plan.limits[k]:.6g}") for k in plan.predicted]
    pc = parent.param_counts()
    text = (format_table(rows) + format_table(figures) +
            f"params {pc['total'] / 1e9:.3f}B -> {plan.params_total / 1e9:.3f}B total, {pc['active'] / 1e9:.3f}B -> "
            f"{plan.params_active / 1e9:.3f}B active\n"
            f"{args.method}: objective {plan.objective:.6g} ({plan.score_source} scores), {plan.status}, "
            f"solved in {plan.solve_seconds:.2f} s" + _alternatives_line(plan, args)
            + (f"\nwrote {args.output}" if args.output else "") + "\n")
    emit(args, plan.to_json(), text)
    return 0


def add_constraint_arguments(p, positive_int, positive_float) -> None:
    """The deployment constraints `plan` and `compress` take (see search.Constraints)."""
    p.add_argument("--speedup", type=positive_float, help="throughput >= X times the parent's at the rate floor")
    p.add_argument("--decode-ms", type=positive_float, help="decode-step latency at batch 1, milliseconds")
    p.add_argument("--prefill-s", type=positive_float, help="prefill of the scenario's input, seconds")
    p.add_argument("--concurrency", type=positive_int, help="requests that must fit in memory")
    p.add_argument("--context", type=positive_int, help="tokens per request for --concurrency (default: scenario)")
    p.add_argument("--max-params", type=positive_float, help="total parameters at most")
    p.add_argument("--max-active", type=positive_float, help="active parameters per token at most")
    p.add_argument("--keep", action="append", default=[], help="block kind kept intact, e.g. attention")
    p.add_argument("--engine", default="all", choices=["all", "vllm", "tensorrt-llm", "sglang", "none"],
                   help="the serving engine the child must load in (default all: what vLLM, TensorRT-LLM and SGLang "
                        "all load: uniform Mamba geometry, no noop/linear blocks, their MTP head form); none lifts "
                        "the rules (with --extended)")


def constraints_of(args):
    """search.Constraints from those options; at least one must bound something."""
    from ..passes.puzzle.search import Constraints
    from ..errors import UsageError

    c = Constraints(speedup=args.speedup or 0.0, decode_ms=args.decode_ms or 0.0, prefill_s=args.prefill_s or 0.0,
                    concurrency=args.concurrency or 0, context=args.context or 0, max_params=args.max_params or 0.0,
                    max_active=args.max_active or 0.0, keep=tuple(args.keep), uniform=tuple(getattr(args, "uniform", ())),
                    mtp_acceptance=getattr(args, "child_mtp_acceptance", None) or 0.0)
    if not any((c.speedup, c.decode_ms, c.prefill_s, c.concurrency, c.max_params, c.max_active)):
        raise UsageError("the search needs a deployment target: name at least one constraint: --speedup, "
                         "--decode-ms, --prefill-s, --concurrency, --max-params or --max-active")
    return c


def add_plan_parser(sub, positive_int, positive_float):
    from .common import add_workload_arguments, number

    p = sub.add_parser("plan", help="search a block library for the architecture that meets a deployment target")
    p.add_argument("library", help="a library directory (puzzlekit library)")
    p.add_argument("--parent", help="the parent model (default: the one the library was built from)")
    p.add_argument("--target", action="append", required=True, help="h100, 8xb200, cpu, ... (repeatable)")
    p.add_argument("--scenario", action="append", help="decode-heavy, long-1m, ..., or a .toml file (one, or one "
                                                         "per --target)")
    p.add_argument("--recipe", help="weight precisions for costing: bf16, fp8, nvfp4, nvfp4-hybrid")
    add_constraint_arguments(p, positive_int, positive_float)
    add_workload_arguments(p)
    p.add_argument("--child-mtp-acceptance", type=number(float, 1),
                   help="with --mtp: the child's head's acceptance length (default: the parent's)")
    p.add_argument("--uniform", action="append", default=[], help="KIND.AXIS equal in every layer, e.g. mamba2.state")
    p.add_argument("--metric", default="kl", help="score minimised: kl, lm_loss, ... (as recorded)")
    p.add_argument("--method", default="mip", choices=["mip", "uniform", "greedy"])
    p.add_argument("--alternatives", type=number(int, 1, MAX_ALTERNATIVES), default=1,
                   help=f"solutions to report: the best and diverse runners-up (at most {MAX_ALTERNATIVES})")
    p.add_argument("--alternatives-seconds", type=positive_float, default=60.0,
                   help="stop seeking runners-up after this long (default 60)")
    p.add_argument("--min-distance", type=positive_int, default=1, help="layers each alternative differs in")
    p.add_argument("--output", "-o", help="write the child checkpoint here")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--extended", action="store_true", help=EXTENDED_HELP)
    p.add_argument("--sweep", metavar="LO:HI:STEP|X,Y,...", help="what-if: plan at each speedup of a range or list "
                                                               "(one table; prices shared across the points; at most "
                                                               f"{MAX_SWEEP_POINTS} points)")
    p.add_argument("--report", metavar="FILE.png", help="--sweep: plot score, parameters and throughput per point "
                                                        f"(a {', '.join(PLOT_SUFFIXES)} file in an existing folder)")
    p.set_defaults(run=run_plan)
    return p


def sweep_points(text: str) -> list[float]:
    """`1.2:2.0:0.2` (both ends included) or `1.2,1.5,2`: the speedups a sweep plans at, each finite and > 0, at
    most MAX_SWEEP_POINTS: the count of a range is computed from its bounds before any point is made."""
    from ..errors import UsageError

    usage = (f"--sweep {text!r}: give LO:HI:STEP (finite, 0 < LO <= HI, STEP > 0) or a comma list of finite "
             f"speedups > 0, at most {MAX_SWEEP_POINTS} points, e.g. --sweep 1.2:2.0:0.2")
    try:
        values = [float(x) for x in (text.split(":") if ":" in text else [x for x in text.split(",") if x.strip()])]
    except ValueError:
        raise UsageError(usage) from None
    if not values or not all(math.isfinite(v) for v in values) or (":" in text and len(values) != 3):
        raise UsageError(usage)
    if ":" not in text:
        points = values
    else:
        lo, hi, step = values
        if step <= 0 or hi < lo:
            raise UsageError(usage)
        count = math.floor((hi - lo) / step + 1e-9) + 1
        if count > MAX_SWEEP_POINTS:
            raise UsageError(f"--sweep {text!r} makes {count:,} points; at most {MAX_SWEEP_POINTS}: take a larger "
                             "STEP or a narrower range")
        points = [round(lo + i * step, 9) for i in range(count)]
    if min(points) <= 0 or len(points) > MAX_SWEEP_POINTS:
        raise UsageError(usage)
    return points


def report_path(args) -> Path | None:
    """Before any work: `--report FILE` only with --sweep, in a folder that exists and can be written, with a
    suffix matplotlib writes (the path written is the path given, and the one printed)."""
    import os

    from ..errors import UsageError

    if not args.report:
        return None
    f = Path(args.report)
    if not args.sweep:
        raise UsageError("--report plots a sweep: give --sweep too (e.g. --sweep 1.2:2.0:0.2), or drop --report")
    if f.is_dir():
        raise UsageError(f"--report {f} is a directory; give a file name in it, e.g. {f / 'sweep.png'}")
    if f.suffix.lower() not in PLOT_SUFFIXES:
        raise UsageError(f"--report {f}: give a file name ending in {', '.join(PLOT_SUFFIXES)} (the plot's format)")
    folder = f.parent
    if not folder.is_dir():
        raise UsageError(f"--report {f}: the folder {folder} does not exist; create it or choose another")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"--report {f}: cannot write in {folder}; choose a writable folder")
    return f


def _sweep(args, lib, parent, targets, c) -> int:
    """One Search, its prices kept, planned at each speedup: a table (and a plot) of what each target costs."""
    import dataclasses

    from ..ir.printer import format_table
    from ..passes.puzzle.search import Search
    from ..passes.puzzle.search_types import PlanError
    from .common import emit

    points = sweep_points(args.sweep)
    search = Search(lib, parent, targets, args.recipe or "", args.metric, dataclasses.replace(c, speedup=points[0]),
                    engine=args.engine, prices=args.prices)
    rows = []
    for x in points:
        search.c = dataclasses.replace(search.c, speedup=x)
        try:
            plan = search.plan(args.method)
        except PlanError as e:
            rows.append({"speedup": x, "feasible": False, "why": str(e).splitlines()[0]})
            continue
        rows.append({"speedup": x, "feasible": True, "objective": plan.objective, "params": plan.params_total,
                     "active": plan.params_active, "throughput_ratio": search.throughput_ratio(plan),
                     "layout": plan.layout, "batch": plan.batch, "status": plan.status})
    table = [("speedup", "score", "params", "active", "throughput / parent", "layout", "batch")] + [
        (f"{r['speedup']:g}", f"{r['objective']:.6g}", f"{r['params']:,}", f"{r['active']:,}",
         f"{r['throughput_ratio']:.3f}", r["layout"], str(r["batch"])) if r["feasible"] else
        (f"{r['speedup']:g}", "infeasible", "-", "-", "-", "-", "-") for r in rows]
    report = report_path(args)
    if report:
        _sweep_plot([r for r in rows if r["feasible"]], report)
    emit(args, {"sweep": rows, **({"report": str(report)} if report else {})},
         format_table(table) + (f"wrote {report}\n" if report else ""))
    return 0


def _sweep_plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(9, 3.5))
    xs = [r["speedup"] for r in rows]
    ax[0].plot(xs, [r["objective"] for r in rows], "o-")
    ax[0].set(xlabel="speedup asked", ylabel="summed score (lower is better)")
    ax[1].plot(xs, [r["params"] / 1e9 for r in rows], "o-", label="params")
    ax[1].plot(xs, [r["active"] / 1e9 for r in rows], "^-", label="active")
    ax[1].set(xlabel="speedup asked", ylabel="parameters (B)")
    ax[1].legend(loc="lower left")
    ratio = ax[1].twinx()  # a ratio near the x axis, not squashed under 1e11 parameters
    ratio.plot(xs, [r["throughput_ratio"] for r in rows], "s--", color="tab:red")
    ratio.set_ylabel("throughput / parent (predicted)", color="tab:red")
    fig.tight_layout()
    with atomic_file(path) as tmp:  # a kill leaves the old plot or the new one
        fig.savefig(tmp, dpi=110, format=Path(path).suffix[1:].lower())
    plt.close(fig)
