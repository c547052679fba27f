"""The `puzzlekit` command line. Exit codes: 0 success, 1 failure, 2 usage error; messages go to stderr."""
from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import json
import math
import os
import platform
import sys
from pathlib import Path

from ..errors import PuzzlekitError, UsageError
from ..memory import parse_size, return_freed_memory
from ..outputs import OutputError, check_output
from .puzzle import add_parser as add_library_parser
from .puzzle import EXTENDED_HELP, add_plan_parser
from .compress import add_parsers as add_compress_parsers


#: generation lengths (tokens per prompt, draft tokens) above this are refused: decoding a million tokens one
#: at a time takes hours, and a bigger number is a typo rather than a plan
MAX_TOKENS = 1_000_000
#: ONNX opsets export-onnx writes: torch's exporter emits opset 18 and converts upwards; TensorRT reads up to 24
OPSETS = (18, 24)


def _number(cast, lo, hi=None, above: bool = False):
    """An argparse type: a finite number >= lo (> lo with `above`) and <= hi. argparse reports a bad value
    with the option's name and exit code 2, rather than it being clamped or failing deep inside a command."""
    what = "an integer" if cast is int else "a finite number"

    def parse(s: str):
        try:
            v = cast(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not {what}") from None
        if (cast is float and not math.isfinite(v)) or v < lo or (above and v == lo) or (hi is not None and v > hi):
            bound = f"{'>' if above else '>='} {lo:g}" + (f" and <= {hi:,}" if hi is not None else "")
            raise argparse.ArgumentTypeError(f"must be {what} {bound}, got {s}")
        return v

    return parse


positive_int = _number(int, 1)
positive_float, nonneg_float = _number(float, 0, above=True), _number(float, 0)
token_count = _number(int, 1, MAX_TOKENS)


def add_compute_arguments(parser) -> None:
    """`--device` and `--dtype` for a command that computes (see backends.torch.device)."""
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (auto: CUDA when available; "
                                                         "under torchrun each rank takes cuda:LOCAL_RANK)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="the forward's precision (auto: bfloat16 on CUDA, float32 on CPU); weights, optimizer "
                             "state and losses stay float32")
    parser.add_argument("--threads", type=int, default=0, metavar="N",
                        help="CPU threads per process (default: one per 20M parameters, at most the CPUs this "
                             "process may use)")
    parser.add_argument("--max-memory", default="", metavar="SIZE",
                        help="host memory for weights and activations, e.g. 24GB (default: half of what is available); "
                             "a larger model is run layer by layer from its checkpoint")


DATA_HELP = ("text files, directories, .jsonl (text, chat messages, or prompt/completion per line), .parquet, a "
             "datasets directory (save_to_disk) or a hub dataset (owner/name[:split]); default: the Python stdlib")


def add_text_arguments(parser, data: bool = True) -> None:
    """`--tokenizer` (and `--data`) for a command that turns text into the model's token ids."""
    parser.add_argument("--tokenizer", metavar="PATH", help="the model's tokenizer: a directory of tokenizer files or a "
                                                            "hub id (default: the one beside the checkpoint; byte-level "
                                                            "models use their byte codec)")
    if data:
        parser.add_argument("--data", nargs="*", help=DATA_HELP)


def add_workload_arguments(parser, mtp: bool = True) -> None:
    """The workload a target is priced at, over the named --scenario (or a scenario .toml file): lengths, the
    per-user rate floor, GPUs, the parallel layout and (with `mtp`) speculative decoding with the MTP head."""
    g = parser.add_argument_group("workload (overrides the scenario's)")
    g.add_argument("--input-len", type=_number(int, 1), help="prompt tokens per request")
    g.add_argument("--output-len", type=_number(int, 1), help="generated tokens per request")
    g.add_argument("--rate-floor", type=nonneg_float, help="tokens/s each user must see (0: none)")
    g.add_argument("--gpus", type=positive_int, help="devices to use (default: all of the target's)")
    g.add_argument("--layout", help="pin a parallel layout, e.g. tp8, tp8.ep8, tp1.dp8.ep8, tp2.r4 (default: the "
                                    "best one is searched)")
    if not mtp:
        return
    g.add_argument("--mtp", action="store_true", help="serve with speculative decoding: the MTP head drafts "
                                                      "--mtp-draft tokens per step")
    g.add_argument("--mtp-draft", type=positive_int, default=3, help="tokens drafted per step with --mtp (default 3)")
    g.add_argument("--mtp-acceptance", type=_number(float, 1),
                   help="mean tokens per step with --mtp (default: what mtp-check measured, from the checkpoint)")


def measured_acceptance(prog) -> dict | None:
    """The MTP acceptance mtp-check measured in the run that wrote `prog` ({"length", "drafts"}), if any."""
    prov = prog.meta.get("provenance") or prog.meta.get("config", {}).get("provenance") or {}
    return prov.get("mtp_acceptance")


def scenario_of(args, prog=None, name: str | None = None, **more):
    """The scenario named by --scenario (or `name`) with the workload options (and `more` fields) applied."""
    from ..backends.cost import get_scenario

    over = {"input_len": args.input_len, "output_len": args.output_len, "rate_floor": args.rate_floor,
            "gpus": args.gpus, "layout": args.layout, **more}
    if getattr(args, "mtp", False):
        measured = measured_acceptance(prog) if prog is not None else None
        acceptance = args.mtp_acceptance or (measured or {}).get("length")
        if not acceptance:
            raise UsageError("--mtp needs the head's acceptance length: give --mtp-acceptance (mean tokens per step), "
                             "or price a checkpoint written by a pipeline that ran mtp-check")
        drafts = args.mtp_draft if args.mtp_acceptance or not measured else measured.get("drafts", args.mtp_draft)
        over |= {"mtp_draft": drafts, "mtp_acceptance": acceptance}
    return get_scenario(name or args.scenario, **over)


def compute_of(args):
    """The command's device and precision, refused here (exit 2) when this machine has no such device."""
    from ..backends.torch.device import resolve

    return resolve(args.device, args.dtype, args.max_memory)


def _emit(args, data: dict, text: str) -> None:
    print(json.dumps(data, indent=2) if args.json else text, end="" if not args.json and text.endswith("\n") else "\n")


def _import_plugin(m: str) -> None:
    """A module name, or the path of a `.py` file (imported under its file name)."""
    if not m.endswith(".py"):
        importlib.import_module(m)
        return
    f = Path(m)
    if not f.is_file():
        raise UsageError(f"cannot import plugin {m!r}: no such file")
    spec = importlib.util.spec_from_file_location(f"puzzlekit_plugin_{f.stem}", f)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)


