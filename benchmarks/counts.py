"""Nemotron-3-Super's counts at small widths: every stage's wall time, CPU time and peak memory, and how they grow.

The miniature is a transformers `NemotronHForCausalLM` (seeded) with Super's counts: 88 layers in Super's pattern,
512 routed experts routing 22 over a latent width, 128 Mamba heads in 8 groups, 32 query and 2 KV heads, one MTP
layer ("*E"); every width shrunk (hidden 64, expert d_ff 32, latent 32, shared d_ff 64, Mamba head dim 8, state
16, attention head dim 16, byte vocabulary): about 200 MB in float32, where the real model's ~41,000 expert
matrices are each 1,024 x 2,688. Each stage runs in a fresh process under /usr/bin/time -v; beside them,
transformers' own forward over the same windows and generate on the same MTP prompts, on the same weights.

`--layers 22 44 88` and `--experts 64 512` build variants (experts at equal bytes: d_ff scaled by 512 / experts);
the growth exponents d log(CPU time) / d log(count) are printed for the stages run on more than one variant.

Run: python benchmarks/counts.py [--layers 88] [--experts 512] [--topk 22] [--stages eval quantize-fp8 ...]
                                 [--keep DIR] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SUPER = ("MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*EMEMEMEME")
LETTER = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
HIDDEN, D_FF, LATENT, SHARED = 64, 32, 32, 64
WINDOWS, SEQ = 4, 128
STAGES = ("inspect", "eval", "generate", "library", "plan", "distill", "quantize-fp8", "quantize-nvfp4", "mtp-check",
          "export-onnx", "build-engine", "check-serving", "compress")


def pattern(layers: int) -> str:
    """Super's pattern cut to `layers` (its first `layers` letters, so the mix of kinds stays Super's)."""
    return (SUPER * (layers // len(SUPER) + 1))[:layers]


def build(out: Path, layers: int = 88, experts: int = 512, top_k: int = 22, seed: int = 0) -> Path:
    """Writes the miniature (transformers' checkpoint plus an MTP layer in it, as Nemotron-3 ships one)."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import NemotronHConfig, NemotronHForCausalLM

    from puzzlekit.ir.ops import MTP, Attention, MoE
    from puzzlekit.tools.miniature import seeded_init

    d_ff = max(8, D_FF * 512 // experts)  # equal bytes across expert counts
    cfg = NemotronHConfig(
        vocab_size=256, hidden_size=HIDDEN, layers_block_type=[LETTER[c] for c in pattern(layers)],
        num_attention_heads=32, num_key_value_heads=2, head_dim=16, intermediate_size=128, mamba_num_heads=128,
        mamba_head_dim=8, n_groups=8, ssm_state_size=16, conv_kernel=4, chunk_size=64, n_routed_experts=experts,
        num_experts_per_tok=top_k, moe_intermediate_size=d_ff, moe_shared_expert_intermediate_size=SHARED,
        moe_latent_size=LATENT, routed_scaling_factor=5.0, tie_word_embeddings=False, eos_token_id=-1,
        pad_token_id=0)
    torch.manual_seed(seed)
    model = NemotronHForCausalLM(cfg).float().eval()
    g = seeded_init(model, seed + 1)  # transformers' init is tiny: give routing and logits something to decide
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    eps = cfg.layer_norm_epsilon
    head = MTP(HIDDEN, (Attention(HIDDEN, 32, 2, 16, eps),
                        MoE(HIDDEN, experts, top_k, d_ff, SHARED, LATENT, scaling=5.0, norm_topk=True, eps=eps)), eps)
    tensors = load_file(str(out / "model.safetensors"))
    for k, shape in head.params().items():
        t = torch.randn(shape, generator=g) * shape[-1] ** -0.5
        tensors[f"mtp.{k}"] = (1 + 0.1 * t if len(shape) == 1 else t).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1,
                                                          "mtp_hybrid_override_pattern": "*E"}, indent=2))
    return out


