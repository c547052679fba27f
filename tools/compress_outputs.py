"""What a `compress` run writes after its pipeline, each skipped when a rerun finds it done: the child
checkpoint, its quality against the parent on the report set, plan.json (the search's frontier, the engine
profile's cost, deployment figures) and the target's bundle."""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

from ..eta import duration
from ..outputs import write_json
from .puzzle import constraints_of

#: the report set's windows (tokens), and the MTP prompts' length, for `quality`
REPORT_SEQ, PROMPT_LEN = 256, 64
#: `quality`'s report-set windows, MTP prompts and tokens generated per prompt, with --quick and without (the
#: MTP figure as in the full run: two prompts of 16 tokens are too few to tell 0.95x from 1.0x)
REPORT_BUDGET = {True: (4, 8, 32), False: (16, 8, 32)}
#: the report's windows run together
REPORT_BATCH = 8
#: the MTP head's drafts a verification step of the report's acceptance length
DRAFTS = 3
#: windows and tokens per window the engine bundle's FP8 KV-cache scales are calibrated on (as build-engine's)
KV_CALIBRATION = (16, 128)
#: the constraints in the order a budget sweep picks the one to scale
SWEPT = ("speedup", "decode_ms", "prefill_s", "max_params", "max_active", "concurrency")


def deploy_recipe(target: str) -> str:
    """The precision a target deploys in: NVFP4 where it has FP4 math, else FP8, else none (cpu)."""
    from ..backends.targets import get_target

    t = get_target(target)
    return (t.trt or {}).get("recipe") or ("nvfp4" if t.supports("nvfp4") else "fp8" if t.supports("fp8") else "")


def outputs_work(args):
    """What `write_outputs` will do, for the estimate (estimate.Outputs)."""
    from ..backends.cost import get_scenario
    from ..backends.targets import get_target
    from ..estimate import Outputs

    n, prompts, new_tokens = REPORT_BUDGET[bool(args.quick)]
    kind = get_target(args.target).kind
    fp8_kv = kind == "gpu" and get_scenario(args.scenario, recipe=deploy_recipe(args.target) or None).kv_dtype == "fp8"
    return Outputs(n, REPORT_SEQ + 1, prompts, PROMPT_LEN, new_tokens, DRAFTS, kind, fp8_kv, KV_CALIBRATION,
                   REPORT_BATCH)


def _done(out: Path, name: str) -> bool:
    return (out / "work" / f"{name}.done").exists()


def _mark(out: Path, name: str, info: dict) -> None:
    write_json(out / "work" / f"{name}.done", info)


def write_outputs(prog, parent, args, out: Path, library: Path) -> dict:
    """The child checkpoint, plan.json (with the search's frontier and measured figures) and the bundle;
    each skipped when an earlier run wrote it. A line on stderr as each step starts and ends (the steps differ
    by minutes: a count of them foretells nothing; the estimate printed at the start prices them)."""
    from .. import ir
    from ..ir.nemotron_h_puzzle import Unpublishable

    names = ("model", "serving", "quality", *(("tasks",) if getattr(args, "tasks", None) else ()), "plan", "bundle")
    todo = [n for n in names if not _done(out, n)]
    step = lambda name: _Step(name, todo.index(name) + 1, len(todo))
    if not _done(out, "model"):
        with step("model"):
            try:
                ir.save(prog, out / "model", overwrite=True)
                form = "published nemotron_h_puzzle"
            except Unpublishable as e:  # only with --engine none: noop / linear layers, Mamba layers that differ
                if not args.extended:
                    raise
                ir.save(prog, out / "model", overwrite=True, extended=True)
                form = f"puzzlekit extended form ({str(e).split(';')[0].removeprefix('save: ')})"
            _mark(out, "model", {"form": form})
    if not _done(out, "serving"):
        with step("serving"):
            _mark(out, "serving", serving(out / "model", prog.meta.get("plan") or {}))
    if not _done(out, "quality"):
        with step("quality"):
            _mark(out, "quality", quality(parent, prog, args))
    if "tasks" in todo:
        with step("tasks"):
            _mark(out, "tasks", task_scores(parent, prog, args))
    if not _done(out, "plan"):
        with step("plan"):
            points = frontier(parent, args, library)
            plan = {"plan": prog.meta.get("plan"), "frontier": points,
                    "engine": engine_cost(parent, args, library, points), "deployment": deployment(parent, prog, args)}
            write_json(out / "plan.json", plan)
            _mark(out, "plan", {})
    model = json.loads((out / "work" / "model.done").read_text())
    if not _done(out, "bundle"):
        with step("bundle"):
            published = model["form"].startswith("published")  # what the engines load
            _mark(out, "bundle", bundle(prog, args, out / "bundle", out / "model" if published else None))
    return {name: json.loads((out / "work" / f"{name}.done").read_text())
            for name in ("model", "serving", "quality", "bundle")}


