"""`puzzlekit report OUT/`: what a `compress` run traded for what, as Markdown with PNG plots.

    report.md          the tables: per-layer architecture, the search's frontier, distillation, MTP acceptance,
                       predicted and measured deployment figures
    architecture.png   parent and child side by side, one row per layer (kind and size relative to the parent)
    frontier.png       summed replacement score against the predicted figure, MIP and baselines, per budget
    distillation.png   the loss terms over steps, every distillation run
    mtp.png            MTP acceptance length: teacher, before and after recovery (a model with a head)
"""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import PuzzlekitError
from ..outputs import staged_dir

KIND_COLOURS = {"mamba2": "#4c72b0", "moe": "#dd8452", "attention": "#55a868", "mlp": "#c44e52",
                "linear": "#8172b3", "noop": "#bbbbbb"}
SHOWN = ("q_heads", "kv_heads", "heads", "head_dim", "state", "experts", "top_k", "d_ff", "shared_d_ff", "latent")


def layer_rows(prog) -> list[dict]:
    """Per layer: its kind and the sizes a report shows."""
    rows = []
    for i, n in enumerate(prog.blocks()):
        attrs = {k: getattr(n.op, k) for k in SHOWN if hasattr(n.op, k)}
        rows.append({"layer": i, "kind": n.op.kind, "params": sum(_numel(s) for s in n.op.params().values()),
                     **attrs})
    return rows


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _describe(row: dict) -> str:
    return row["kind"] + "".join(f" {k}={v}" for k, v in row.items() if k in SHOWN)


def _plots():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plots().close(fig)


def architecture_plot(parent_rows: list, child_rows: list, path: Path) -> None:
    plt = _plots()
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(parent_rows) + 1.5))
    for side, rows, x in (("parent", parent_rows, 0), ("child", child_rows, 1)):
        for r, p in zip(rows, parent_rows):
            share = r["params"] / max(p["params"], 1)
            ax.barh(r["layer"], 0.9 * max(share, 0.03), left=x, color=KIND_COLOURS.get(r["kind"], "#333333"))
            ax.text(x + 0.02, r["layer"], _describe(r) if side == "child" else r["kind"], va="center", fontsize=6)
    ax.set_yticks([r["layer"] for r in parent_rows])
    ax.invert_yaxis()
    ax.set_xticks([0.45, 1.45], ["parent", "child (bar: share of the parent's parameters)"])
    ax.set_ylabel("layer")
    _save(fig, path)


def frontier_plot(points: list, path: Path) -> None:
    plt = _plots()
    fig, ax = plt.subplots(figsize=(6, 4))
    for method, marker in (("mip", "o-"), ("uniform", "s"), ("greedy", "^")):
        pts = sorted((p["relative"], p["score"]) for p in points if p["method"] == method)
        if pts:
            ax.plot(*zip(*pts), marker, label=method, markersize=6)
    chosen = [p for p in points if p["method"] == "mip" and p["budget"] == 1.0]
    if chosen:  # the child compress returns: the MIP at the target itself (its last round's, with --iterative)
        c = chosen[0]
        ax.plot(c["relative"], c["score"], "*", color="black", markersize=14, zorder=5, label="chosen: MIP at the target")
        ax.annotate("chosen", (c["relative"], c["score"]), xytext=(6, 6), textcoords="offset points", fontsize=8)
    key = points[0]["constraint"] if points else "budget"
    ax.set_xlabel(f"predicted {'throughput' if key == 'speedup' else key} relative to the parent")
    ax.set_ylabel("summed replacement score (KL, nats/token)")
    ax.legend()
    ax.grid(alpha=0.3)
    _save(fig, path)


#: how the report names the metric a distillation run kept its weights on
SELECTION_NAMES = {"kl": "KL", "mtp_kl": "MTP KL", "mtp_loss": "MTP loss"}


def selected_on(run: dict) -> str:
    """The held-out metric the run's keep-best compared (a head-only run: its head's loss, not the trunk KL it
    cannot move); runs reported before `selected_on` was written: the head's KL when it trained on mtp alone."""
    return run.get("selected_on") or ("mtp_kl" if set(run["terms"]) == {"mtp"} else "kl")