def _load_plugins(modules: list[str]) -> None:
    """Imports each --plugin (a module, or a path to a .py file); whatever goes wrong in one is reported as
    that plugin's fault (exit 2)."""
    if modules and "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")  # like `python -m`: a plugin module in the current directory is found
    for m in modules or []:
        try:
            _import_plugin(m)
        except ModuleNotFoundError as e:
            if e.name and (m == e.name or m.startswith(e.name + ".")):
                raise UsageError(f"cannot import plugin {m!r}: {e}; is it on PYTHONPATH?") from None
            raise UsageError(f"cannot import plugin {m!r}: it imports a missing module: {e}") from e
        except SyntaxError as e:
            raise UsageError(f"cannot import plugin {m!r}: syntax error in {e.filename}, line {e.lineno}: "
                             f"{e.msg}") from e
        except UsageError:
            raise
        except SystemExit as e:
            raise UsageError(f"cannot import plugin {m!r}: it called sys.exit({e.code!r}) while being imported") from e
        except Exception as e:
            raise UsageError(f"cannot import plugin {m!r}: importing it raised {type(e).__name__}: {e}") from e


def _model(args, text: bool = False):
    """The command's model, with the CPU threads chosen for its size (--threads overrides) and the tokenizer
    --tokenizer names; with `text` (the command reads or writes text) its tokenizer is checked now, before any
    work: a subword model without one is refused."""
    from .. import ir
    from ..backends.torch.device import use_threads
    from ..tokenizer import set_tokenizer, tokenizer_of
    from .default_model import model_path

    prog = ir.load(model_path(args.model))
    set_tokenizer(prog, getattr(args, "tokenizer", None))
    if text:
        tokenizer_of(prog)
    use_threads(prog.param_counts()["total"], getattr(args, "threads", 0))
    return prog