def corpus(path: Path) -> Path:
    """Plain text from the standard library's own source (no download), enough for every stage's windows."""
    import sysconfig

    src = Path(sysconfig.get_paths()["stdlib"])
    texts = [f.read_text(errors="replace") for f in sorted(src.glob("*.py"))[:200]]
    path.write_text("".join(json.dumps({"text": t[:6000]}) + "\n" for t in texts if len(t) > 500))
    return path


#: the stages that take --threads (the others run no model, or none long)
THREADED = ("eval", "generate", "library", "distill", "quantize-fp8", "quantize-nvfp4", "mtp-check", "build-engine",
            "compress")


def commands(ckpt: Path, work: Path, data: Path) -> dict[str, list[str]]:
    cli = [sys.executable, "-m", "puzzlekit.tools"]
    grid = work / "grid.toml"
    grid.write_text("[mamba2]\nheads = [0.5]\n[moe]\nexperts = [0.5]\ntop_k = [0.5]\n[attention]\nkv_heads = [1]\n")
    lib = work / "lib"
    d = ["--data", str(data)]
    run = lambda pipe, name: [*cli, "run", str(ckpt), "-p", pipe, "-o", str(work / name), "--overwrite", *d]
    return {
        "inspect": [*cli, "inspect", str(ckpt)],
        "eval": [*cli, "eval", str(ckpt), "--windows", str(WINDOWS), "--seq", str(SEQ), *d],
        "generate": [*cli, "generate", str(ckpt), "--prompt", "def main(", "--max-new-tokens", "32"],
        "library": [*cli, "library", str(ckpt), "-o", str(lib), "--grid", str(grid), "--bld-tokens", "128",
                    "--calib-windows", "2", "--score-windows", "1", "--seq", str(SEQ), *d],
        "plan": [*cli, "plan", str(lib), "--target", "h100", "--speedup", "1.3"],
        "distill": run(f"snapshot{{name=teacher}},distill{{steps=4,seq={SEQ}}}", "distilled"),
        "quantize-fp8": run("quantize{recipe=fp8}", "fp8"),
        "quantize-nvfp4": run("quantize{recipe=nvfp4-hybrid}", "nvfp4"),
        "mtp-check": run("snapshot{name=teacher},mtp-check", "mtp"),
        "export-onnx": [*cli, "export-onnx", str(ckpt), "--target", "h100", "-o", str(work / "onnx"), "--overwrite"],
        "build-engine": [*cli, "build-engine", str(ckpt), "--target", "h100", "--build", "no", "-o",
                         str(work / "bundle"), "--overwrite"],
        "check-serving": [*cli, "check-serving", str(work / "fp8")],
        "compress": [*cli, "compress", str(ckpt), "--quick", "--target", "h100", "--speedup", "1.5", "-o",
                     str(work / "compress"), *d],
    }


def timed(cmd: list[str], env: dict | None = None) -> dict:
    """Wall and CPU seconds and peak resident memory (GB) of `cmd` in a fresh process (/usr/bin/time -v), with
    `env` added to the environment."""
    start = time.perf_counter()
    p = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True, env={**os.environ, **(env or {})})
    wall = time.perf_counter() - start
    if p.returncode:
        said = [line for line in p.stderr.splitlines() if line.strip() and not line.startswith("\t")]
        return {"error": (said or ["?"])[-1][:200], "wall_s": wall}
    field = lambda name: float(re.search(rf"{name}: ([\d.]+)", p.stderr).group(1))
    return {"wall_s": wall, "cpu_s": field(r"User time \(seconds\)") + field(r"System time \(seconds\)"),
            "peak_gb": field(r"Maximum resident set size \(kbytes\)") * 1024 / 1e9}