class _Step:
    """`outputs: NAME (k of n)` when a step starts and `... done in T` when it ends, on stderr."""

    TITLES = {"model": "the child checkpoint", "serving": "the serving check", "quality": "the report's evaluations",
              "tasks": "lm-eval tasks", "plan": "the frontier's searches", "bundle": "the deployment bundle"}

    def __init__(self, name: str, k: int, n: int):
        self.head = f"outputs: {self.TITLES[name]} ({k} of {n})"

    def __enter__(self):
        self.start = time.monotonic()
        print(self.head, file=sys.stderr, flush=True)

    def __exit__(self, kind, *_):
        if kind is None:
            print(f"{self.head} done in {duration(time.monotonic() - self.start)}", file=sys.stderr, flush=True)


def task_scores(parent, child, args) -> dict:
    """lm-eval tasks on parent and child (`--tasks`): one row per task and metric, the parent as the teacher."""
    from .common import compute_of
    from .tasks import evaluate_tasks, load_tasks, model_for, rows, task_names

    names, compute = task_names(args.tasks), compute_of(args)
    run = lambda p: evaluate_tasks(model_for(p, compute), load_tasks(names, args.include_path), args.task_limit,
                                   args.num_fewshot)
    return {"tasks": names, "limit": args.task_limit, "rows": rows(run(child), run(parent))}


def serving(model: Path, plan: dict) -> dict:
    """check-serving on the child, over the layout it was priced in: per engine, whether it loads and why not."""
    from ..backends.layout import Layout
    from ..backends.serving_check import ServingCheckError, check_serving

    layout = plan.get("layout")
    try:
        verdicts = check_serving(model, layout=Layout.parse(layout) if layout else None)
    except ServingCheckError as e:  # the extended form (--engine none): no engine loads it
        return {"layout": layout, "engines": {}, "refused": str(e)}
    return {"layout": layout, "engines": {v.engine: {"loads": v.loads, "problems": v.problems} for v in verdicts}}


def quality(parent, child, args) -> dict:
    """Parent and delivered child on the report set (data.HELD_OUT: text no stage of the run chose anything
    on): KL and top-1 agreement to the parent, bits per byte and NLL per token, MTP acceptance length; and
    which windows."""
    from ..backends.torch.stream import StreamedProgram
    from ..text.data import corpus_for, held_out_windows
    from ..evaluation import acceptance_length, teacher_agreement, text_metrics
    from .common import compute_of

    n, prompts, new_tokens = REPORT_BUDGET[bool(args.quick)]
    corpus = corpus_for(parent, args.data)
    windows = held_out_windows(corpus, "report", REPORT_SEQ + 1, limit=n)
    starts = held_out_windows(corpus, "report", PROMPT_LEN, limit=prompts)
    compute = compute_of(args)
    models = {name: StreamedProgram(prog, compute) for name, prog in (("parent", parent), ("child", child))}
    # each model run once over the windows, its final hidden states kept for both figures
    runs = {name: m.record(windows, REPORT_BATCH, project=False) for name, m in models.items()}
    out = {"set": "report", "windows": [n, REPORT_SEQ + 1], "prompts": [prompts, PROMPT_LEN, new_tokens]}
    for name, m in models.items():  # the parent against itself agrees exactly: not scored to say so
        agreement = teacher_agreement(runs["parent"], runs["child"], windows, REPORT_BATCH) if name == "child" \
            else {"kl": 0.0, "top1_agreement": 1.0}
        text = text_metrics(runs[name], windows, corpus.token_bytes, REPORT_BATCH)
        out[name] = {**agreement, "bits_per_byte": text["bits_per_byte"], "nll_per_token": text["nll_per_token"],
                     "mtp_acceptance": acceptance_length(m, starts, DRAFTS, new_tokens) if m.program.find("mtp")
                     else None}
    return out


def _scaled(args, factor: float):
    """The command's constraints with the first given one scaled by `factor` (a budget sweep)."""
    c = constraints_of(args)
    k = next(k for k in SWEPT if getattr(c, k))
    v = getattr(c, k) * factor if k in ("speedup", "concurrency") else getattr(c, k) / factor
    return k, dataclasses.replace(c, **{k: max(1, round(v)) if k == "concurrency" else v})


def frontier(parent, args, library: Path) -> list[dict]:
    """Summed replacement score against the predicted figure of the swept constraint (relative to the
    parent), for the MIP and the uniform and greedy baselines at budgets around the target, under the run's
    engine profile."""
    from ..passes.puzzle import Library
    from ..passes.puzzle.search import PlanError, Search

    points, search = [], None
    for factor in (0.75, 0.9, 1.0, 1.15, 1.3):
        key, c = _scaled(args, factor)
        if search is None:
            search = Search(Library.open(library, parent), parent, [(args.target, args.scenario)],
                            deploy_recipe(args.target), "kl", c, engine=args.engine, prices=args.prices)
        search.c = c  # one search priced once: a budget is its constraints (as `plan --sweep`)
        for method in ("mip", "uniform", "greedy"):
            try:
                plan = search.plan(method)
            except PlanError:
                continue
            points.append({"method": method, "budget": factor, "constraint": key, "score": plan.objective,
                           "relative": _relative(search, plan, key), "params": plan.params_total})
    return points


