"""`puzzlekit inspect`, `passes` and `run`: a model's IR, the registered passes, and pipelines run over it."""
from __future__ import annotations

import os
import sys

from ..memory import parse_size
from ..outputs import check_output
from ..errors import UsageError
from .common import check_held_out, compute_of, emit, file_hashes, load_model, load_plugins, reads_text, versions


# -- commands ----------------------------------------------------------------------------------------------
def inspect(args) -> int:
    from .. import ir

    prog = ir.verify(load_model(args), check_finite=args.check_finite)
    c = prog.param_counts()
    emit(args, {"model": prog.meta["source"], "ir": ir.print_program(prog), "params_total": c["total"],
                "params_active": c["active"], "mtp_params_total": c["mtp_total"],
                "mtp_params_active": c["mtp_active"], "by_kind": c["by_kind"]},
         ir.print_program(prog) + "\n" + ir.format_params(prog))
    return 0


def passes(args) -> int:
    from ..passes import PASSES
    from ..passes.pipeline import describe_options

    load_plugins(args.plugin)
    rows = [{"name": n, "doc": c.doc(), "nested": c.nested, "options": describe_options(c), "module": c.__module__}
            for n, c in sorted(PASSES.items())]
    lines = []
    for r in rows:
        opts = ", ".join(f"{o['name']}: {o['type']}" + ("" if o["required"] else f" = {o['default']}")
                         for o in r["options"])
        lines.append(f"{r['name']}{{{opts}}}{'(...)' if r['nested'] else ''}\n    {r['doc']}")
    emit(args, {"passes": rows}, "\n".join(lines) + "\n")
    return 0


def run(args) -> int:
    from .. import ir
    from ..passes import Instrumentation, PassManager, parse_pipeline, print_pipeline, resolve_pipeline
    from ..passes.pipeline import PipelineSyntaxError
    from .default_model import model_path
    from .estimate import check_before_run

    load_plugins(args.plugin)
    compute_of(args)
    try:
        passes = parse_pipeline(resolve_pipeline(args.pipeline))
    except PipelineSyntaxError as e:
        raise UsageError(str(e)) from None
    src = model_path(args.model).resolve()
    if args.estimate:  # from the config and the options alone: no output, no text
        check_before_run(args, passes, ir.load(src))
        return 0
    need = sum(f.stat().st_size for f in src.glob("*.safetensors")) if src.is_dir() else 0  # about the output's
    out = check_output(args.output, [src, *(args.data or [])], args.overwrite, need)  # before the work, not after
    prog = load_model(args, text=reads_text(passes))
    check_before_run(args, passes, prog)  # a stage that cannot fit: refused before any work
    if reads_text(passes):  # every held-out set the passes draw windows from, before any of them runs
        from ..text.data import corpus_for

        check_held_out(passes, corpus_for(prog, args.data))
    ins = Instrumentation(verify_each=args.verify_each, print_ir_after=args.print_ir_after,
                          progress=not args.json and sys.stderr.isatty())
    before = prog.param_counts()
    pm = PassManager(passes, ins, args.device, args.dtype, args.max_memory, data=args.data)
    am = pm.run(prog)
    if int(os.environ.get("RANK", "0")):  # a data-parallel process under torchrun: rank 0 writes the result
        return 0
    prog.meta["provenance"] = {
        "pipeline": print_pipeline(passes), "versions": versions(),
        "input": {"path": str(src), "sha256": file_hashes(src)},
        "input_provenance": prog.meta.get("config", {}).get("provenance"),
        **({"plan": prog.meta["plan"]} if prog.meta.get("plan") else {}),
        **({"mtp_acceptance": {"length": checks[-1]["acceptance"], "drafts": checks[-1]["drafts"]}}
           if (checks := am.reports.get("mtp-check")) else {}),  # what `cost --mtp` prices the child with
    }
    shard = min(5 * 2**30, parse_size(args.max_memory) // 4) if args.max_memory else 5 * 2**30  # one shard is held
    ir.save(prog, out, overwrite=args.overwrite, extended=args.extended, max_shard_bytes=shard)
    after = prog.param_counts()
    text = "".join(f"{t * 1000:9.1f} ms  {name}\n" for name, t in ins.timings)
    text += f"params {before['total']:,} -> {after['total']:,} (active {before['active']:,} -> {after['active']:,})\n"
    text += f"wrote {out}\n"
    emit(args, {"output": str(out), "pipeline": print_pipeline(passes),
                "timings": [{"pass": n, "seconds": t} for n, t in ins.timings],
                "params_before": before["total"], "params_after": after["total"],
                "params_active_before": before["active"], "params_active_after": after["active"]}, text)
    return 0
