"""docs/scale.md's table: what compressing Nemotron-3-Super and Nano takes on 1xH100, 8xH100, 8xB200 and 2x8xB200,
from `--estimate` on the shipped configs (no weights): memory per GPU, host memory per node and hours per stage, with
the settings `auto` picks for each, at a full-size run's budgets.

The pipeline is compress's own (library, search for a 2x child for serving on an 8xB200 node for Super, 8xH100 for
Nano, distillation of it, the MTP head's recovery and check, NVFP4 quantisation, then the outputs: the report, the
frontier, the engine bundle) with the budgets below; the stages after the search are estimated at the child a
weightless search picks for the target.

Run: python benchmarks/scale_table.py [--models ...] [--hardware h100:1 h100:8 b200:8 b200:16] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MODELS = ("nemotron-3-super-120b-a12b", "nemotron-3-nano-30b-a3b")
HARDWARE = ("h100:1", "h100:8", "b200:8", "b200:16")
#: the distillation budget a full-size recovery takes (5,000 steps of 256 rows of 4,096 tokens)
DISTILL = "steps=5000,batch=256,seq=4096,lr=1e-4,eval_every=250,eval_windows=64,state=/tmp/state"
PIPELINE = ("snapshot{{name=teacher}},library{{out=/tmp/lib}},"
            "puzzle{{library=/tmp/lib,target=[{target}],speedup=2,parent=teacher}},"
            "distill{{" + DISTILL + "}},"
            "mtp-check{{prompts=8,new_tokens=32}},"
            "distill{{head_only=true,steps=500,batch=64,seq=4096,mtp_self=1.0,state=/tmp/head}},"
            "quantize{{recipe=nvfp4}}")
GiB = 2**30


#: the serving target each model is compressed for (whatever it is compressed on)
TARGETS = {"nemotron-3-super-120b-a12b": "8xb200", "nemotron-3-nano-30b-a3b": "8xh100"}


def row(model: str, hw_text: str) -> dict:
    from puzzlekit import ir
    from puzzlekit.estimate import estimate, parse_hardware
    from puzzlekit.passes import parse_pipeline
    from puzzlekit.tools.compress import head_work
    from puzzlekit.tools.compress_outputs import outputs_work
    from puzzlekit.tools.default_model import model_path

    prog = ir.load(model_path(model))
    hw = parse_hardware(hw_text)
    target = TARGETS.get(model, "8xb200")
    passes = head_work(parse_pipeline(PIPELINE.format(target=target)), prog)
    work = outputs_work(argparse.Namespace(quick=False, target=target, scenario="chat"))  # compress's, not --quick
    est = estimate(passes, prog, hw, hw.host_bytes // 2 if hw.kind == "gpu" else 2**40, model, writes=True,
                   plan=True, auto=True, outputs=work)
    return est.as_json() | {"auto_line": est.choices()}


def cell(stage: dict, node: int) -> str:
    mem = stage["peak_memory_bytes"] / GiB
    host = stage.get("host_bytes", 0) * (1 if stage.get("rank0_alone") else node) / GiB
    text = f"{mem:,.0f} GiB, host {host:,.0f} GiB, {stage['seconds'] / 3600:.1f} h"
    return text if stage["fits"] else text + " (**does not fit**)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--hardware", nargs="+", default=list(HARDWARE))
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    out = {}
    for model in a.models:
        got = {hw: row(model, hw) for hw in a.hardware}
        out[model] = got
        names = [s["stage"] for s in next(iter(got.values()))["stages"]]
        print(f"\n{model}\n")
        print("| stage | " + " | ".join(a.hardware) + " |")
        print("|---|" + "---|" * len(a.hardware))
        for i, name in enumerate(names):
            cells = [cell(got[hw]["stages"][i], min(int(hw.split(":")[1]), 8)) for hw in a.hardware]
            print(f"| {name} | " + " | ".join(cells) + " |")
        print("| total | " + " | ".join(f"{got[hw]['seconds'] / 3600:.1f} h" + ("" if got[hw]["fits"] else " (no)")
                                       for hw in a.hardware) + " |")
        for hw in a.hardware:
            child = got[hw].get("planned_child_params")
            print(f"- {hw}: child {child / 1e9:.1f}B; {got[hw]['auto_line'] or 'auto chose nothing'}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    sys.exit(main())
