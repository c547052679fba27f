"""`puzzlekit compress`: a model and a deployment target in; a compressed, recovered, quantised model, its
deployment artifacts and a report out.

It fills in tools/pipelines/compress.pipeline (or the user's copy) and runs it with stage checkpoints, then
writes the outputs (tools/compress_outputs.py), each skipped when a rerun finds it done:

    OUT/work/        stage checkpoints and distillation state (a rerun after a kill continues from here)
    OUT/library/     the block library (unless --library names an existing one)
    OUT/model/       the child checkpoint
    OUT/plan.json    the chosen architecture, the search's frontier and the measured figures
    OUT/bundle/      the target's deployment bundle (ONNX graphs, engine build files)
    OUT/report/      report.md and its plots
    OUT/cost-table.json  on the cpu target: the op timings every round and every rerun are priced from
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import string
import sys
import time
from pathlib import Path

from ..errors import PuzzlekitError, UsageError
from ..outputs import write_json, write_text
from .compress_outputs import SWEPT, deploy_recipe, outputs_work, write_outputs
from .puzzle import EXTENDED_HELP, add_constraint_arguments, constraints_of

# the head-only stage has its own budget: at the trunk's lr=1e-3 the head drifts from its start within 10 steps
# and keep-best threw the run away; lr=3e-4 on the head's own trunk (mtp_self) raises acceptance on the
# selection set (8 windows to choose on, not 2)
QUICK = {"library": "calib_windows=8,score_windows=2,seq=64,bld_tokens=4096",
         "distill": "batch=4,seq=64,lr=1e-3,eval_every=10,eval_windows=2,checkpoint_every=5",
         "head": "batch=4,seq=64,lr=3e-4,mtp_self=1.0,eval_every=10,eval_windows=8,checkpoint_every=10",
         "mtp": "prompts=2,new_tokens=16", "steps": 20, "head_steps": 40}
FULL = {"library": "calib_windows=64,score_windows=16,seq=256,bld_tokens=65536",
        "distill": "batch=8,seq=128,lr=1e-3,eval_every=50,eval_windows=8,checkpoint_every=25",
        "head": "batch=8,seq=128,lr=3e-4,mtp_self=1.0,eval_every=25,eval_windows=8,checkpoint_every=25",
        "mtp": "prompts=8,new_tokens=32", "steps": 300, "head_steps": 100}
def pipeline_text(template: str, args, out: Path, library: Path) -> str:
    """The template (a pipeline file's text) with its comments dropped and its $names filled in from the
    command's options."""
    template = " ".join(ln.split("#", 1)[0].strip() for ln in template.splitlines())
    budget = QUICK if args.quick else FULL
    steps = args.steps or budget["steps"]
    rounds = args.iterative
    c = constraints_of(args)
    constraints = [f"{k}={getattr(c, k)}" for k in SWEPT + ("context",) if getattr(c, k)]
    constraints += [f"keep=[{','.join(c.keep)}]"] if c.keep else []
    constraints += [f"engine={args.engine}"] + ([f"prices={args.prices}"] if args.prices else [])
    recipe = deploy_recipe(args.target)
    values = {"library": library, "library_budget": budget["library"] + (f",grid={args.grid}" if args.grid else ""),
              "rounds": rounds, "engine": args.engine, "target": args.target, "scenario": args.scenario,
              "constraints": ",".join(constraints),
              "round_steps": max(1, math.ceil(steps / rounds)), "distill_budget": budget["distill"],
              "work": out / "work", "head_steps": args.head_steps or budget["head_steps"],
              "mtp_tolerance": args.mtp_tolerance if args.mtp_tolerance is not None else 1.0 if args.quick else 0.1,
              "mtp_budget": budget["mtp"], "head_budget": budget["head"],
              "quantize": f"quantize{{recipe={recipe},target={args.target}}}" if recipe else "verify"}
    try:
        return string.Template(template).substitute({k: str(v) for k, v in values.items()})
    except (KeyError, ValueError) as e:
        raise PuzzlekitError(f"the compress pipeline uses an unknown ${e.args[0] if e.args else ''} name; "
                             f"known: {', '.join(sorted(values))}") from None


def _check_cost_table(args, out: Path) -> None:
    """Before any work: `--cost-table FILE` only where ops are timed (the cpu target), and the table read and
    checked (a corrupt or foreign file was silently timed anew, for minutes); a rerun's own table too."""
    from ..backends.measured import read_cost_table
    from ..backends.targets import get_target

    if get_target(args.target).kind != "cpu":
        if args.cost_table:
            raise UsageError(f"--cost-table: target {args.target} is priced analytically or from the measured "
                             "tables, not from timings; drop --cost-table")
        return
    if args.cost_table:
        src = Path(args.cost_table)
        if not src.is_file():
            raise UsageError(f"--cost-table {src}: no such file (a run's OUT/cost-table.json)")
        read_cost_table(src, "give the OUT/cost-table.json of an earlier `compress --target cpu` run, or drop "
                             "--cost-table to time the ops on this machine")
    elif (out / "cost-table.json").exists():
        read_cost_table(out / "cost-table.json", "delete it to time the ops anew (the rerun may choose another child)")


@contextlib.contextmanager
def _pinned_cost_table(args, out: Path):
    """On a measured (cpu) target, every round and every rerun of this run prices from one table of op
    timings, OUT/cost-table.json: timed once by the first run (or copied from `--cost-table FILE`), reused as it
    is afterwards, so a rerun gives the same child. Says which on stderr."""
    import shutil

    from ..backends.measured import COST_TABLE_ENV
    from ..backends.targets import get_target

    if get_target(args.target).kind != "cpu":  # (--cost-table was checked by _check_cost_table)
        yield
        return
    table = out / "cost-table.json"
    if args.cost_table:
        src = Path(args.cost_table)
        if src.resolve() != table.resolve():
            out.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, table)
        how = f"from {src} (the same child as the run that timed them)"
    elif table.exists():
        how = f"reused from {table} (this run's own: the same child as before)"
    else:
        how = (f"timed on this machine now and stored in {table}: they depend on the load, so another run "
               "would time them anew and may choose another child; a rerun, or --cost-table FILE, reuses them")
    print(f"cpu target: op timings {how}", file=sys.stderr)
    before = os.environ.get(COST_TABLE_ENV)
    os.environ[COST_TABLE_ENV] = str(table.resolve())
    try:
        yield
    finally:  # the process's other work (and tests in it) is not pinned
        if before is None:
            os.environ.pop(COST_TABLE_ENV, None)
        else:
            os.environ[COST_TABLE_ENV] = before