def engine_cost(parent, args, library: Path, points: list[dict]) -> dict:
    """What the engine profile cost: the MIP's summed score at the target under the profile (the frontier's
    point at the target, `points`) and without any engine's rules (the parent's library scores: a one-step
    search's view)."""
    from ..passes.puzzle import Library
    from ..passes.puzzle.engines import get_engine
    from ..passes.puzzle.search import PlanError, Search

    served = next((p["score"] for p in points if p["method"] == "mip" and p["budget"] == 1.0), None)
    try:
        free = Search(Library.open(library, parent), parent, [(args.target, args.scenario)], deploy_recipe(args.target),
                      "kl", constraints_of(args), engine="none", prices=args.prices).plan().objective
    except PlanError:
        free = None
    return {"profile": args.engine, "rules": get_engine(args.engine).describe(), "score": served,
            "unconstrained_score": free}


def _relative(search, plan, key: str) -> float:
    """The child's figure for `key` over the parent's: throughput ratio for a speedup target, else the
    constrained quantity's ratio."""
    if key == "speedup":
        return search.throughput_ratio(plan)
    name = {"decode_ms": "latency_seconds", "prefill_s": "prefill_seconds", "concurrency": "memory_bytes",
            "max_params": "params", "max_active": "active_params"}[key]
    return plan.predicted[name] / plan.parent[name]


def deployment(parent, child, args) -> dict:
    """Predicted figures of parent and child on the target; on the cpu target also decode throughput measured
    and predicted like for like at each one's largest batch meeting the scenario (`decode_figures`)."""
    from ..backends.cost import Unservable, best_layout, get_scenario

    scenario = get_scenario(args.scenario, recipe=deploy_recipe(args.target) or None)
    out = {}
    for name, prog in (("parent", parent), ("child", child)):
        try:  # in the layouts the engines split each over, as the search priced them (`cost` too)
            r = best_layout(prog, args.target, scenario, engines=args.engine != "none")[1]
        except Unservable as e:  # a pinned layout the parent does not split over (the child's pruned heads may)
            out[name] = {"predicted": {"layout": scenario.layout, "unservable": str(e)}}
            continue
        out[name] = {"predicted": {"weight_gb": r.weight_bytes / 1e9, "layout": r.layout, "max_batch": r.max_batch,
                                   "max_concurrency": r.max_concurrency,
                                   "decode_step_ms": r.decode_step_seconds * 1e3,
                                   "tokens_per_second": r.throughput_tokens_per_second}}
        if args.target == "cpu" and r.max_batch:
            out[name]["decode"] = decode_figures(prog, args.target, scenario, r.max_batch)
    return out


def decode_figures(prog, target: str, scenario, batch: int, context: int | None = None) -> dict:
    """Decode tokens/s at `batch` and `context` (default: the scenario's mean decode context), measured here
    (`evaluate.decode_throughput`: one step after a prefill to that context) and predicted by the cost model
    for that same step, without speculative drafting: one quantity on both sides."""
    import dataclasses

    from ..backends.cost import CostModel
    from ..backends.torch import materialize
    from ..evaluation import decode_throughput

    plain = dataclasses.replace(scenario, mtp_draft=0, mtp_acceptance=0.0)
    context = context or plain.decode_context
    step = CostModel(prog, target, plain).decode_step_seconds(batch, context)
    return {"batch": batch, "context": context, "predicted": batch / step,
            "measured": decode_throughput(materialize(prog), batch, context)}


def bundle(prog, args, out: Path, model: Path | None = None) -> dict:
    """The target's deployment artifacts: a TensorRT engine bundle for a GPU (engines built here where a
    builder is), with the engines' commands serving `model` (the child checkpoint) in the layout the search
    chose; ONNX graphs for onnxruntime on cpu."""
    from ..backends.cost import get_scenario
    from ..backends.onnx import export_onnx
    from ..backends.targets import get_target

    target = get_target(args.target)
    if target.kind != "gpu":
        return export_onnx(prog, out, target=args.target, overwrite=True).to_json()
    from ..backends.tensorrt.bundle import write_bundle

    scenario = get_scenario(args.scenario, recipe=deploy_recipe(args.target) or None)
    calib = None
    if scenario.kv_dtype == "fp8":  # the KV cache's scales from the run's own text, as build-engine calibrates
        from ..text.data import calibration_windows

        calib = calibration_windows(args.data or [], KV_CALIBRATION[0], KV_CALIBRATION[1], prog)
    rep = write_bundle(prog, out, target, scenario, overwrite=True, calibration_ids=calib, checkpoint=model,
                       layout=(prog.meta.get("plan") or {}).get("layout") or None)
    return {k: v for k, v in rep.to_json().items() if k != "build"}
