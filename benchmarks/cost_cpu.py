"""The `cpu` cost provider's predictions against whole-model measurements: the built-in model and three
pruned variants (fewer experts, a noop layer, a smaller SSM state), and the child/parent ratios a search uses.

Run: python benchmarks/cost_cpu.py [--prefill 256] [--batch 4] [--context 256] [--repeats 15] [--fresh]
Every op of every model and the four whole models (decode step and prefill) are timed in one round-robin,
so load on the machine moves predictions and measurements alike. Goals: predicted/measured
within 15% for each, and each variant's predicted ratio to the parent within 10% of its measured ratio.
The op times are stored in the provider's cache (backends/measured.py: keyed by this machine's conditions,
spot-checked when read); --fresh uses an empty cache instead.
"""
from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch
from puzzlekit.backends.cost import CostModel, MeasuredProvider, Scenario
from puzzlekit.ir.ops import Noop
from puzzlekit.tools.default_model import load_default


def variants() -> dict:
    """The built-in model and three pruned variants (random weights where shapes change)."""
    g = torch.Generator().manual_seed(0)

    def rewrite(prog, kind, make, index=0):
        node = [n for n in prog.blocks() if n.op.kind == kind][index]
        spec = make(node.op)
        prog.rewrite(node, op=spec, weights={k: torch.randn(s, generator=g) * 0.02 for k, s in spec.stored_params().items()})
        return prog

    parent = load_default()
    fewer = parent.copy()
    for i in range(len(fewer.blocks("moe"))):
        rewrite(fewer, "moe", lambda op: op.resized("experts", op.experts // 2), i)
    noop = rewrite(parent.copy(), "mamba2", lambda op: Noop(op.hidden), 1)
    small = parent.copy()
    for i in range(len(small.blocks("mamba2"))):
        rewrite(small, "mamba2", lambda op: op.resized("state", op.state // 2), i)
    return {"built-in": parent, "experts / 2": fewer, "a Mamba layer -> noop": noop, "SSM state / 2": small}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", type=int, default=256, help="prompt length")
    ap.add_argument("--batch", type=int, default=4, help="decode batch")
    ap.add_argument("--context", type=int, default=256, help="context length at the decode step")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--fresh", action="store_true", help="ignore cached per-op times")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's); 1 is steadier on a "
                    "shared machine")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    progs = variants()
    cache = Path(tempfile.mkdtemp()) / "t.json" if args.fresh else None
    prov = MeasuredProvider(cache, repeats=args.repeats, warmup=3)
    sc = Scenario(input_len=args.prefill, output_len=1, context=args.context, concurrency=args.batch)
    models = {k: CostModel(p, "cpu", sc, provider=prov) for k, p in progs.items()}
    # all ops of all models at both shapes and the whole models, in one round-robin
    shapes = ((args.batch, 1, args.context, True), (1, args.prefill, 0, False))
    items = list(dict.fromkeys((op, *sh) for m in models.values() for sh in shapes
                               for op in dict.fromkeys(n.op for n in m.prog.nodes if n.op.kind != "mtp")))
    runs = [r for p in progs.values() for r in prov.model_runs(p, args.batch, args.context, args.prefill)]
    _, got = prov.measure_together(items, runs)
    measured = {k: (got[2 * i], got[2 * i + 1]) for i, k in enumerate(progs)}
    predicted = {k: (m.decode_step_seconds(args.batch), m.prefill_seconds()) for k, m in models.items()}

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"cpu provider, {torch.get_num_threads()} threads, load average {load:.2f}; decode batch {args.batch} at "
          f"context {args.context}, prefill {args.prefill} tokens; {args.repeats} round-robin passes"
          + (f"; cache dropped: {prov.invalidated}" if prov.invalidated else ""))
    print(f"{'model':24}{'decode pred':>13}{'meas':>9}{'p/m':>6}{'prefill pred':>14}{'meas':>9}{'p/m':>6}"
          f"{'ratio to built-in: decode p/m':>31}{'prefill p/m':>13}")
    base_p, base_m = predicted["built-in"], measured["built-in"]
    for k in progs:
        (pd, pp), (md, mp) = predicted[k], measured[k]
        rd = (pd / base_p[0]) / (md / base_m[0])
        rp = (pp / base_p[1]) / (mp / base_m[1])
        print(f"{k:24}{pd * 1e3:11.3f}ms{md * 1e3:7.3f}ms{pd / md:6.2f}{pp * 1e3:12.3f}ms{mp * 1e3:7.3f}ms{pp / mp:6.2f}"
              f"{rd:31.3f}{rp:13.3f}")


if __name__ == "__main__":
    main()