def compress(args, progress: bool = True) -> dict:
    """Runs every stage that has not finished; returns the summary (also OUT/work/summary.json)."""
    from .common import check_outputs, check_prices, compute_of
    from .default_model import model_path

    compute_of(args)  # before any work: a device this machine lacks is a usage error
    check_prices(args.target, args.prices)  # and prices the target cannot take (as `cost` refuses them)
    _check_cost_table(args, Path(args.output))  # and a cost table that is not one
    if getattr(args, "tasks", None):  # and a task whose data cannot be had, or options it cannot take
        from .tasks import check_task_options, load_tasks, task_names

        check_task_options(load_tasks(task_names(args.tasks), args.include_path), args.num_fewshot)
        check_outputs(args)  # the tasks' data files are inputs too
    if args.engine == "none" and not args.extended:
        raise UsageError("--engine none lets the search choose what no serving engine loads (noop or linear blocks, "
                         "Mamba layers that differ); add --extended to accept puzzlekit's extended form for such a child")
    out = Path(args.output)
    src = model_path(args.model).resolve()
    if out.resolve() == src or src in out.resolve().parents or out.resolve() in src.parents:
        raise PuzzlekitError(f"-o {out} would write into or around the input model {src}; choose another directory")
    from .. import ir
    from ..passes.puzzle.engines import get_engine

    parent = ir.load(src)  # its config and index: the weights are read when used
    if not args.estimate:  # a subword model without its tokenizer: refused first (the estimate needs none)
        from ..text.tokenizer import set_tokenizer, tokenizer_of

        set_tokenizer(parent, args.tokenizer)
        tokenizer_of(parent)
    get_engine(args.engine).check_parent(parent)  # a head no child of which the engines serve: before the library
    library = Path(args.library) if args.library else out / "library"
    with _workload(args, out) as scenario:
        args.scenario = scenario
        passes = _pipeline(args, out, library, parent)  # parsed once: auto's settings are set on these passes
        auto: list = []  # what auto chose, for the summary
        if _check_before_run(args, parent, passes, auto):
            return {}
        corpus = _text(args, parent)
        _check_held_out(passes, corpus, parent)
        with _pinned_cost_table(args, out):
            return _run(args, out, parent, passes, library, progress, auto)


