"""The serving model against public measurements: a calibration set, a validation set and the Puzzle-75B claims.

Run: python benchmarks/calibration.py [--json] [--sensitivity] [--fit launch_seconds] [--prices tables]

With `--prices tables` every point is priced from NVIDIA's measured kernel tables (aiconfigurator-core) of the
point's engine (vLLM, SGLang; TensorRT-LLM's for the Puzzle-75B claims), with puzzlekit's own terms where they
measure nothing (backends/cost/tables.py: TABLE_EFFICIENCY; `--fit mamba_memory` sets its one constant).

- calibration set: the points the constants without a kernel-level source were set on (`--fit NAME` prints the
  calibration error over a grid of one constant; the value kept is in backends/cost/analytic.py: Efficiency);
- validation set: points never used to set a constant, each with its error (goal: within x/÷1.3);
- the published Puzzle-75B deployment claims, child = tests/fixtures/puzzle75b.py, NVFP4 (the public
  Super recipe), FP8 KV cache, the best layout for each model; with `--sensitivity`, each headline ratio at
  +-20% on every constant.

The points come from benchmarks/serving_sources.md (URLs there). Engine benchmarks are closed loops: every
one of `concurrency` requests is always in flight, so they are priced at that batch in the engine's layout
(vLLM's default: tensor parallel over the GPUs, experts too), without a rate floor; a concurrency-1 point
compares its time per output token with one decode step.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

from puzzlekit import ir
from puzzlekit.backends.cost import AnalyticProvider, CostModel, Efficiency, best_layout, get_scenario
from puzzlekit.backends.cost.tables import TABLE_EFFICIENCY, TablesProvider
from puzzlekit.backends.targets import get_target
from puzzlekit.tools.default_model import config_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "fixtures"))
import puzzle75b  # noqa: E402

GIB = 2**30
SUPER, NANO = config_path("nemotron-3-super-120b-a12b"), config_path("nemotron-3-nano-30b-a3b")
RECIPE = {"nvfp4": "nvfp4-hybrid", "fp8": "fp8", "bf16": "bf16"}


@dataclasses.dataclass(frozen=True)
class Point:
    """One measured serving figure (benchmarks/serving_sources.md row `row`)."""

    row: int
    model: str  # "super" or "nano"
    precision: str
    gpu: str
    gpus: int
    input_len: int
    output_len: int
    concurrency: int
    measured: float  # output tokens/s over all GPUs, or per user at concurrency 1 (1000 / TPOT ms)
    engine: str


#: the split was fixed before any point was priced with the layout model (commit message of this file)
CALIBRATION = [
    Point(2, "super", "nvfp4", "b200", 1, 8192, 1024, 32, 1517, "vLLM"),
    Point(8, "nano", "fp8", "b200", 2, 2048, 512, 1, 1000 / 2.91, "vLLM 0.16"),
    Point(12, "nano", "fp8", "b200", 2, 2048, 512, 64, 8120, "vLLM 0.16"),
]
VALIDATION = [
    Point(1, "super", "nvfp4", "b200", 2, 8192, 1024, 32, 2057, "vLLM"),
    Point(3, "super", "fp8", "b200", 2, 8192, 1024, 32, 1847, "vLLM"),
    Point(4, "super", "fp8", "h100", 2, 8192, 1024, 32, 1116, "vLLM"),
    Point(10, "nano", "fp8", "b200", 2, 2048, 512, 16, 3455, "vLLM 0.16"),
    Point(15, "nano", "fp8", "b200", 2, 2048, 512, 512, 18746, "vLLM 0.16"),
    Point(17, "nano", "nvfp4", "b200", 1, 2048, 512, 512, 15575, "vLLM 0.16"),
    Point(18, "nano", "fp8", "b200", 1, 1024, 1024, 1, 1000 / 4.36, "SGLang 0.5.8"),
]
#: held out from the start and first priced only after the constants were set: the same benchmark's other
#: concurrencies (rows 9, 13, 14)
HELD_OUT = [
    Point(9, "nano", "fp8", "b200", 2, 2048, 512, 8, 1881, "vLLM 0.16"),
    Point(13, "nano", "fp8", "b200", 2, 2048, 512, 128, 11556, "vLLM 0.16"),
    Point(14, "nano", "fp8", "b200", 2, 2048, 512, 256, 15552, "vLLM 0.16"),
]
#: the Puzzle-75B report's MTP acceptance lengths (REFERENCE.md); the draft length is not given: 4 is the
#: smallest that allows 4.34 tokens per step
MTP = {"parent": 3.45, "child": 4.34, "draft": 4}
PRICES = {"provider": "analytic"}  # --prices


def provider(target, eff: Efficiency, engine: str = "TensorRT-LLM"):
    """The provider --prices names, with `eff` for its own terms; the tables of the point's engine."""
    if PRICES["provider"] == "tables":
        return TablesProvider(target, engine.split()[0].lower(), eff)
    return AnalyticProvider(target, eff)