def reads_text(passes) -> bool:
    """Whether a pipeline has a pass that runs the model on text (one with a `data` option), nested ones too."""
    return any(hasattr(p, "data") or reads_text(getattr(p, "body", None) or []) for p in passes)


# -- commands ----------------------------------------------------------------------------------------------
def _inspect(args) -> int:
    from .. import ir

    prog = ir.verify(_model(args), check_finite=args.check_finite)
    c = prog.param_counts()
    _emit(args, {"model": prog.meta["source"], "ir": ir.print_program(prog), "params_total": c["total"],
                 "params_active": c["active"], "mtp_params_total": c["mtp_total"],
                 "mtp_params_active": c["mtp_active"], "by_kind": c["by_kind"]},
          ir.print_program(prog) + "\n" + ir.format_params(prog))
    return 0


def _passes(args) -> int:
    from ..passes import PASSES
    from ..passes.pipeline import describe_options

    _load_plugins(args.plugin)
    rows = [{"name": n, "doc": c.doc(), "nested": c.nested, "options": describe_options(c), "module": c.__module__}
            for n, c in sorted(PASSES.items())]
    lines = []
    for r in rows:
        opts = ", ".join(f"{o['name']}: {o['type']}" + ("" if o["required"] else f" = {o['default']}")
                         for o in r["options"])
        lines.append(f"{r['name']}{{{opts}}}{'(...)' if r['nested'] else ''}\n    {r['doc']}")
    _emit(args, {"passes": rows}, "\n".join(lines) + "\n")
    return 0


