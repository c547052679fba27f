"""The cost model against the published Puzzle-75B deployment results (REFERENCE.md), parent and child.

Run: python benchmarks/calibration.py [--config PATH] [--json]
The child is tests/fixtures/puzzle75b.py: Nemotron-3-Super rewritten to the published statistics (75.3B
total / 9.3B active, SSM state 96, MoE d_ff 1280-2688, top-k 4-18). Every figure uses the one set of
constants in backends/cost.py (Efficiency, Scenario defaults, targets); docs/cost-model.md explains them.
Published weights are read as GiB (what serving engines log); throughput is the serving throughput at the
scenario's per-user rate floor, NVFP4 weights, FP8 KV cache.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from puzzlekit import ir
from puzzlekit.backends.cost import cost

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "fixtures"))
import puzzle75b  # noqa: E402

GIB = 2**30


def claims(parent, child) -> list[dict]:
    def both(target, scenario, **kw):
        return [cost(p, target, scenario, recipe="nvfp4-hybrid", **kw) for p in (parent, child)]

    h100 = both("h100", "long-1m")
    dec, pre = both("8xb200", "decode-heavy"), both("8xb200", "prefill-heavy")
    fast = both("8xb200", "decode-heavy", rate_floor=150.0)
    pc, cc = parent.param_counts(), child.param_counts()
    thr = [r.throughput_tokens_per_second for r in dec + pre + fast]
    rows = [
        ("parameters, child (B total)", 75.3, cc["total"] / 1e9, "within 1%"),
        ("parameters, child (B active)", 9.3, cc["active"] / 1e9, "within 1%"),
        ("parameters, parent (B total)", 120.7, pc["total"] / 1e9, "within 1%"),
        ("NVFP4 weights, parent (GiB)", 70.0, h100[0].weight_bytes / GIB, "within 10%"),
        ("NVFP4 weights, child (GiB)", 44.5, h100[1].weight_bytes / GIB, "within 10%"),
        ("1M-token requests on one H100, parent", 1, h100[0].max_concurrency, "1"),
        ("1M-token requests on one H100, child", 8, h100[1].max_concurrency, "7-9"),
        ("8xB200 throughput child/parent, decode-heavy 8K/64K >= 100 tok/s/user", 2.03, thr[1] / thr[0],
         "within 15%"),
        ("8xB200 throughput child/parent, prefill-heavy 50K/2K >= 100 tok/s/user", 1.60, thr[3] / thr[2],
         "within 15%"),
        ("8xB200 throughput child/parent, decode-heavy >= 150 tok/s/user", 2.14, thr[5] / thr[4],
         "above the 100 tok/s ratio"),
    ]
    met = {
        "within 1%": lambda p, o: abs(o / p - 1) <= 0.01, "within 10%": lambda p, o: abs(o / p - 1) <= 0.10,
        "within 15%": lambda p, o: abs(o / p - 1) <= 0.15, "1": lambda p, o: o == 1, "7-9": lambda p, o: 7 <= o <= 9,
        "above the 100 tok/s ratio": lambda p, o: o > thr[1] / thr[0],
    }
    out = [{"claim": c, "published": p, "ours": o, "ratio": o / p, "goal": g, "met": met[g](p, o)} for c, p, o, g in rows]
    out.append({"claim": "ordering: decode-heavy gains more than prefill-heavy", "published": 1, "ours":
                int(thr[1] / thr[0] > thr[3] / thr[2]), "ratio": 1.0, "goal": "preserved",
                "met": thr[1] / thr[0] > thr[3] / thr[2]})
    details = {f"{t}/{s}/{w}": {"batch": r.max_batch, "binding": r.binding, "throughput": r.throughput_tokens_per_second,
                                "serve_step_ms": r.serve_step_seconds * 1e3, "concurrency": r.max_concurrency}
               for (t, s), pair in ((("h100", "long-1m"), h100), (("8xb200", "decode-heavy"), dec),
                                    (("8xb200", "prefill-heavy"), pre), (("8xb200", "decode-heavy@150"), fast))
               for w, r in zip(("parent", "child"), pair)}
    return out, details


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=str(puzzle75b.SUPER))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    parent, child = ir.load(args.config), puzzle75b.build(args.config)
    rows, details = claims(parent, child)
    if args.json:
        print(json.dumps({"claims": rows, "details": details}, indent=1))
        return
    print("| claim | published | ours | ours/published | goal | met |\n|---|---|---|---|---|---|")
    for r in rows:
        fmt = (lambda v: f"{v:.2f}") if isinstance(r["published"], float) else str
        print(f"| {r['claim']} | {fmt(r['published'])} | {fmt(r['ours'])} | {r['ratio']:.2f} | {r['goal']} | "
              f"{'yes' if r['met'] else 'no'} |")
    print()
    for k, v in details.items():
        print(f"{k}: batch {v['batch']} ({v['binding']}), concurrency {v['concurrency']}, "
              f"serving step {v['serve_step_ms']:.2f} ms, {v['throughput']:,.0f} tokens/s")


if __name__ == "__main__":
    main()