def _selection_name(run: dict) -> str:
    metric = selected_on(run)
    if metric != "mtp_loss":
        return SELECTION_NAMES.get(metric, metric)
    terms = {"mtp_kl": "KL to the teacher's head", "mtp_self_kl": "KL to its own trunk"}
    return "MTP loss (" + " + ".join((f"{w:g} x " if w != 1 else "") + terms.get(k, k)
                                     for k, w in run.get("mtp_weights", {}).items()) + ")"


def distillation_plot(runs: list, path: Path) -> None:
    plt = _plots()
    fig, ax = plt.subplots(figsize=(6, 4))
    offset = 0
    for i, run in enumerate(runs):
        log = run["log"]
        for term in run["terms"]:
            ax.plot([offset + r["step"] for r in log], [r[term] for r in log], label=f"run {i + 1}: {term}",
                    linewidth=1)
        best = run.get("best")
        if best is not None and best["step"] < run["steps"]:  # keep_best: the weights of that evaluation were kept
            metric = selected_on(run)
            what = "its starting weights" if best["step"] == 0 else f"step {best['step']}"
            ax.axvline(offset + best["step"], color="black", linestyle=":", linewidth=1)
            ax.annotate(f"run {i + 1} kept {what}\n(best held-out {metric} {best[metric]:.3g})",
                        (offset + best["step"], 1), xycoords=("data", "axes fraction"), xytext=(3, -3),
                        textcoords="offset points", va="top", fontsize=6)
        offset += run["steps"]
    ax.set_xlabel("step (runs one after another)")
    ax.set_ylabel("loss term")
    ax.set_yscale("log")
    ax.legend(fontsize=6)
    _save(fig, path)


def mtp_plot(values: dict, path: Path) -> None:
    plt = _plots()
    import textwrap

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar(range(len(values)), list(values.values()), color=["#55a868", "#c44e52", "#4c72b0"][:len(values)])
    ax.set_xticks(range(len(values)), [textwrap.fill(k, 14) for k in values], fontsize=8)  # no overlapping labels
    for x, v in enumerate(values.values()):
        ax.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("mean acceptance length (tokens / step)")
    _save(fig, path)


def _deployment_row(name: str, p: dict) -> tuple:
    """One model's predicted serving figures in the layout priced, or why no engine splits it over the pinned one."""
    if "unservable" in p:
        return (name, p["layout"], f"unservable: {p['unservable']}", "", "", "", "")
    return (name, p.get("layout", ""), _fmt(p["weight_gb"]), p["max_batch"], p["max_concurrency"],
            _fmt(p["decode_step_ms"]), _fmt(p["tokens_per_second"]))


def distillation_table(runs: list) -> str:
    """Per distillation run: the metric its keep-best selected on (before, after, which weights it kept), then
    the trunk's KL and top-1 agreement, all on the selection set."""
    return _table(["run", "steps", "selected on", "before", "after", "kept", "KL before", "KL after",
                   "top-1 before", "top-1 after", "bits/byte after"],
                  [(i + 1, r["steps"], _selection_name(r), _fmt(r["before"][selected_on(r)]),
                    _fmt(r["after"][selected_on(r)]), _kept(r), _fmt(r["before"]["kl"]), _fmt(r["after"]["kl"]),
                    _fmt(r["before"]["top1_agreement"]), _fmt(r["after"]["top1_agreement"]),
                    _fmt(r["after"]["bits_per_byte"])) for i, r in enumerate(runs)])


def _mtp_ratio(quality: dict) -> list[str]:
    """The child's MTP acceptance as a share of the parent's (what the head kept of its speed), and its sample."""
    child, parent = quality["child"].get("mtp_acceptance"), quality["parent"].get("mtp_acceptance")
    if child is None or not parent:
        return []
    n, _, new = quality["prompts"]
    return [f"\nMTP acceptance: the child's is {child / parent:.2f}x the parent's ({n} prompts, {new} tokens "
            "generated from each).\n"]


def _quality_section(quality: dict, head: bool) -> list[str]:
    """Parent and child on the report set: KL, agreement, bits per byte, and the head's acceptance if any."""
    cols = ["kl", "top1_agreement", "bits_per_byte"] + (["mtp_acceptance"] if head else [])
    prompts = f" and {quality['prompts'][0]} MTP prompts" if head else ""
    return ["## Quality on the report set\n",
            f"Measured on {quality['windows'][0]} windows of {quality['windows'][1]} bytes{prompts} from the "
            "held-out `report` set, which no stage of the run (library scores, search, distillation's kept "
            "weights) chose anything on.\n",
            _table(["", "KL to the parent", "top-1 agreement", "bits/byte", "MTP acceptance"][:len(cols) + 1],
                   [(name, *(_fmt(quality[name][c]) for c in cols)) for name in ("parent", "child")]),
            *_mtp_ratio(quality)]


