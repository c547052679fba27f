"""Memory flat in model size, time linear: peak resident memory and wall time of `library`, `run -p quantize`,
`eval` and `distill` (1 and 2 ranks) over synthetic NemotronH checkpoints of growing size, each command in a
fresh process under `/usr/bin/time -v`, with a fixed `--max-memory`.

Run: python benchmarks/scale.py [--sizes 0.25 0.5 1 2] [--max-memory 0.5GB] [--plot scale.png]
                                [--stages library quantize eval distill]

The checkpoints (float32, Mamba-2 / MoE / attention layers of hidden 1024, 512 MiB shards) are written by
puzzlekit's own writer with every tensor generated as it is written, so writing one needs no more memory
than its largest tensor; their vocabulary is the byte vocabulary (256), so the commands need no tokenizer. The
acceptance line printed for `library` and `quantize` is peak <= --max-memory + 1 GB, whatever the checkpoint's
size (the interpreter, torch and one layer's transient work beside the budget).
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GB = 1e9
#: one repeat of the synthetic model's layer pattern: Mamba-2, MoE, Mamba-2, attention, MoE (as Nemotron-H)
UNIT = "MEM*E"


def config(layers: int) -> dict:
    """A small NemotronH (Hugging Face `nemotron_h`) config with `layers` layers."""
    pattern = (UNIT * (layers // len(UNIT) + 1))[:layers]
    return {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": 256,
            "hidden_size": 1024, "num_hidden_layers": layers, "hybrid_override_pattern": pattern,
            "mamba_num_heads": 32, "mamba_head_dim": 64, "n_groups": 4, "ssm_state_size": 64, "conv_kernel": 4,
            "expand": 2, "chunk_size": 64, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64,
            "n_routed_experts": 16, "num_experts_per_tok": 2, "moe_intermediate_size": 1024,
            "moe_shared_expert_intermediate_size": 1024, "n_shared_experts": 1, "routed_scaling_factor": 1.0,
            "norm_topk_prob": True, "intermediate_size": 2048, "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False,
            "torch_dtype": "float32", "num_nextn_predict_layers": 0, "use_conv_bias": True, "mamba_hidden_act": "silu",
            "mlp_hidden_act": "relu2"}


WRITER = """
import json, math, sys, torch
from pathlib import Path
from puzzlekit import ir
from puzzlekit.ir.checkpoint import program_from_config
from puzzlekit.ir.weights import Deferred
cfg, out = json.loads(sys.argv[1]), sys.argv[2]
prog = program_from_config(cfg, Path("config.json"))
for i, n in enumerate(prog.nodes):
    for local, shape in n.op.params().items():
        leaf = local.rsplit(".", 1)[-1]
        def make(shape=shape, leaf=leaf, seed=hash((i, local)) % 2**31):
            g = torch.Generator().manual_seed(seed)
            if leaf == "A_log":
                return torch.log(torch.arange(1, shape[0] + 1, dtype=torch.float32))
            if leaf in ("D", "weight") and len(shape) == 1:
                return torch.ones(shape)
            if leaf in ("dt_bias", "bias", "e_score_correction_bias"):
                return torch.zeros(shape)
            return torch.randn(shape, generator=g) * 0.02
        prog.weights.set(f"{n.path}.{local}", Deferred(make, tuple(shape), torch.float32,
                                                       stored_bytes=4 * math.prod(shape)))
