"""`puzzlekit cost`, `export-onnx` and `build-engine`: pricing a model on a target, and lowering it for one."""
from __future__ import annotations

import sys

from ..outputs import check_output
from ..errors import UsageError
from .common import compute_of, emit, load_model, scenario_of, versions, warn_unrunnable_recipe


def cost(args) -> int:
    from ..backends.cost import best_layout
    from ..backends.cost.explain import explain, format_explain
    from ..backends.cost.precision import weights_label
    from ..backends.cost.prices import provider_for, source_of
    from ..backends.measured import MeasuredProvider
    from ..backends.targets import get_target
    from ..ir.printer import format_table

    compute = compute_of(args)
    target = get_target(args.target)
    source_of(target, args.prices)  # a --prices the target cannot take: refused before the model is read
    prog = load_model(args)
    warn_unrunnable_recipe(args.recipe, [args.target])
    provider = MeasuredProvider(compute=compute) if target.kind == "cpu" else \
        provider_for(target, args.prices, args.engine)
    sc = scenario_of(args, prog, recipe=args.recipe, concurrency=args.concurrency)
    cm, r = best_layout(prog, target, sc, provider, engines=True)  # the search's split rule: no unservable layout
    s = r.scenario
    gb = 1e9
    rows = [("kind", "count", "weights GB", "state MB/req", "decode ms", "prefill ms")]
    for k, v in r.by_kind.items():
        rows.append((k, str(v["count"]), f"{v['weight_bytes'] / gb:.3f}", f"{v['state_bytes_per_request'] / 1e6:.2f}",
                     f"{v['decode_seconds'] * 1e3:.3f}", f"{v['prefill_seconds'] * 1e3:.2f}"))
    rows.append(("total", "", f"{r.weight_bytes / gb:.3f}", f"{r.state_bytes_per_request / 1e6:.2f}",
                 f"{r.decode_step_seconds * 1e3:.3f}", f"{r.prefill_seconds * 1e3:.2f}"))
    table = format_table(rows).rstrip("\n")
    tried = [("layout", "batch", "tokens/s", "tokens/s/user", "serving ms", "binding")] + [
        (x["layout"], "-", "-", "-", "-", f"unservable: {x['unservable']}") if x.get("unservable") else
        (x["layout"] + (" *" if x["layout"] == r.layout else ""), str(x["max_batch"]), f"{x['throughput']:,.0f}",
         f"{x['user_rate']:.1f}", f"{x['serve_step_ms']:.3f}", x["binding"] or "-") for x in r.layouts]
    priced = sum(not x.get("unservable") for x in r.layouts)
    mtp = (f", MTP drafting {s.mtp_draft} at {s.mtp_acceptance:g} tokens/step" if s.mtp_draft else "")
    p = r.prices
    source = (f"priced by {p['provider']}" + (f" ({p['library']}, {p['database']} tables of {p['system']}, "
                                              f"{p['mode']})" if p["provider"] == "tables" else "")
              + (f"; {p['note']}" if p.get("note") else "") + "\n")
    head = source + (f"{r.target}, scenario {s.name}: {s.input_len} in / {s.output_len} out, context {s.context_len}, "
            f"rate floor {s.rate_floor:g} tok/s, KV {s.kv_dtype}, weights {weights_label(prog, s.recipe)}{mtp}\n"
            f"layout {r.layout}" + (" (pinned)" if s.layout else f" (best of {priced}"
            + (f"; {len(r.layouts) - priced} no engine splits the model over" if priced < len(r.layouts) else "")
            + ")") + "\n")
    h = r.headroom
    tail = (f"\nparams {r.params_total / 1e9:.2f}B total, {r.params_active / 1e9:.2f}B active\n"
            f"memory per device: {r.device_weight_bytes / gb:.2f} GB weights (of {r.weight_bytes / gb:.2f} GB), "
            f"{r.reserve_bytes / gb:.2f} GB reserve (workspace and activations), "
            f"{r.device_state_bytes_per_request / gb:.3f} GB state per request\n"
            f"max concurrency at context {s.context_len}: {r.max_concurrency}\n"
            f"max batch meeting the rate floor: {r.max_batch} (decode step {r.decode_step_seconds * 1e3:.3f} ms, "
            f"serving step with prefills {r.serve_step_seconds * 1e3:.3f} ms)\n"
            f"throughput: {r.throughput_tokens_per_second:,.0f} tokens/s, {r.user_tokens_per_second:.1f} per user; "
            f"prefill {r.prefill_seconds:.3f} s\n"
            f"binding: {r.binding or 'none'}; headroom: {h['memory_bytes'] / gb:.2f} GB memory per device "
            f"({h['requests']} more requests), {h['rate_tokens_per_second']:.1f} tokens/s per user above the floor\n")
    if len(r.layouts) > 1:
        tail += "layouts tried (* the best; unservable: the engines cannot split the model over it):\n" + \
            format_table(tried)
    if r.infeasible:
        tail += f"infeasible: {r.infeasible}\n"
    out = r.to_json()
    if args.explain:  # where each price came from, at the best layout's batch
        out["explain"] = explain(cm, max(r.max_batch // cm.layout.replicas, 1))
        tail += format_explain(out["explain"])
    emit(args, out, head + table + tail)
    if r.infeasible:  # the figures are printed (and in --json); the exit status says the target is not met
        print(f"puzzlekit cost: infeasible: {r.infeasible}", file=sys.stderr)
        return 1
    return 0


def export_onnx(args) -> int:
    from .. import ir
    from ..backends.onnx import export_onnx
    from .default_model import model_path

    src = model_path(args.model).resolve()
    check_output(args.output, [src], args.overwrite)
    prog = ir.verify(load_model(args))
    rep = export_onnx(prog, args.output, target=args.target, opset=args.opset, overwrite=args.overwrite,
                      provenance={"input": str(src), "versions": versions()})
    lines = [f"wrote {rep.directory}: {', '.join(rep.files)}"]
    errors = [f for f in rep.findings if f.severity == "error"]
    lines.append(f"TensorRT lint for {args.target}: {len(errors)} error(s), {len(rep.findings) - len(errors)} note(s)")
    lines += [f"  {f}" for f in rep.findings if f.severity == "error" or args.verbose]
    emit(args, rep.to_json(), "\n".join(lines) + "\n")
    return 0


def build_engine(args) -> int:
    from .. import ir
    from ..backends.cost import get_scenario
    from ..backends.targets import get_target
    from ..backends.tensorrt import check_fp4, formats, write_bundle
    from ..ir.quant.recipe import get_recipe
    from ..passes import PassManager
    from .default_model import model_path

    src = model_path(args.model).resolve()
    compute_of(args)
    check_output(args.output, [src], args.overwrite)  # before the work, not after
    target, scenario = get_target(args.target), get_scenario(args.scenario)
    prog = ir.verify(load_model(args, text=True))
    if formats(prog) and args.recipe:
        raise UsageError(f"{src} is already quantized ({', '.join(sorted(formats(prog)))}); drop --recipe, or "
                         "start from the unquantized model")
    recipe = args.recipe or ("" if formats(prog) else target.trt.get("recipe", "bf16"))
    if recipe and recipe != "bf16":
        check_fp4({r.format for r in get_recipe(recipe).rules}, target, f"recipe {recipe!r} uses")
        PassManager(f"quantize{{recipe={recipe},samples={args.calib_samples},target={target.name}}}",
                    device=args.device, dtype=args.dtype, max_memory=args.max_memory, data=args.data).run(prog)
    check_fp4(formats(prog), target)
    calib = None
    if scenario.kv_dtype == "fp8":  # KV-cache scales from text windows, as the quantize pass calibrates
        from ..text.data import calibration_windows

        calib = calibration_windows(args.data or [], args.calib_samples, 128, prog)
    # serving commands for the checkpoint, unless it was quantized here: then the engines would serve other weights
    served = src if (src / "config.json").is_file() and recipe in ("", "bf16") else None
    rep = write_bundle(prog, args.output, target, scenario, build=args.build, overwrite=args.overwrite,
                       provenance={"input": str(src), "recipe": recipe or "as quantized", "versions": versions()},
                       calibration_ids=calib, checkpoint=served)
    plan = rep.build["memory_plan"]
    lines = [f"wrote {rep.directory}: {rep.precision} for {rep.target} ({rep.build['compute_capability']}), "
             f"scenario {scenario.name}",
             f"memory plan: decode batch 1..{plan['engine_max_batch']} (cost model: {plan['max_batch']}), "
             f"{plan['max_concurrency']} requests fit at context {rep.build['max_context']}"]
    lines += [f"  {name}.engine: {e['bytes'] / 1e6:.1f} MB, built in {e['build_seconds']:.1f} s"
              for name, e in rep.engines.items()]
    if not rep.engines:
        lines.append("engines not built here: run `python build_engines.py` in the bundle on the target GPU")
    if served:
        lines.append(f"serve {served}: bash {rep.directory}/serve.sh vllm|sglang|tensorrt-llm")
    elif recipe not in ("", "bf16"):
        lines.append(f"no serving commands: the model was quantized here ({recipe}), not as saved; build from a "
                     "saved quantized checkpoint to have them")
    emit(args, rep.to_json(), "\n".join(lines) + "\n")
    return 0


def check_serving(args) -> int:
    """Exit 0: every engine asked loads it; 1: one does not; 2 (raised): a usage error or no checkpoint at all."""
    from ..backends.layout import Layout
    from ..backends.serving_check import ENGINES, NAMES, check_serving as check

    engines = ENGINES if args.engine == "all" else (args.engine,)
    layout = Layout.parse(args.layout) if args.layout else None  # a bad layout is a usage error, before any reading
    context = getattr(args, "context", None)  # --context N: the context a serve command asks for
    verdicts = check(args.model, engines, layout, context)
    lines = []
    for v in verdicts:
        lines.append(f"{NAMES[v.engine]}: " + ("loads it" if v.loads else f"does NOT load it ({len(v.problems)} "
                                                                         "problem(s))")
                     + f" - {len(v.layers)} layers built" + (f", split over {args.layout}" if args.layout else ""))
        if args.verbose:
            lines += [f"    {x['layer']:<22} {x['kind']:<9} from {x['from']}: " +
                      ", ".join(f"{k} {val}" for k, val in x["fields"].items()) for x in v.layers]
        lines += [f"  - {p}" for p in v.problems] + [f"  note: {n}" for n in v.notes]
    emit(args, {"model": str(args.model), "layout": args.layout, "context": context,
                "loads": all(v.loads for v in verdicts), "engines": [v.to_json() for v in verdicts]},
         "\n".join(lines) + "\n")
    return 0 if all(v.loads for v in verdicts) else 1