def _mtp_section(mtp: dict, head: bool) -> list[str]:
    if not head:
        return ["\n## MTP head\n", "The model has no MTP head: the run did no head work (no attention match, "
                "no `mtp-check`, no head-only recovery), has no acceptance figures, and the child is served "
                "without speculative decoding.\n"]
    return ["\n## MTP acceptance length\n", "![mtp](mtp.png)\n",
            "`mtp-check` in the pipeline (before quantisation), on prompts from the `report` set.\n",
            _table(["", "tokens per step"], [(k, _fmt(v)) for k, v in mtp.items()])]


def _kept(run: dict) -> str:
    """Which weights the run ended with: keep-best's evaluation, or the last step's."""
    step = run.get("kept")
    if step is None:  # reported before `kept` was: keep-best's evaluation when the final figure is its
        best, metric = run.get("best"), selected_on(run)
        step = best["step"] if best and best.get(metric) == run["after"].get(metric) else run["steps"]
    return "its start" if step == 0 else f"step {step}"


def _table(header: list, rows: list) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def tasks_plot(rows: list, path: Path) -> None:
    """Parent and child side by side per task and metric (higher or lower is better as the metric says)."""
    rows = [r for r in rows if "perplexity" not in r["metric"]] or rows  # one scale: rates and bits per byte
    plt = _plots()
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(rows)), 3.5))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["teacher"] for r in rows], 0.4, label="parent")
    ax.bar([i + 0.2 for i in x], [r["value"] for r in rows], 0.4, yerr=[r["stderr"] or 0 for r in rows],
           label="child")
    ax.set_xticks(list(x), [f"{r['task']}\n{r['metric']}" for r in rows], fontsize=8)
    ax.legend()
    ax.set_title("lm-eval tasks")
    _save(fig, path)


def _tasks_section(out: Path, d: Path) -> list[str]:
    """`compress --tasks`: parent and child on lm-evaluation-harness tasks, with the difference and its error."""
    f = out / "work" / "tasks.done"
    if not f.exists():
        return []
    t = json.loads(f.read_text())
    tasks_plot(t["rows"], d / "tasks.png")
    return ["## Tasks\n", f"lm-evaluation-harness on {', '.join(t['tasks'])}"
            + (f", at most {t['limit']} examples each" if t["limit"] else "") + " (`puzzlekit eval --tasks`).\n",
            "![tasks](tasks.png)\n",
            _table(["task", "metric", "parent", "child", "difference", "child stderr"],
                   [(r["task"], r["metric"], _fmt(r["teacher"]), _fmt(r["value"]), _fmt(r["difference"]),
                     _fmt(r["stderr"]) if r["stderr"] is not None else "-") for r in t["rows"]])]


def _serving_section(check: dict | None) -> list[str]:
    """What vLLM, SGLang and TensorRT-LLM build from the child (`puzzlekit check-serving`), per engine."""
    if check is None:
        return []
    head = ["\n### Which engines load the child\n",
            "`puzzlekit check-serving` on the child's config and tensor headers"
            + (f", split over {check['layout']}" if check.get("layout") else "") + ".\n"]
    if not check["engines"]:
        return head + [f"No engine: {check['refused']}\n"]
    from ..backends.serving_check import NAMES

    return head + [_table(["engine", "loads", "what it would get wrong"],
                          [(NAMES[e], "yes" if v["loads"] else "**no**", "<br>".join(v["problems"]) or "-")
                           for e, v in check["engines"].items()])]