def predict(point: Point, prog, eff: Efficiency) -> float:
    target = get_target(point.gpu).node(point.gpus) if point.gpus > 1 else get_target(point.gpu)
    sc = get_scenario("chat", input_len=point.input_len, output_len=point.output_len, rate_floor=0.0,
                      concurrency=point.concurrency, kv_dtype="fp8" if point.precision != "bf16" else "bf16",
                      recipe=RECIPE[point.precision], layout=f"tp{point.gpus}")
    cm = CostModel(prog, target, sc, provider(target, eff, point.engine))  # the engine's layout, pinned
    return 1 / cm.decode_step_seconds(1) if point.concurrency == 1 else cm.report().throughput_tokens_per_second


def errors(points, models, eff) -> list[dict]:
    out = []
    for p in points:
        ours = predict(p, models[p.model], eff)
        out.append({**dataclasses.asdict(p), "ours": ours, "ratio": ours / p.measured,
                    "within_1.3": 1 / 1.3 <= ours / p.measured <= 1.3})
    return out


def _pair(parent, child, target, scenario, eff, **kw):
    t = get_target(target)
    sc = get_scenario(scenario, recipe="nvfp4-hybrid", **kw)
    return [best_layout(p, t, sc, provider(t, eff))[1] for p in (parent, child)]


def headlines(parent, child, eff: Efficiency) -> dict:
    """Child/parent throughput ratios on 8xB200 at the published per-user floors, with and without MTP."""
    dec, pre = _pair(parent, child, "8xb200", "decode-heavy", eff), _pair(parent, child, "8xb200", "prefill-heavy", eff)
    mtp = [best_layout(p, get_target("8xb200"), get_scenario("decode-heavy", recipe="nvfp4-hybrid",
                                                             mtp_draft=MTP["draft"], mtp_acceptance=MTP[w]),
                       provider(get_target("8xb200"), eff))[1] for p, w in ((parent, "parent"), (child, "child"))]
    thr = lambda r: r.throughput_tokens_per_second  # noqa: E731
    return {"decode-heavy": (2.03, thr(dec[1]) / thr(dec[0]), 0.10, dec),
            "prefill-heavy": (1.60, thr(pre[1]) / thr(pre[0]), 0.10, pre),
            "decode-heavy, Super with MTP / Super": (3.04, thr(mtp[0]) / thr(dec[0]), 0.15, [dec[0], mtp[0]]),
            "decode-heavy, child with MTP / Super": (4.63, thr(mtp[1]) / thr(dec[0]), 0.15, [dec[0], mtp[1]])}


#: serving settings the published ratios may have been measured under (issue 39); pinned layouts besides the best
SETTING_LAYOUTS = ("", "tp8", "tp2.dp4.ep8")


def settings(parent, child, eff: Efficiency) -> list[dict]:
    """The decode- and prefill-heavy child/parent ratios under each SSM state dtype x CUDA graphs x layout (""
    is each model's best): what it would take to reach 2.03x / 1.60x. A check only: no constant is set on them."""
    out = []
    for ssm in ("fp32", "bf16"):
        for graphs in (True, False):
            for layout in SETTING_LAYOUTS:
                row = {"ssm_dtype": ssm, "cuda_graphs": graphs, "layout": layout or "best"}
                for name in ("decode-heavy", "prefill-heavy"):
                    p, c = _pair(parent, child, "8xb200", name, eff, ssm_dtype=ssm, cuda_graphs=graphs,
                                 layout=layout or None)
                    row[name] = c.throughput_tokens_per_second / p.throughput_tokens_per_second \
                        if p.throughput_tokens_per_second else float("nan")
                out.append(row)
    return out


def memory_claims(parent, child, eff) -> list[dict]:
    h = _pair(parent, child, "h100", "long-1m", eff)
    pc, cc = parent.param_counts(), child.param_counts()
    rows = [("parameters, child (B total)", 75.3, cc["total"] / 1e9, 0.01),
            ("parameters, child (B active)", 9.3, cc["active"] / 1e9, 0.01),
            ("parameters, parent (B total)", 120.7, pc["total"] / 1e9, 0.01),
            ("NVFP4 weights, parent (GiB)", 70.0, h[0].weight_bytes / GIB, 0.10),
            ("NVFP4 weights, child (GiB)", 44.5, h[1].weight_bytes / GIB, 0.10)]
    out = [{"claim": c, "published": p, "ours": o, "met": abs(o / p - 1) <= tol} for c, p, o, tol in rows]
    out += [{"claim": "1M-token requests on one H100, parent", "published": 1, "ours": h[0].max_concurrency,
             "met": h[0].max_concurrency == 1},
            {"claim": "1M-token requests on one H100, child (7-9)", "published": 8, "ours": h[1].max_concurrency,
             "met": 7 <= h[1].max_concurrency <= 9}]
    return out


def sensitivity(parent, child, eff: Efficiency) -> dict:
    """Each headline ratio with one constant at 0.8x and 1.2x its value."""
    out = {}
    for f in dataclasses.fields(Efficiency):
        v = getattr(eff, f.name)
        low, high = (headlines(parent, child, dataclasses.replace(eff, **{f.name: v * s})) for s in (0.8, 1.2))
        out[f.name] = {name: [low[name][1], high[name][1]] for name in low}
    return out