def _file_hashes(src: Path) -> dict[str, str]:
    files = sorted(p for p in (src.iterdir() if src.is_dir() else [src]) if p.is_file())
    out = {}
    for f in files:
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        out[f.name] = h.hexdigest()
    return out


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("puzzlekit", "torch", "safetensors", "onnx", "onnxruntime"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def _run(args) -> int:
    from .. import ir
    from ..passes import Instrumentation, PassManager, parse_pipeline, print_pipeline, resolve_pipeline
    from ..passes.pipeline import PipelineSyntaxError
    from .default_model import model_path

    _load_plugins(args.plugin)
    compute_of(args)
    try:
        passes = parse_pipeline(resolve_pipeline(args.pipeline))
    except PipelineSyntaxError as e:
        raise UsageError(str(e)) from None
    src = model_path(args.model).resolve()
    need = sum(f.stat().st_size for f in src.glob("*.safetensors")) if src.is_dir() else 0  # about the output's
    out = check_output(args.output, [src, *(args.data or [])], args.overwrite, need)  # before the work, not after
    prog = _model(args, text=reads_text(passes))
    ins = Instrumentation(verify_each=args.verify_each, print_ir_after=args.print_ir_after,
                          progress=not args.json and sys.stderr.isatty())
    before = prog.param_counts()
    pm = PassManager(passes, ins, args.device, args.dtype, args.max_memory, data=args.data)
    am = pm.run(prog)
    if int(os.environ.get("RANK", "0")):  # a data-parallel process under torchrun: rank 0 writes the result
        return 0
    prog.meta["provenance"] = {
        "pipeline": print_pipeline(passes), "versions": _versions(),
        "input": {"path": str(src), "sha256": _file_hashes(src)},
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
    _emit(args, {"output": str(out), "pipeline": print_pipeline(passes),
                 "timings": [{"pass": n, "seconds": t} for n, t in ins.timings],
                 "params_before": before["total"], "params_after": after["total"],
                 "params_active_before": before["active"], "params_active_after": after["active"]}, text)
    return 0


def _train(args) -> int:
    from .train import TrainConfig, train

    compute = compute_of(args)
    out = check_output(args.output, args.data or [], overwrite=True)
    if out.is_dir() and any(out.iterdir()) and not (out / "train_state.pt").exists():
        raise UsageError(f"{out} is not empty and holds no training run; choose a new -o "
                         "(the same -o again resumes a run)")
    cfg = TrainConfig(steps=args.steps, batch=args.batch, seq=args.seq, lr=args.lr, seed=args.seed,
                      checkpoint_every=args.checkpoint_every, max_minutes=args.max_minutes)
    tokenizer = None
    if args.tokenizer:
        from ..tokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    m = train(Path(args.output), cfg, args.data, progress=not args.json, compute=compute, tokenizer=tokenizer)
    text = (f"step {m['step']}/{cfg.steps} in {m['train_seconds']:.0f} s\n"
            f"validation bits per byte {m['valid_bits_per_byte']:.3f} (unigram baseline "
            f"{m['unigram_bits_per_byte']:.3f}) on {m['valid_bytes']:,} bytes ({m['valid_tokens']:,} tokens)\n"
            f"MTP top-1 accuracy {m['mtp_top1_accuracy']:.3f}\nwrote {Path(args.output) / 'model'}\n")
    _emit(args, m, text)
    return 0


def _eval(args) -> int:
    from .. import evaluate, ir
    from ..backends.torch.stream import StreamedProgram
    from ..data import corpus_for, held_out_windows
    from ..tokenizer import check_shared, set_tokenizer, vocab_of
    from .default_model import model_path

    compute = compute_of(args)
    if args.k > args.new_tokens:
        raise UsageError(f"--k {args.k} drafts more tokens per step than --new-tokens {args.new_tokens} generates")
    prog = ir.verify(_model(args, text=True))
    teacher = None
    if args.teacher:  # before any work: the two must share a tokenizer
        teacher = ir.verify(ir.load(model_path(args.teacher)))
        set_tokenizer(teacher, args.tokenizer)
        check_shared(prog, teacher)
    corpus = corpus_for(prog, args.data, progress=not args.json and sys.stderr.isatty())
    windows = held_out_windows(corpus, "report", args.seq + 1, limit=args.windows)
    if len(windows) < args.prompts:
        raise UsageError(f"--prompts {args.prompts} needs as many held-out windows; there are {len(windows)} "
                         f"(--windows {args.windows}, {len(corpus.held_out('report')):,} tokens in the report set)")
    model = StreamedProgram(prog, compute)
    text = evaluate.text_metrics(model, windows, corpus.token_bytes)
    res = {"model": str(model_path(args.model)), "compute": str(compute), "tokenizer": corpus.tokenizer.name,
           "valid_bytes": text["bytes"], "valid_tokens": text["tokens"], "bits_per_byte": text["bits_per_byte"],
           "nll_per_token": text["nll_per_token"], "perplexity": text["perplexity"],
           "unigram_bits_per_byte": evaluate.unigram_bits_per_byte(corpus.train, windows, vocab_of(prog),
                                                                   corpus.token_bytes)}
    if model.program.find("mtp"):
        res["mtp_top1_accuracy"] = evaluate.mtp_accuracy(model, windows)
        prompts = windows[: args.prompts, : args.seq // 2]
        res["acceptance_length"] = evaluate.acceptance_length(model, prompts, args.k, args.new_tokens)
        res["draft_tokens"] = args.k
    if teacher is not None:
        res.update(evaluate.teacher_agreement(StreamedProgram(teacher, compute), model, windows))
    lines = [f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}" for k, v in res.items()]
    _emit(args, res, "\n".join(lines) + "\n")
    return 0


def warn_unrunnable_recipe(recipe: str | None, targets) -> None:
    """Prices a recipe the GPU cannot run (W4A4 NVFP4 on Hopper) with a warning on stderr saying what it does
    there, rather than without a word (build-engine and quantize refuse it)."""
    from ..backends.targets import get_target
    from ..ir.quant.recipe import get_recipe

    if not recipe:
        return
    for name in targets:
        t = get_target(name)
        if t.kind == "gpu" and any(r.format == "nvfp4" for r in get_recipe(recipe).rules) and not t.supports("nvfp4"):
            print(f"warning: recipe {recipe!r} computes in NVFP4 (W4A4), which {t.name} cannot: it has no FP4 tensor "
                  "cores, and build-engine and quantize refuse it there. On Hopper NVFP4 weights are only storage "
                  "(recipe nvfp4-weight: dequantised to FP8/BF16 for every matmul); these figures assume FP4 "
                  f"kernels. Price `--recipe fp8` or `--recipe nvfp4-weight` for {t.name}", file=sys.stderr)


def _cost(args) -> int:
    from ..backends.cost import best_layout
    from ..backends.measured import MeasuredProvider
    from ..backends.targets import get_target
    from ..ir.printer import format_table

    compute = compute_of(args)
    prog = _model(args)
    warn_unrunnable_recipe(args.recipe, [args.target])
    target = get_target(args.target)
    measured = MeasuredProvider(compute=compute) if target.kind == "cpu" else None
    sc = scenario_of(args, prog, recipe=args.recipe, concurrency=args.concurrency)
    _, r = best_layout(prog, target, sc, measured)
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
        (x["layout"] + (" *" if x["layout"] == r.layout else ""), str(x["max_batch"]), f"{x['throughput']:,.0f}",
         f"{x['user_rate']:.1f}", f"{x['serve_step_ms']:.3f}", x["binding"] or "-") for x in r.layouts]
    mtp = (f", MTP drafting {s.mtp_draft} at {s.mtp_acceptance:g} tokens/step" if s.mtp_draft else "")
    head = (f"{r.target}, scenario {s.name}: {s.input_len} in / {s.output_len} out, context {s.context_len}, "
            f"rate floor {s.rate_floor:g} tok/s, KV {s.kv_dtype}, weights {s.recipe or 'bf16'}{mtp}\n"
            f"layout {r.layout}" + (" (pinned)" if s.layout else f" (best of {len(r.layouts)})") + "\n")
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
        tail += "layouts tried (* the best):\n" + format_table(tried)
    if r.infeasible:
        tail += f"infeasible: {r.infeasible}\n"
    _emit(args, r.to_json(), head + table + tail)
    if r.infeasible:  # the figures are printed (and in --json); the exit status says the target is not met
        print(f"puzzlekit cost: infeasible: {r.infeasible}", file=sys.stderr)
        return 1
    return 0


def _export_onnx(args) -> int:
    from .. import ir
    from ..backends.onnx import export_onnx
    from .default_model import model_path

    src = model_path(args.model).resolve()
    check_output(args.output, [src], args.overwrite)
    prog = ir.verify(_model(args))
    rep = export_onnx(prog, args.output, target=args.target, opset=args.opset, overwrite=args.overwrite,
                      provenance={"input": str(src), "versions": _versions()})
    lines = [f"wrote {rep.directory}: {', '.join(rep.files)}"]
    errors = [f for f in rep.findings if f.severity == "error"]
    lines.append(f"TensorRT lint for {args.target}: {len(errors)} error(s), {len(rep.findings) - len(errors)} note(s)")
    lines += [f"  {f}" for f in rep.findings if f.severity == "error" or args.verbose]
    _emit(args, rep.to_json(), "\n".join(lines) + "\n")
    return 0


def _build_engine(args) -> int:
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
    prog = ir.verify(_model(args, text=True))
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
        from ..passes.quant import calibration_windows

        calib = calibration_windows(args.data or [], args.calib_samples, 128, prog)
    rep = write_bundle(prog, args.output, target, scenario, build=args.build, overwrite=args.overwrite,
                       provenance={"input": str(src), "recipe": recipe or "as quantized", "versions": _versions()},
                       calibration_ids=calib)
    plan = rep.build["memory_plan"]
    lines = [f"wrote {rep.directory}: {rep.precision} for {rep.target} ({rep.build['compute_capability']}), "
             f"scenario {scenario.name}",
             f"memory plan: decode batch 1..{plan['engine_max_batch']} (cost model: {plan['max_batch']}), "
             f"{plan['max_concurrency']} requests fit at context {rep.build['max_context']}"]
    lines += [f"  {name}.engine: {e['bytes'] / 1e6:.1f} MB, built in {e['build_seconds']:.1f} s"
              for name, e in rep.engines.items()]
    if not rep.engines:
        lines.append("engines not built here: run `python build_engines.py` in the bundle on the target GPU")
    _emit(args, rep.to_json(), "\n".join(lines) + "\n")
    return 0


def _greedy(prefill, decode, n: int, logits_of, model=None, stop: int | None = None):
    """Up to `n` greedy tokens [batch, <= n] from `prefill()` and `decode(tokens, state)`, which return (outputs,
    state); it ends early once every row has produced `stop` (EOS), as transformers' generate does. Non-finite
    logits stop it naming the likely cause, rather than decoding NaN as token 0."""
    import numpy as np

    from ..evaluate import check_finite

    outs, state = prefill()
    new = []
    for i in range(n):
        where = "prefill" if i == 0 else f"decode step {i}"
        logits = check_finite(np.asarray(logits_of(outs))[:, -1], f"logits at {where}", model)
        new.append(logits.argmax(-1))
        if stop is not None:
            done = np.any(np.stack(new, axis=1) == stop, axis=1)
            if done.all():
                break
        if i + 1 < n:
            outs, state = decode(new[-1], state)
    return np.stack(new, axis=1)


def _cached_onnx(prog) -> Path:
    """The program's ONNX export, made once per program (keyed by its hash: text and weights) under
    $PUZZLEKIT_CACHE/onnx (default ~/.cache/puzzlekit/onnx), so that generate does not export on every call."""
    from ..backends.onnx import export_onnx
    from ..passes.puzzle.library import parent_hash

    root = Path(os.environ.get("PUZZLEKIT_CACHE", Path.home() / ".cache" / "puzzlekit")) / "onnx"
    d = root / parent_hash(prog)[:32]
    if not (d / "prefill.onnx").exists():  # the export is staged and renamed into place: complete or absent
        export_onnx(prog, d)
    return d


def _generate(args) -> int:
    import numpy as np
    import torch

    from .. import ir
    from ..backends.torch import materialize
    from ..tokenizer import tokenizer_of

    compute = compute_of(args)
    prog = ir.verify(_model(args, text=True))
    tok = tokenizer_of(prog)
    text = tok.render_chat([{"role": "user", "content": args.prompt}], generation_prompt=True) if args.chat \
        else args.prompt
    prompt = tok.prompt(text)[None]
    if not args.prompt or prompt.size == 0:
        raise UsageError("the prompt is empty")
    if args.backend == "onnx":
        from ..backends.onnx import OnnxModel

        fp4 = sorted({f for n in prog.nodes for _, f in n.op.quant if f.startswith("nvfp4")})
        if fp4:
            raise UsageError(f"--backend onnx: the model is quantized with {', '.join(fp4)}, and onnxruntime has no FP4 "
                             "kernels (its FP4 ops are TensorRT's); use --backend torch, or build engines for an FP4 "
                             "GPU with build-engine")
        om = OnnxModel(_cached_onnx(prog))
        new = _greedy(lambda: om.prefill(prompt), om.decode, args.max_new_tokens, lambda outs: outs["logits"],
                      stop=tok.eos_id)
    else:
        m = materialize(prog, compute=compute)
        with torch.no_grad():
            new = _greedy(lambda: m.prefill(torch.from_numpy(prompt)),
                          lambda t, state: m.decode(torch.from_numpy(t), state), args.max_new_tokens,
                          lambda outs: outs[0].float().cpu().numpy(), m, stop=tok.eos_id)
    completion = tok.decode(new[0])
    _emit(args, {"prompt": args.prompt, "completion": completion, "tokens": np.concatenate([prompt, new], 1)[0].tolist(),
                 "new_tokens": new[0].tolist(), "backend": args.backend, "tokenizer": tok.name},
          text + completion + "\n")
    return 0


# -- wiring --------------------------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="puzzlekit", description="A compiler for hybrid Mamba/MoE/attention LMs.")
    sub = p.add_subparsers(dest="command", required=True)
    model_help = "checkpoint directory or config.json (default: the built-in model)"

    i = sub.add_parser("inspect", help="verify a model and print its IR and parameter table")
    i.add_argument("model", nargs="?", help=model_help)
    i.add_argument("--check-finite", action="store_true", help="also reject NaN/inf weights (reads every tensor)")
    i.set_defaults(run=_inspect)

    s = sub.add_parser("passes", help="list every registered pass with its options")
    s.set_defaults(run=_passes)

    r = sub.add_parser("run", help="run a pass pipeline and write the resulting checkpoint")
    r.add_argument("model", nargs="?", help=model_help)
    r.add_argument("--pipeline", "-p", required=True, help="pipeline text, a .pipeline file, or a named pipeline")
    r.add_argument("--output", "-o", required=True, help="output checkpoint directory")
    r.add_argument("--verify-each", action="store_true", help="run the verifier after every pass")
    r.add_argument("--print-ir-after", action="store_true", help="print the IR after every pass (stderr)")
    r.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    r.add_argument("--extended", action="store_true", help=EXTENDED_HELP)
    r.set_defaults(run=_run)

    t = sub.add_parser("train", help="train the default hybrid architecture on text (resumable): byte-level, or in "
                                     "the vocabulary of --tokenizer")
    t.add_argument("--output", "-o", required=True, help="run directory (re-run the same command to resume)")
    t.add_argument("--steps", type=positive_int, default=1200)
    t.add_argument("--batch", type=positive_int, default=16)
    t.add_argument("--seq", type=_number(int, 2), default=256, help="window length (>= 2: the MTP head needs two)")
    t.add_argument("--lr", type=positive_float, default=3e-3)
    t.add_argument("--seed", type=_number(int, 0, 2**63 - 1), default=0)
    t.add_argument("--checkpoint-every", type=positive_int, default=50)
    t.add_argument("--max-minutes", type=nonneg_float, default=0.0, help="stop and save after this long (0: no limit)")
    t.set_defaults(run=_train)

    e = sub.add_parser("eval", help="bits per byte, NLL per token, MTP accuracy, speculative acceptance, teacher "
                                    "agreement")
    e.add_argument("model", nargs="?", help=model_help)
    e.add_argument("--teacher", help="a second model: report KL(teacher || model) and top-1 agreement")
    e.add_argument("--windows", type=positive_int, default=64, help="held-out windows to score (at most)")
    e.add_argument("--seq", type=_number(int, 2), default=256, help="window length (>= 2)")
    e.add_argument("--k", type=token_count, default=3, help="tokens drafted per step by the MTP head")
    e.add_argument("--prompts", type=positive_int, default=4, help="prompts for the speculative-decoding measurement")
    e.add_argument("--new-tokens", type=token_count, default=32,
                   help=f"tokens generated per prompt (at most {MAX_TOKENS:,})")
    e.set_defaults(run=_eval)

    c = sub.add_parser("cost", help="price a model on a GPU target and deployment scenario")
    c.add_argument("model", nargs="?", help=model_help)
    c.add_argument("--target", default="h100", help="h100, h200, b200, 8xh100, ..., cpu, or a .toml/.json file")
    c.add_argument("--scenario", default="decode-heavy", help="long-1m, decode-heavy, prefill-heavy, chat, or a "
                                                               ".toml file of one (FILE.toml:NAME for one of several)")
    c.add_argument("--recipe", help="weight precisions: bf16, fp8, nvfp4, nvfp4-hybrid")
    c.add_argument("--concurrency", type=positive_int, help="requests served at once (default: as many as fit)")
    add_workload_arguments(c)
    c.set_defaults(run=_cost)

    x = sub.add_parser("export-onnx", help="lower a model to prefill/decode ONNX graphs, linted for TensorRT")
    x.add_argument("model", nargs="?", help=model_help)
    x.add_argument("--output", "-o", required=True, help="output directory")
    x.add_argument("--target", default="cpu", help="b200, h100, ... (TensorRT lint; errors fail) or cpu")
    x.add_argument("--opset", type=_number(int, *OPSETS), default=23, help=f"ONNX opset ({OPSETS[0]}-{OPSETS[1]})")
    x.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    x.add_argument("--verbose", action="store_true", help="list every lint note, not just errors")
    x.set_defaults(run=_export_onnx)

    be = sub.add_parser("build-engine", help="a TensorRT engine bundle for a GPU target and scenario (engines "
                                             "built here for RTX targets with TensorRT-RTX)")
    be.add_argument("model", nargs="?", help=model_help)
    be.add_argument("--target", required=True, help="b200, h100, h200, rtx-sm120, rtx-sm89, or a .toml/.json file")
    be.add_argument("--scenario", default="chat", help="long-1m, decode-heavy, prefill-heavy, chat")
    be.add_argument("--output", "-o", required=True, help="bundle directory")
    be.add_argument("--recipe", help="quantize the model first with this recipe (default: the target's: nvfp4 "
                                     "on FP4 GPUs, fp8 otherwise; bf16 keeps it as is)")
    be.add_argument("--calib-samples", type=positive_int, default=16, help="calibration windows of 128 tokens for "
                                                                               "--recipe and an FP8 KV cache")
    be.add_argument("--build", choices=["auto", "yes", "no"], default="auto",
                    help="build the engines here (auto: where TensorRT-RTX, or TensorRT and the GPU, are present)")
    be.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    be.set_defaults(run=_build_engine)

    g = sub.add_parser("generate", help="greedy generation from a text prompt, in the model's own tokenization")
    g.add_argument("model", nargs="?", help=model_help)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="send the prompt as a user message through the tokenizer's chat "
                                                       "template (with the assistant's turn opened)")
    g.add_argument("--max-new-tokens", type=token_count, default=64, help=f"at most {MAX_TOKENS:,}")
    g.add_argument("--backend", choices=["torch", "onnx"], default="torch")
    g.set_defaults(run=_generate)

    lb = add_library_parser(sub, model_help, positive_int, positive_float)
    pl = add_plan_parser(sub, positive_int, positive_float)
    cp, rp = add_compress_parsers(sub, model_help, positive_int, positive_float)

    for cmd in (r, t, e, c, be, g, lb, cp):
        add_compute_arguments(cmd)
    for cmd in (r, t, e, be, g, cp):
        add_text_arguments(cmd, data=cmd is not g)
    add_text_arguments(lb, data=False)  # library has its own --data
    for cmd in (s, r):
        cmd.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                         help="import MODULE (a module name or a path to a .py file) first; it may register "
                              "passes; repeatable")
    for cmd in (i, s, r, t, e, c, x, be, g, lb, pl, cp, rp):
        cmd.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    return p