def write_report(out) -> Path:
    """Writes OUT/report/ from OUT/plan.json, OUT/work/summary.json and the two models; replaces an old one."""
    from .. import ir

    out = Path(out)
    try:
        plan = json.loads((out / "plan.json").read_text())
        summary = json.loads((out / "work" / "summary.json").read_text())
    except FileNotFoundError as e:
        raise PuzzlekitError(f"{out} holds no finished compress run ({Path(e.filename).name} is missing); "
                             f"run `puzzlekit compress ... -o {out}` first") from None
    parent, child = ir.load(summary["model"]), ir.load(out / "model")
    prows, crows = layer_rows(parent), layer_rows(child)
    reports = summary["reports"]
    distills = reports.get("distill", [])
    checks = reports.get("mtp-check", [])
    head = bool(parent.find("mtp"))
    mtp = {}
    if checks:  # the pipeline measures after the trunk's distillation and again after head-only recovery
        mtp["teacher"] = checks[0]["teacher_acceptance"]
        matched = reports.get("mtp-match-attention")  # the head's attention shrunk to the trunk's before this
        mtp["after trunk distillation" + (f" (head attention matched: {matched[-1]['q_heads']} query / "
                                          f"{matched[-1]['kv_heads']} KV heads)" if matched else "")] = \
            checks[0]["acceptance"]
        if len(checks) > 1:
            mtp["after head-only recovery"] = checks[-1]["acceptance"]
    dep = plan["deployment"]
    quality = json.loads((out / "work" / "quality.done").read_text())
    engine = plan["engine"]
    unconstrained = engine["unconstrained_score"]
    with staged_dir(out / "report", overwrite=True) as d:
        architecture_plot(prows, crows, d / "architecture.png")
        frontier_plot(plan["frontier"], d / "frontier.png")
        distillation_plot(distills, d / "distillation.png")
        if head:
            mtp_plot(mtp, d / "mtp.png")
        md = [f"# Compression report: {summary['model']} for {summary['target']} / {summary['scenario']}\n",
              f"Pipeline: `{summary['pipeline']}`\n",
              "## Architecture\n", "![architecture](architecture.png)\n",
              _table(["layer", "parent", "child"], [(p["layer"], _describe(p), _describe(c)) for p, c in zip(prows, crows)]),
              f"\nParameters: {parent.param_counts()['total']:,} -> {child.param_counts()['total']:,} "
              f"(active {parent.param_counts()['active']:,} -> {child.param_counts()['active']:,}).\n",
              *_quality_section(quality, head),
              "\n## The serving engine\n",
              f"Profile {engine['rules']}.\n",
              f"Summed library score at the target under it: {_fmt(engine['score'])}; without any engine's rules: "
              f"{_fmt(unconstrained) if unconstrained is not None else 'infeasible'}"
              + (f" ({_fmt(engine['score'] / unconstrained)}x: what being servable costs in the search's terms)"
                 if unconstrained and engine["score"] is not None else "") + ".\n",
              *_tasks_section(out, d),
              *_serving_section(json.loads((out / "work" / "serving.done").read_text())
                                if (out / "work" / "serving.done").exists() else None),
              "## The search\n", "![frontier](frontier.png)\n",
              _table(["method", "budget", "constraint", "summed score", "predicted / parent", "params"],
                     [(p["method"], p["budget"], p["constraint"], _fmt(p["score"]), _fmt(p["relative"]),
                       f"{p['params']:,}") for p in plan["frontier"]]),
              "\n## Distillation\n", "![distillation](distillation.png)\n",
              "Distillation's own evaluations, on the held-out `selection` set (they chose the kept weights: "
              "each run on the metric it names; a head-only run on its head's loss, the trunk KL it cannot move).\n",
              distillation_table(distills),
              *_mtp_section(mtp, head),
              "\n## Deployment\n",
              _table(["", "layout", "weights GB", "max batch", "max concurrency", "decode step ms",
                      "serving tokens/s predicted"],
                     [_deployment_row(name, v["predicted"]) for name, v in dep.items()]),
              *([("\nDecode alone, like for like: one decode step at each model's batch and the scenario's mean "
                  "context, measured on this machine and predicted by the cost model for that same step.\n"),
                 _table(["", "batch", "context", "decode tokens/s predicted", "measured", "measured / predicted"],
                        [(name, v["decode"]["batch"], v["decode"]["context"], _fmt(v["decode"]["predicted"]),
                          _fmt(v["decode"]["measured"]), _fmt(v["decode"]["measured"] / v["decode"]["predicted"]))
                         for name, v in dep.items() if "decode" in v])] if any("decode" in v for v in dep.values())
                else ["\nMeasured figures come from the GPU machine (the bundle's validate.py).\n"])]
        (d / "report.md").write_text("\n".join(md))
    return out / "report"
