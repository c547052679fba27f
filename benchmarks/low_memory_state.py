"""What the low-memory training state costs in quality: the built-in model's pruned child (every MoE routed to
one expert, one Mamba layer dropped) distilled with each state option at equal steps and seeds, against
float32 AdamW with float32 parameters.

Run: python benchmarks/low_memory_state.py [--steps 150] [--seeds 0,1,2] [--modes 1,3,5] [--jobs 2]
    [--results runs.jsonl]
Every run uses the bfloat16 forward (the default on CUDA; params=bf16 needs it) and one thread, each in its own
process (its peak RSS is its own). Prints per run: the held-out KL to the float32 teacher on the `report` set
(which no run selects on), the seconds the training took, the state's bytes per parameter (training.state_bytes,
and measured on this model: its small tensors keep whole 8-bit moments), the host MB of the kept best weights,
and the process's peak RSS (MiB) (at this size mostly torch itself); then each mode's mean over the seeds.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CHILD = "set-topk{k=1},drop-blocks{layers=[2]}"
#: name -> the Distill options that differ from the baseline's
MODES = {
    "fp32 AdamW (baseline)": {},
    "bf16 moments (adamw-bf16)": {"optimizer": "adamw-bf16"},
    "bf16 params + adamw-bf16": {"params": "bf16", "optimizer": "adamw-bf16"},
    "8-bit moments (adamw-8bit)": {"optimizer": "adamw-8bit"},
    "bf16 params + adamw-8bit": {"params": "bf16", "optimizer": "adamw-8bit"},
    "fp32 AdamW, FP8 teacher": {"teacher_dtype": "fp8"},
    "bf16 + adamw-8bit + FP8 teacher, best=disk": {"params": "bf16", "optimizer": "adamw-8bit", "teacher_dtype": "fp8",
                                                   "best": "disk"},
}


def run_mode(name: str, steps: int, seed: int) -> dict:
    """One distillation in this process; its figures."""
    import tempfile

    import torch

    from puzzlekit import ir
    from puzzlekit.backends.torch import materialize
    from puzzlekit.backends.torch.device import Compute
    from puzzlekit.evaluation import metrics
    from puzzlekit.passes import PassManager
    from puzzlekit.passes.distill import Distill, distill
    from puzzlekit.passes.distill.sharding import block_groups
    from puzzlekit.text.data import corpus_for, held_out_windows
    from puzzlekit.tools.default_model import model_path
    from puzzlekit.training import state_bytes

    torch.set_num_threads(1)
    options = MODES[name]
    parent = ir.load(model_path(None))
    child = parent.copy()
    PassManager(CHILD).run(child)
    pruned_child = child.copy()
    with tempfile.TemporaryDirectory() as state:
        d = Distill(steps=steps, batch=8, seq=128, lr=1e-3, warmup=10, eval_every=50, eval_windows=16, seed=seed,
                    state=state, checkpoint_every=steps, **options)
        report = distill(child, parent, d, state_dir=Path(state), compute=Compute(dtype=torch.bfloat16))
    windows = held_out_windows(corpus_for(parent, None), "report", 129, limit=32)
    teacher, student = materialize(parent), materialize(child)  # float32: the exact reference
    with torch.no_grad():
        t_logits = teacher(windows[:, :-1])[0]
        kl = metrics.kl(t_logits, student(windows[:, :-1])[0]).mean().item()
        pruned = metrics.kl(t_logits, materialize(pruned_child)(windows[:, :-1])[0]).mean().item()
    model = materialize(child)
    low = {id(p) for n in child.nodes for g in block_groups(model, n) for p in g.parameters()}
    counts = {"bf16": sum(p.numel() for p in model.parameters() if id(p) in low), "fp32": 0}
    counts["fp32"] = sum(p.numel() for p in model.parameters()) - counts["bf16"]
    held = options.get("params", "fp32")
    cost = {"device": 0.0, "host": 0.0}
    for dtype, n in counts.items():
        per = state_bytes(dtype if held == "bf16" else "fp32", options.get("optimizer", "adamw"),
                          best=options.get("best", "host"))
        for k in cost:
            cost[k] += per[k] * n
    measured = _measured_state(child, held, options.get("optimizer", "adamw-cosine"))
    params = sum(counts.values())
    return {"mode": name, "seed": seed, "kl": kl, "pruned": pruned, "steps": report["steps"],
            "kept": report["kept"], "seconds": report["seconds"], "bytes_per_param": cost["device"] / params,
            "measured_bytes_per_param": measured / params,
            "state_mb": cost["device"] / 2 ** 20, "host_mb": cost["host"] / 2 ** 20,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _measured_state(prog, params: str, optimizer: str) -> int:
    """The bytes the student's parameters, gradients and optimizer state hold after a step (torchao's 8-bit
    moments quantise only tensors of at least 4096 elements: the built-in model's small ones stay whole)."""
    import torch

    from puzzlekit.backends.torch.device import Compute
    from puzzlekit.passes.distill import OPTIMIZERS, Distill
    from puzzlekit.passes.distill.sharding import _build

    def nbytes(t):
        if hasattr(t, "__tensor_flatten__"):
            return sum(nbytes(getattr(t, n)) for n in t.__tensor_flatten__()[0])
        return t.numel() * t.element_size()

    model = _build(prog, Compute(dtype=torch.bfloat16), None, train=True, checkpointing=False, params=params)
    opt = OPTIMIZERS[optimizer](Distill(steps=1, params=params, optimizer=optimizer)).optimizer(model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    moments = sum(nbytes(v) for st in opt.state.values() for k, v in st.items() if k != "step")
    return moments + sum(2 * nbytes(p) for p in model.parameters())


def teacher_kl() -> dict:
    """KL of the FP8 teacher (teacher_dtype=fp8) from the bfloat16 teacher (the default on CUDA) and from the
    float32 one, on the `report` windows, and the bytes each holds."""
    import torch

    from puzzlekit import ir
    from puzzlekit.backends.torch.device import Compute
    from puzzlekit.evaluation import metrics
    from puzzlekit.passes.distill.sharding import _build
    from puzzlekit.text.data import corpus_for, held_out_windows
    from puzzlekit.tools.default_model import model_path

    parent = ir.load(model_path(None))
    x = held_out_windows(corpus_for(parent, None), "report", 129, limit=32)[:, :-1]
    out, size = {}, {}
    for name, compute, dtype in (("fp32", Compute(), "auto"), ("bf16", Compute(dtype=torch.bfloat16), "auto"),
                                 ("fp8", Compute(dtype=torch.bfloat16), "fp8")):
        model = _build(parent, compute, None, train=False, checkpointing=False, teacher_dtype=dtype)
        with torch.no_grad():
            out[name] = model(x)[0].float()
        size[name] = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"fp8_vs_bf16": metrics.kl(out["bf16"], out["fp8"]).mean().item(),
            "fp8_vs_fp32": metrics.kl(out["fp32"], out["fp8"]).mean().item(),
            "bf16_vs_fp32": metrics.kl(out["fp32"], out["bf16"]).mean().item(), "bytes": size}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--seeds", default="0", help="comma-separated seeds, each mode run with each")
    ap.add_argument("--modes", default="", help="comma-separated mode numbers (1 = the baseline; default all)")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once, one thread each")
    ap.add_argument("--results", help="a JSON-lines file: runs found there are not run again, new ones added")
    ap.add_argument("--mode", help=argparse.SUPPRESS)  # one run in this process (how the others are run)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:
        print(json.dumps(run_mode(args.mode, args.steps, args.seed)))
        return
    names = list(MODES)
    chosen = [names[int(i) - 1] for i in args.modes.split(",")] if args.modes else names
    runs = [(name, int(seed)) for name in chosen for seed in args.seeds.split(",")]
    done = []
    if args.results and Path(args.results).exists():
        done = [json.loads(line) for line in Path(args.results).read_text().splitlines() if line.strip()]
    have = {(r["mode"], r["seed"], r["steps"]) for r in done}

    def child(run):
        name, seed = run
        p = subprocess.run([sys.executable, __file__, "--mode", name, "--seed", str(seed), "--steps",
                            str(args.steps)], capture_output=True, text=True)
        if p.returncode:
            raise SystemExit(f"{name}, seed {seed}: {p.stderr[-2000:]}")
        row = json.loads(p.stdout.strip().splitlines()[-1])
        if args.results:
            with open(args.results, "a") as f:
                f.write(json.dumps(row) + "\n")
        return row

    with ThreadPoolExecutor(args.jobs) as pool:
        rows = done + list(pool.map(child, [r for r in runs if (*r, args.steps) not in have]))
    rows = [r for r in rows if r["steps"] == args.steps]
    rows.sort(key=lambda r: (names.index(r["mode"]), r["seed"]))
    paired = {r["seed"]: r["kl"] for r in rows if r["mode"] == names[0]}  # the baseline of each seed
    base = sum(paired.values()) / len(paired) if paired else float("nan")
    print(f"pruned child of the built-in model ({CHILD}), {args.steps} steps of 8 x 128 tokens, lr 1e-3, bfloat16 "
          f"forward; held-out KL to the float32 teacher on `report` (the pruned child's: {rows[0]['pruned']:.4f})")
    print("| mode | seed | held-out KL | vs baseline (same seed) | training s | bytes/param: state_bytes | "
          "measured here | host MiB | peak RSS MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['seed']} | {r['kl']:.4f} | {r['kl'] / paired.get(r['seed'], base) - 1:+.1%} | "
              f"{r['seconds']:.0f} | "
              f"{r['bytes_per_param']:.2f} | {r['measured_bytes_per_param']:.2f} | {r['host_mb']:.1f} | "
              f"{r['peak_rss_mb']:.0f} |")
    t = teacher_kl()
    print(f"\nthe teacher on `report`: KL(bf16 || FP8) {t['fp8_vs_bf16']:.5f}, KL(fp32 || FP8) {t['fp8_vs_fp32']:.5f}, "
          f"KL(fp32 || bf16) {t['bf16_vs_fp32']:.5f}; bytes fp32 / bf16 / FP8: "
          + " / ".join(f"{v / 2 ** 20:.2f} MiB" for v in t["bytes"].values()))
    print("\n| mode | seeds | held-out KL, mean ± sd | vs baseline, paired by seed |")
    print("|---|---|---|---|")
    for name in names:
        kls = {r["seed"]: r["kl"] for r in rows if r["mode"] == name}
        if len(kls) > 1:
            mean = sum(kls.values()) / len(kls)
            sd = (sum((k - mean) ** 2 for k in kls.values()) / (len(kls) - 1)) ** 0.5
            rel = [k / paired[s] - 1 for s, k in kls.items() if s in paired]
            print(f"| {name} | {len(kls)} | {mean:.4f} ± {sd:.4f} | {sum(rel) / max(1, len(rel)):+.1%} |")


if __name__ == "__main__":
    main()