def main(argv: list[str] | None = None) -> int:
    """Runs one command: errors are one message on stderr, never a traceback (PUZZLEKIT_DEBUG=1 re-raises)."""
    args = parser().parse_args(argv)  # argparse exits with 2 on usage errors
    return_freed_memory()
    import torch

    threads = torch.get_num_threads()  # a command sets its own (device.use_threads); a caller's is restored
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print(f"puzzlekit {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug in a pass or plugin still gets one clear line
        if os.environ.get("PUZZLEKIT_DEBUG", "") not in ("", "0"):
            raise
        ours = isinstance(e, PuzzlekitError)
        msg = str(e) if ours else f"unexpected {type(e).__name__}: {e}"
        if not ours or (e.__cause__ is not None and not isinstance(e.__cause__, PuzzlekitError)):
            msg += " (PUZZLEKIT_DEBUG=1 shows the traceback)"
        print(f"puzzlekit {args.command}: error: {msg}", file=sys.stderr)
        return 2 if any(isinstance(x, (UsageError, OutputError)) for x in _causes(e)) else 1
    finally:
        torch.set_num_threads(threads)


def _causes(e: BaseException):
    """The exception and what it was raised from (a pass's usage error is still one)."""
    while e is not None:
        yield e
        e = e.__cause__


if __name__ == "__main__":
    sys.exit(main())
