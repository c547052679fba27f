"""`--estimate` against measurement: each stage's estimated peak memory and time beside what the same command
measures in a fresh process (/usr/bin/time -v), on the Super-counts miniature (benchmarks/counts.py's commands)
and on the scale benchmark's 1.95 GB checkpoint (`library` under `--max-memory 1GB`). Target: peak within 25%,
time within 2x.

The distillation also runs in each state mode (`MODES`: bf16 parameters and moments, 8-bit moments, an FP8
teacher), each a row of its own beside float32 AdamW's. Offload has no row: on a CPU there is nowhere to move the
state to.

Run: python benchmarks/estimate.py [--keep DIR] [--stages library distill distill-bf16 ... scale-library]
                                   [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import counts  # noqa: E402
import scale  # noqa: E402

#: the distillation's state modes (distill's options, and the command's), each a row beside the float32 AdamW
#: one (`distill`); bf16 parameters need a bf16 forward (--dtype bfloat16, the default on CUDA)
MODES = {"distill-bf16": ("params=bf16,optimizer=adamw-bf16", ["--dtype", "bfloat16"]),
         "distill-8bit": ("optimizer=adamw-8bit", []), "distill-fp8-teacher": ("teacher_dtype=fp8", [])}
STAGES = ("library", "distill", *MODES, "quantize-fp8", "quantize-nvfp4", "mtp-check", "scale-library", "library-held")


def estimated(cmd: list[str]) -> dict:
    p = subprocess.run([*cmd, "--estimate", "--json"], capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} --estimate failed: {p.stderr[-500:]}")
    e = json.loads(p.stdout)
    return {"peak_gb": max(s["peak_memory_bytes"] for s in e["stages"]) / 1e9, "seconds": e["seconds"],
            "stages": [s["stage"] for s in e["stages"]]}


def scale_checkpoint(work: Path) -> Path:
    out = work / "scale-2gb"
    if not (out / "config.json").exists():
        subprocess.run([sys.executable, "-c", scale.WRITER, json.dumps(scale.config(28)), str(out)], check=True)
    return out


#: the library command with a layer's variants held until all are scored (build_library's hold_all): the same library
HELD = """import functools, sys
import puzzlekit.passes.puzzle as puzzle
from puzzlekit.tools.cli import main
puzzle.build_library = functools.partial(puzzle.build_library, hold_all=True)
sys.exit(main(sys.argv[1:]))
"""


def one_variant_library(cmd: list[str]) -> dict:
    """The library command as it runs (one variant at a time) beside the same command holding every variant of a
    layer until it is scored, one after the other from a fresh library: the estimate against the first, then the
    memory one variant at a time saves and the time it costs."""
    lib = Path(cmd[cmd.index("-o") + 1])
    got = {}
    for name, run in (("one", cmd), ("held", [sys.executable, "-c", HELD, *cmd[3:]])):
        shutil.rmtree(lib, ignore_errors=True)
        got[name] = counts.timed(run)
    est, one, held = estimated(cmd), got["one"], got["held"]
    if "error" in one or "error" in held:
        print(f"{'library-held':<16} failed: {one.get('error') or held.get('error')}")
        return {"stage": "library-held", "estimate": est, "measured": got}
    print(f"{'library (one)':<16} {est['peak_gb']:>8.2f}GB {one['peak_gb']:>6.2f}GB "
          f"{est['peak_gb'] / one['peak_gb']:>6.2f} {est['seconds']:>9.0f}s {one['wall_s']:>7.0f}s "
          f"{est['seconds'] / one['wall_s']:>6.2f}\n"
          f"{'library (held)':<16} {'':>10} {held['peak_gb']:>6.2f}GB {'':>6} {'':>10} {held['wall_s']:>7.0f}s   "
          f"one variant at a time: {held['peak_gb'] - one['peak_gb']:+.3f} GB saved, "
          f"{one['cpu_s'] - held['cpu_s']:+.1f} s CPU", flush=True)
    return {"stage": "library-held", "estimate": est, "measured": got}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keep", type=Path, help="a directory to build in and keep (reused when it holds the models)")
    ap.add_argument("--stages", nargs="*", default=list(STAGES), choices=STAGES)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    work = a.keep or Path(tempfile.mkdtemp(prefix="estimate-"))
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "super-88x512"
    if not (ckpt / "config.json").exists():
        counts.build(ckpt)
    data = work / "corpus.jsonl"
    if not data.exists():
        counts.corpus(data)
    shutil.rmtree(work / "out", ignore_errors=True)  # a library left by an earlier run would only be resumed
    (work / "out").mkdir()
    cmds = counts.commands(ckpt, work / "out", data)
    cli = [sys.executable, "-m", "puzzlekit.tools"]
    for name, (options, extra) in MODES.items():  # counts.py's distill command with the mode's options
        cmds[name] = [*cli, "run", str(ckpt), "-p", f"snapshot{{name=teacher}},distill{{steps=4,seq={counts.SEQ},"
                      f"{options}}}", "-o", str(work / "out" / name), "--overwrite", "--data", str(data), *extra]
    if "scale-library" in a.stages:
        big = scale_checkpoint(work)
        grid = work / "scale-grid.toml"  # benchmarks/scale.py's library command
        grid.write_text('[mamba2]\nheads = [16]\n[moe]\nexperts = [8]\n[attention]\nq_heads = [8]\n')
        cmds["scale-library"] = [*cli, "library", str(big), "-o", str(work / "out" / "scale-lib"), "--grid", str(grid),
                                 "--calib-windows", "4", "--score-windows", "2", "--seq", "64", "--bld-tokens", "512",
                                 "--max-memory", "1GB"]
    rows = []
    print(f"{'stage':<16} {'est. peak':>10} {'peak':>8} {'ratio':>6} {'est. time':>10} {'wall':>8} {'ratio':>6}")
    for name in a.stages:
        if name == "library-held":
            rows.append(one_variant_library(cmds["library"]))
            continue
        est = estimated(cmds[name])
        got = counts.timed(cmds[name])
        row = {"stage": name, "estimate": est, "measured": got}
        rows.append(row)
        if "error" in got:
            print(f"{name:<16} failed: {got['error']}")
            continue
        print(f"{name:<16} {est['peak_gb']:>8.2f}GB {got['peak_gb']:>6.2f}GB {est['peak_gb'] / got['peak_gb']:>6.2f} "
              f"{est['seconds']:>9.0f}s {got['wall_s']:>7.0f}s {est['seconds'] / got['wall_s']:>6.2f}", flush=True)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