ir.save(prog, out, max_shard_bytes=512 * 2**20)
"""


def layers_for(size_gb: float) -> int:
    """The layer count whose float32 checkpoint is closest to `size_gb`."""
    from puzzlekit.ir.checkpoint import program_from_config

    per = {}
    for n in (len(UNIT), 2 * len(UNIT)):
        per[n] = 4 * program_from_config(config(n), Path("config.json")).param_counts()["total"]
    layer = (per[2 * len(UNIT)] - per[len(UNIT)]) / len(UNIT)
    fixed = per[len(UNIT)] - layer * len(UNIT)
    return max(2, round((size_gb * GB - fixed) / layer))


def timed(cmd: list[str], env: dict | None = None) -> dict:
    """Wall seconds, CPU seconds (user + system: steadier than wall time next to other work) and peak RSS (GB) of
    `cmd` under /usr/bin/time -v (the largest of its processes: under torchrun, the largest rank's)."""
    start = time.perf_counter()
    p = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    peak = max(int(m) for m in re.findall(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr)) * 1024
    cpu = sum(float(m) for m in re.findall(r"(?:User|System) time \(seconds\): ([0-9.]+)", p.stderr))
    return {"seconds": seconds, "cpu_seconds": cpu, "peak_gb": peak / GB}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0], help="checkpoint sizes in GB")
    ap.add_argument("--max-memory", default="0.5GB", help="the budget every command runs with")
    ap.add_argument("--plot", help="write a plot of peak memory and time against size")
    ap.add_argument("--stages", nargs="+", default=["library", "quantize", "eval", "distill"],
                    choices=["library", "quantize", "eval", "distill"])
    ap.add_argument("--keep", help="directory to keep the checkpoints in (default: a temporary one, removed)")
    args = ap.parse_args()
    work = Path(args.keep or tempfile.mkdtemp(prefix="puzzlekit-scale-"))
    grid = work / "grid.toml"
    grid.write_text('[mamba2]\nheads = [16]\n[moe]\nexperts = [8]\n[attention]\nq_heads = [8]\n')
    py, mem = sys.executable, ["--max-memory", args.max_memory]
    cli = [py, "-m", "puzzlekit.tools"]
    rows = []
    for size in args.sizes:
        n = layers_for(size)
        ckpt = work / f"ckpt-{size:g}GB"
        if not (ckpt / "config.json").exists():
            subprocess.run([py, "-c", WRITER, json.dumps(config(n)), str(ckpt)], check=True)
        actual = sum(f.stat().st_size for f in ckpt.glob("*.safetensors")) / GB
        out = work / f"out-{size:g}"
        shutil.rmtree(out, ignore_errors=True)
        commands = {
            "library": [*cli, "library", str(ckpt), "-o", str(out / "lib"), "--grid", str(grid), "--calib-windows",
                        "4", "--score-windows", "2", "--seq", "64", "--bld-tokens", "512", "--json", *mem],
            "quantize": [*cli, "run", str(ckpt), "-p", "quantize{recipe=fp8,samples=4,seq=64}", "-o",
                         str(out / "fp8"), *mem],
            "eval": [*cli, "eval", str(ckpt), "--windows", "4", "--seq", "64", "--json", *mem],
        }
        runs = {k: timed(c) for k, c in commands.items() if k in args.stages}
        if "distill" in args.stages:
            pipe = "snapshot{name=teacher},distill{shard=fsdp,mtp=0,steps=2,batch=2,seq=32,eval_every=2,eval_windows=1}"
            runs["distill x1"] = timed([*cli, "run", str(ckpt), "-p", pipe, "-o", str(out / "d1"), *mem])
            runs["distill x2"] = timed([py, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
                                             "puzzlekit.tools", "run", str(ckpt), "-p", pipe, "-o", str(out / "d2"),
                                             *mem])
        shutil.rmtree(out, ignore_errors=True)
        rows.append({"size_gb": actual, "layers": n, **runs})
        print(json.dumps(rows[-1]), flush=True)
    stages = [k for k in rows[0] if k not in ("size_gb", "layers")]
    print(f"\nbudget --max-memory {args.max_memory}; peak resident GB / wall seconds")
    print(f"{'checkpoint GB':>14} {'layers':>6} " + " ".join(f"{s:>18}" for s in stages))
    for r in rows:
        print(f"{r['size_gb']:>14.2f} {r['layers']:>6} "
              + " ".join(f"{r[s]['peak_gb']:>8.2f} GB {r[s]['seconds']:>5.0f} s" for s in stages))
    from puzzlekit.memory import parse_size

    big = rows[-1]
    bound = parse_size(args.max_memory) / GB + 1.0
    for s in [s for s in ("library", "quantize") if s in big]:
        ok = big[s]["peak_gb"] <= bound
        print(f"{s}: peak {big[s]['peak_gb']:.2f} GB on {big['size_gb']:.2f} GB; bound --max-memory + 1 GB = "
              f"{bound:.2f} GB: {'within' if ok else 'OVER'}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        xs = [r["size_gb"] for r in rows]
        for s in stages:
            a.plot(xs, [r[s]["peak_gb"] for r in rows], marker="o", label=s)
            b.plot(xs, [r[s]["seconds"] for r in rows], marker="o", label=s)
        a.plot(xs, xs, "k:", label="checkpoint size")
        a.set(xlabel="checkpoint GB", ylabel="peak resident GB", title=f"memory (--max-memory {args.max_memory})")
        b.set(xlabel="checkpoint GB", ylabel="wall seconds", title="time")
        a.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
