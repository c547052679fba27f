"""The `cpu` cost provider's predictions next to direct measurements of the default model.

Run: python benchmarks/cost_cpu.py [--prefill 256] [--batch 4] [--context 256]
Prints predicted and measured decode-step and prefill times side by side and their ratio
(goal: within 20%). Per-op timings are cached in ~/.cache/puzzlekit; pass --fresh to re-time them.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from puzzlekit.backends.cost import CostModel, MeasuredProvider, Scenario
from puzzlekit.backends.torch import materialize
from puzzlekit.tools.default_model import load_default
from timing import median_seconds


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", type=int, default=256, help="prompt length")
    ap.add_argument("--batch", type=int, default=4, help="decode batch")
    ap.add_argument("--context", type=int, default=256, help="context length at the decode step")
    ap.add_argument("--fresh", action="store_true", help="ignore cached per-op timings")
    args = ap.parse_args()

    prog = load_default()
    cache = Path(tempfile.mkdtemp()) / "t.json" if args.fresh else None
    scenario = Scenario(input_len=args.prefill, output_len=1, context=args.context, concurrency=args.batch)
    model = CostModel(prog, "cpu", scenario, provider=MeasuredProvider(cache))
    predicted_decode = model.decode_step_seconds(args.batch)
    predicted_prefill = model.prefill_seconds()

    m = materialize(prog)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 256, (1, args.prefill), generator=g)
    ctx = torch.randint(0, 256, (args.batch, args.context), generator=g)
    _, state = m.prefill(ctx)
    tok = torch.randint(0, 256, (args.batch,), generator=g)
    # the measured model runs the trunk only, as the cost model prices it (the MTP head is not run per step)
    trunk = prog.copy()
    trunk.nodes = [n for n in trunk.nodes if n.op.kind != "mtp"]
    trunk.outputs = ("logits",)
    mt = materialize(trunk)
    state = state[: len(mt.state_names)]
    measured_decode = median_seconds(lambda: mt.decode(tok, state))
    measured_prefill = median_seconds(lambda: mt.prefill(prompt), repeats=7)

    print(f"default model, cpu, {torch.get_num_threads()} threads")
    print(f"{'':28}{'predicted':>12}{'measured':>12}{'ratio':>8}")
    for name, p, mm in ((f"decode step (batch {args.batch}, ctx {args.context})", predicted_decode, measured_decode),
                        (f"prefill ({args.prefill} tokens)", predicted_prefill, measured_prefill)):
        print(f"{name:28}{p * 1e3:10.2f}ms{mm * 1e3:10.2f}ms{p / mm:8.2f}")


if __name__ == "__main__":
    main()