def _pipeline(args, out: Path, library: Path, parent) -> list:
    """The run's passes: the pipeline template filled in from the options, less the head's work on a model
    without one."""
    from ..errors import read_text
    from ..passes import parse_pipeline, resolve_pipeline
    from ..passes.pipeline import PIPELINES_DIR

    template_file = Path(args.pipeline) if args.pipeline else PIPELINES_DIR / "compress.pipeline"
    text = pipeline_text(read_text(template_file, "pipeline", PuzzlekitError), args, out, library)
    return head_work(parse_pipeline(resolve_pipeline(text)), parent)


def _check_before_run(args, parent, passes: list, auto: list) -> bool:
    """The estimate of every stage from the parent's config and the options (tools/estimate.py): printed with
    --estimate (True: nothing more to do), otherwise a stage that cannot fit refuses the run before any work.
    The settings auto chooses are set on `passes` (and listed in `auto`)."""
    from .common import note_head_options
    from .estimate import check_before_run

    note_head_options(args, parent, {"head_steps": "--head-steps", "mtp_tolerance": "--mtp-tolerance"})
    if args.library:  # an existing library: no library stage to run
        passes = [p for p in passes if getattr(p, "pass_name", "") != "library"]
    return check_before_run(args, passes, parent, announce=True, plan=True, chosen=auto, outputs=outputs_work(args),
                            left_out="the engines' builds after the bundle, lm-eval tasks")


def _text(args, parent):
    """The data, checked to read and tokenized once (cached on disk): every stage reads it."""
    from ..text.data import corpus_for

    return corpus_for(parent, args.data, progress=not args.json and sys.stderr.isatty())


def _check_held_out(passes: list, corpus, parent) -> None:
    """Before any work: every held-out set the pipeline's passes and the report draw windows from holds one."""
    from ..text.data import require_windows
    from .common import check_held_out
    from .compress_outputs import PROMPT_LEN, REPORT_SEQ

    check_held_out(passes, corpus)
    require_windows(corpus, "report", REPORT_SEQ + 1, "the report's figures")
    if parent.find("mtp"):
        require_windows(corpus, "report", PROMPT_LEN, "the report's MTP prompts")


def head_work(passes: list, parent) -> list:
    """The pipeline's passes, less the MTP head's own (its attention match, its checks, its head-only
    recovery) where the parent has no head (Nemotron-3-Nano, the dense Nemotron-H): no head, no head work."""
    from ..passes.distill import Distill
    from ..passes.mtp import MTPCheck, MTPMatchAttention

    if parent.find("mtp"):
        return passes
    return [p for p in passes if not isinstance(p, (MTPCheck, MTPMatchAttention))
            and not (isinstance(p, Distill) and p.head_only)]


def _run_key(parent, args) -> str:
    """What the stage checkpoints belong to: the parent's weights, and the text it is compressed on."""
    from ..text.documents import fingerprint
    from ..ir.identity import program_hash
    from ..text.tokenizer import BYTES, tokenizer_of

    tok = tokenizer_of(parent)
    key = program_hash(parent)
    return key if tok is BYTES and not args.data else f"{key}|{tok.identity}|{fingerprint(args.data or [])}"


@contextlib.contextmanager
def _workload(args, out: Path):
    """The scenario the run prices: the named one, or with workload options its resolved form written to
    OUT/scenario.toml (so the pipeline, a rerun and the report read the same one); for --estimate, to a temporary
    file (an estimate writes nothing)."""
    import tempfile

    from ..backends.cost import get_scenario
    from .common import scenario_of

    sc = scenario_of(args)
    if sc == get_scenario(args.scenario):
        yield args.scenario
    elif args.estimate:
        with tempfile.TemporaryDirectory(prefix="puzzlekit-scenario-") as tmp:
            write_text(Path(tmp) / "scenario.toml", sc.to_toml())
            yield str(Path(tmp) / "scenario.toml")
    else:
        out.mkdir(parents=True, exist_ok=True)
        write_text(out / "scenario.toml", sc.to_toml())
        yield str(out / "scenario.toml")