def fit(name: str, models, eff: Efficiency) -> list[tuple[float, float]]:
    """Root-mean-square log error over the calibration set for a grid of one constant's values."""
    base = getattr(eff, name)
    grid = [base * s for s in (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0)]
    return [(v, math.sqrt(sum(math.log(e["ratio"]) ** 2 for e in
                              errors(CALIBRATION, models, dataclasses.replace(eff, **{name: v})))
                          / len(CALIBRATION))) for v in grid]


def _table(title, rows):
    print(f"\n{title}\n| row | model | GPUs | in/out | concurrency | engine | measured | ours | ours/measured |"
          "\n|---|---|---|---|---|---|---|---|---|")
    for e in rows:
        unit = "tok/s/user" if e["concurrency"] == 1 else "tok/s"
        print(f"| {e['row']} | {e['model']} {e['precision']} | {e['gpus']}x{e['gpu']} | {e['input_len']}/"
              f"{e['output_len']} | {e['concurrency']} | {e['engine']} | {e['measured']:,.0f} {unit} | "
              f"{e['ours']:,.0f} | {e['ratio']:.2f}{'' if e['within_1.3'] else ' (outside x/÷1.3)'} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--sensitivity", action="store_true", help="each headline ratio at +-20%% on every constant")
    ap.add_argument("--settings", action="store_true", help="the ratios under each SSM state dtype x CUDA graphs x "
                                                            "layout, next to the published 2.03x / 1.60x")
    ap.add_argument("--fit", metavar="CONSTANT", help="calibration-set error over a grid of one Efficiency field")
    ap.add_argument("--prices", choices=["analytic", "tables"], default="analytic")
    args = ap.parse_args()
    PRICES["provider"] = args.prices
    eff = TABLE_EFFICIENCY if args.prices == "tables" else Efficiency()
    parent, child = ir.load(SUPER), puzzle75b.build(SUPER)
    models = {"super": parent, "nano": ir.load(NANO)}
    if args.fit:
        for v, rms in fit(args.fit, models, eff):
            print(f"{args.fit} = {v:.3g}: rms log error {rms:.3f} on the calibration set")
        return
    if args.settings:
        rows = settings(parent, child, eff)
        if args.json:
            print(json.dumps(rows, indent=1))
            return
        print("| SSM state | CUDA graphs | layout | decode-heavy (published 2.03x) | prefill-heavy (published 1.60x) |"
              "\n|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['ssm_dtype']} | {'on' if r['cuda_graphs'] else 'off'} | {r['layout']} | "
                  f"{r['decode-heavy']:.2f}x | {r['prefill-heavy']:.2f}x |")
        return
    cal, val = errors(CALIBRATION, models, eff), errors(VALIDATION, models, eff)
    heads, mem = headlines(parent, child, eff), memory_claims(parent, child, eff)
    sens = sensitivity(parent, child, eff) if args.sensitivity else {}
    if args.json:
        print(json.dumps({"efficiency": dataclasses.asdict(eff), "calibration": cal, "validation": val,
                          "headlines": {k: {"published": p, "ours": o, "tolerance": t,
                                            "operating_points": [r.summary() for r in rs]}
                                        for k, (p, o, t, rs) in heads.items()},
                          "memory": mem, "sensitivity": sens}, indent=1))
        return
    _table("calibration set (constants without a kernel-level source were set on these)", cal)
    _table("validation set (never used to set a constant)", val)
    print(f"\nvalidation: {sum(e['within_1.3'] for e in val)} of {len(val)} within x/÷1.3")
    print("\n| Puzzle-75B claim, 8xB200, >= 100 tok/s/user | published | ours | ours/published | goal | met |"
          "\n|---|---|---|---|---|---|")
    for k, (p, o, tol, _) in heads.items():
        print(f"| {k} | {p:.2f} | {o:.2f} | {o / p:.2f} | within {tol:.0%} | {'yes' if abs(o / p - 1) <= tol else 'no'} |")
    for m in mem:
        print(f"| {m['claim']} | {m['published']:g} | {m['ours']:.4g} | {m['ours'] / m['published']:.2f} | | "
              f"{'yes' if m['met'] else 'no'} |")
    print("\noperating points (the best layout of each):")
    for k, (_, _, _, rs) in heads.items():
        for who, r in zip(("Super", "child" if "child" in k or "MTP" not in k else "Super+MTP"), rs):
            print(f"  {k} / {who}: layout {r.layout}, batch {r.max_batch} ({r.binding}), "
                  f"{r.user_tokens_per_second:.0f} tok/s/user, {r.throughput_tokens_per_second:,.0f} tok/s")
    if sens:
        names = list(heads)
        print("\nsensitivity: each ratio with the constant at 0.8x / 1.2x\n| constant | " + " | ".join(names) + " |")
        print("|---|" + "---|" * len(names))
        for c, v in sens.items():
            print(f"| {c} | " + " | ".join(f"{v[n][0]:.2f} / {v[n][1]:.2f}" for n in names) + " |")


if __name__ == "__main__":
    main()