TRANSFORMERS = """
import json, sys, time, torch, resource
from transformers import AutoModelForCausalLM
from puzzlekit import ir
from puzzlekit.text import data as D
from puzzlekit.text.tokenizer import tokenizer_of
ckpt, datafile, windows, seq = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
t0, c0 = time.perf_counter(), time.process_time()
model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
load = time.perf_counter() - t0
ids = torch.randint(0, 256, (windows, seq + 1))
t1, c1 = time.perf_counter(), time.process_time()
with torch.no_grad():
    model(ids)
fwd = time.perf_counter() - t1
t2 = time.perf_counter()
with torch.no_grad():  # the MTP prompts eval runs: 8 prompts of 32 tokens, 32 new tokens each
    model.generate(torch.randint(0, 256, (8, 32)), max_new_tokens=32, do_sample=False, min_new_tokens=32)
gen = time.perf_counter() - t2
print(json.dumps({"load_s": load, "forward_s": fwd, "generate_s": gen, "wall_s": time.perf_counter() - t0,
                  "cpu_s": time.process_time() - c0,
                  "peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9}))
"""


def transformers_baseline(ckpt: Path) -> dict:
    p = subprocess.run([sys.executable, "-c", TRANSFORMERS, str(ckpt), "-", str(WINDOWS), str(SEQ)],
                       capture_output=True, text=True)
    if p.returncode:
        return {"error": p.stderr.strip().splitlines()[-1][:200]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def growth(rows: list[dict], key: str) -> dict[str, float]:
    """d log(CPU time) / d log(count) between the smallest and largest variant in `key`, per stage, others
    equal (CPU time: another job on the machine stretches the wall time far more)."""
    other = "experts" if key == "layers" else "layers"
    out = {}
    for stage, fixed in {(r["stage"], r[other]) for r in rows}:
        pts = sorted((r[key], r["cpu_s"]) for r in rows
                     if (r["stage"], r[other]) == (stage, fixed) and "error" not in r)
        if len(pts) >= 2 and pts[0][0] != pts[-1][0]:
            (a, ta), (b, tb) = pts[0], pts[-1]
            out[f"{stage} ({other} {fixed})"] = math.log(tb / ta) / math.log(b / a)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[88])
    ap.add_argument("--experts", type=int, nargs="+", default=[512])
    ap.add_argument("--topk", type=int, default=22)
    ap.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    ap.add_argument("--no-transformers", action="store_true", help="skip transformers' side")
    ap.add_argument("--threads", type=int, default=0,
                    help="intra-op threads of every stage (default: each stage's own choice, one per 20M parameters, "
                         "so the 88-layer model gets two where 44 layers get one)")
    ap.add_argument("--keep", help="build (and reuse) the miniatures here instead of a temporary folder")
    ap.add_argument("--json", help="write every row here")
    args = ap.parse_args()
    root = Path(args.keep or tempfile.mkdtemp(prefix="puzzlekit-counts-"))
    root.mkdir(parents=True, exist_ok=True)
    data = corpus(root / "corpus.jsonl")
    rows = []
    print(f"{'layers':>6} {'experts':>7} {'stage':<15} {'wall s':>8} {'cpu s':>8} {'peak GB':>8}")
    for layers in args.layers:
        for experts in args.experts:
            ckpt = root / f"super-{layers}x{experts}"
            if not (ckpt / "config.json").exists():
                build(ckpt, layers, experts, min(args.topk, experts))
            work = root / f"out-{layers}x{experts}"
            shutil.rmtree(work, ignore_errors=True)  # every stage writes afresh (library resumes otherwise)
            work.mkdir()
            cmds = commands(ckpt, work, data)
            if args.threads:  # one thread count for every size: the default follows the parameter count
                cmds = {k: c + ["--threads", str(args.threads)] if k in THREADED else c for k, c in cmds.items()}
            todo = [("transformers", None)] * (not args.no_transformers) + [(s, cmds[s]) for s in args.stages]
            for stage, cmd in todo:
                r = transformers_baseline(ckpt) if cmd is None else timed(cmd)
                r |= {"layers": layers, "experts": experts, "stage": stage}
                rows.append(r)
                shown = r.get("error") or f"{r['wall_s']:8.1f} {r.get('cpu_s', 0):8.1f} {r.get('peak_gb', 0):8.2f}"
                print(f"{layers:>6} {experts:>7} {stage:<15} {shown}", flush=True)
    for key in ("layers", "experts"):
        g = growth(rows, key)
        if g:
            print(f"growth in {key}: " + ", ".join(f"{s} {v:.2f}" for s, v in sorted(g.items())))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