def _run(args, out: Path, parent, passes: list, library: Path, progress: bool, auto: list) -> dict:
    from ..backends.cost import CostModel, get_scenario
    from ..backends.torch.device import use_threads
    from ..passes import Instrumentation, PassManager, print_pipeline
    from ..passes.stages import StageCheckpoints

    src = Path(parent.meta["source"])
    use_threads(parent.param_counts()["total"], args.threads)
    CostModel(parent, args.target, get_scenario(args.scenario)).check_priceable(args.context)
    out.mkdir(parents=True, exist_ok=True)  # once the options make a pipeline the target can price
    prog = parent.copy()
    stages = StageCheckpoints(out / "work" / "stages", _run_key(parent, args))
    ins = Instrumentation(progress=progress, stages=stages, log=not args.json)
    t0 = time.perf_counter()
    am = PassManager(passes, ins, args.device, args.dtype, args.max_memory, data=args.data).run(prog)
    clock = {"pipeline": time.perf_counter() - t0, **{label: s for label, s in ins.timings}}
    summary = {"pipeline": print_pipeline(passes), "resumed_at_pass": stages.resume_at, "passes": stages.count,
               "reports": am.reports, "seconds": clock, "model": str(src), "target": args.target,
               "scenario": args.scenario, "parent_params": parent.param_counts()["total"],
               "mtp_head": bool(parent.find("mtp")),
               "auto": [{"pass": name, "occurrence": k, "options": opts} for name, k, opts in auto]}
    if checks := am.reports.get("mtp-check"):  # what `cost --mtp` prices the child with
        prog.meta.setdefault("provenance", {})["mtp_acceptance"] = {"length": checks[-1]["acceptance"],
                                                                    "drafts": checks[-1]["drafts"]}
    summary["outputs"] = write_outputs(prog, parent, args, out, library)
    write_json(out / "work" / "summary.json", summary)
    from .report import write_report

    summary["report"] = str(write_report(out))
    return summary


def run_compress(args) -> int:
    from .common import emit

    s = compress(args, progress=not args.json and os.isatty(2))
    if not s:  # --estimate: printed
        return 0
    plan = s["reports"]["puzzle"][-1]
    dep = json.loads((Path(args.output) / "plan.json").read_text())["deployment"]
    lines = [f"{'resumed after pass ' + str(s['resumed_at_pass']) + ', ' if s['resumed_at_pass'] else ''}"
             f"{s['passes']} passes in {s['seconds']['pipeline']:.0f} s",
             f"params {plan['params']:,} (the parent's: {s['parent_params']:,})",
             f"child: {Path(args.output) / 'model'} ({s['outputs']['model']['form']})",
             _mtp_line(s["outputs"].get("quality"), s["mtp_head"]),
             *(f"{k}: " + (f"unservable ({v['predicted']['unservable']})" if "unservable" in v["predicted"] else
                           f"predicted {v['predicted']['tokens_per_second']:,.0f} tokens/s serving")
               + (f"; decode at batch {v['decode']['batch']}, context {v['decode']['context']:,}: predicted "
                  f"{v['decode']['predicted']:,.0f}, measured {v['decode']['measured']:,.0f} tokens/s"
                  if "decode" in v else "")
               for k, v in dep.items()),
             _serving_line(s["outputs"].get("serving")),
             _bundle_line(s["outputs"]["bundle"]),
             f"report: {s['report']}/report.md"]
    emit(args, s, "\n".join(ln for ln in lines if ln) + "\n")
    return 0


def _mtp_line(quality: dict | None, head: bool = True) -> str:
    """The MTP head's speed as delivered: child and parent acceptance on the report set (the report's quality
    table), so a head that lost its drafts is seen without opening the report."""
    if not head:
        return ("MTP: the model has no MTP head (no head work, no acceptance figures; served without speculative "
                "decoding)")
    if not quality or quality["child"].get("mtp_acceptance") is None:
        return ""
    child, parent = quality["child"]["mtp_acceptance"], quality["parent"]["mtp_acceptance"]
    n, _, new = quality["prompts"]
    return (f"MTP acceptance on the report set: child {child:.3f} tokens/step, parent {parent:.3f} "
            f"({child / parent:.2f}x; {n} prompts, {new} tokens each)")


def _serving_line(check: dict | None) -> str:
    """check-serving's verdict on the child, one line (the report has every problem)."""
    from ..backends.serving_check import NAMES

    if not check:
        return ""
    if not check["engines"]:
        return f"engines: none loads the child ({check['refused'].split(': ', 1)[-1]})"
    said = [NAMES[e] + (" loads it" if v["loads"] else f" does NOT ({v['problems'][0]})")
            for e, v in check["engines"].items()]
    return f"engines ({check['layout'] or 'no layout'}, check-serving): " + "; ".join(said)


def _bundle_line(b: dict) -> str:
    if "precision" not in b:  # the cpu target: ONNX graphs for onnxruntime
        return f"bundle: {b['directory']} (ONNX for onnxruntime)"
    built = ", ".join(b["engines"]) or "none built here (bash trtexec.sh or build_engines.py on the GPU)"
    serve = "; serve the child: bash serve.sh vllm|sglang|tensorrt-llm" if "serve.sh" in b["files"] else ""
    return f"bundle: {b['directory']} (TensorRT, {b['target']}, {b['precision']}; engines: {built}{serve})"


def run_report(args) -> int:
    from .common import emit
    from .report import write_report

    d = write_report(args.output)
    emit(args, {"report": str(d), "files": sorted(p.name for p in d.iterdir())}, f"wrote {d}/report.md\n")
    return 0


def add_parsers(sub, model_help: str, positive_int, positive_float) -> tuple:
    from .common import add_workload_arguments, number
    from .estimate import add_estimate_arguments

    c = sub.add_parser("compress", help="compress a model for a deployment target: search, distill, quantise, "
                                        "export, report (resumable)")
    c.add_argument("model", nargs="?", help=model_help)
    c.add_argument("--output", "-o", required=True, help="run directory (the same command again resumes)")
    c.add_argument("--target", default="cpu", help="h100, b200, 8xb200, ..., cpu")
    c.add_argument("--scenario", default="chat", help="long-1m, decode-heavy, prefill-heavy, chat")
    add_constraint_arguments(c, positive_int, positive_float)
    c.add_argument("--extended", action="store_true", help=EXTENDED_HELP)
    add_workload_arguments(c, mtp=False)
    add_estimate_arguments(c)
    c.add_argument("--cost-table", metavar="FILE", help="the cpu target's op timings from an earlier run "
                                                        "(OUT/cost-table.json), so that it gives the same child")
    c.add_argument("--iterative", type=positive_int, default=1, help="rounds of search + distillation (Iterative "
                                                                      "Puzzle); the steps are split over them")
    c.add_argument("--steps", type=positive_int, help="distillation steps in total (default 300; --quick 20)")
    c.add_argument("--head-steps", type=positive_int, help="head-only MTP recovery steps (default 100; --quick 40)")
    c.add_argument("--mtp-tolerance", type=float, help="the largest relative drop of MTP acceptance length below the "
                                                       "parent's before the run fails (default 0.1; --quick: 1, report only)")
    c.add_argument("--library", help="an existing library of this model (default: built in OUT/library)")
    c.add_argument("--grid", help="the library's grid (default, planning or a TOML file)")
    c.add_argument("--pipeline", help="an edited copy of tools/pipelines/compress.pipeline")
    c.add_argument("--quick", action="store_true", help="small budgets for every stage (a smoke test)")
    c.add_argument("--tasks", help="lm-evaluation-harness tasks to score parent and child on after the run "
                                   "(comma-separated; needs puzzlekit[eval]): a table and a plot in the report")
    c.add_argument("--task-limit", type=positive_int, help="--tasks: at most this many examples per task")
    c.add_argument("--num-fewshot", type=number(int, 0), help="--tasks: few-shot examples (default: the task's)")
    c.add_argument("--include-path", action="append", default=[], metavar="DIR",
                   help="--tasks: a folder of task YAMLs of your own (e.g. reading data on disk); repeatable")
    c.set_defaults(run=run_compress, owns=("library", "cost-table.json"))  # a rerun's own files, read back
    r = sub.add_parser("report", help="write OUT/report/ (Markdown and plots) for a compress run")
    r.add_argument("output", help="a compress run directory")
    r.set_defaults(run=run_report)
    return c, r
