"""The `puzzlekit` command line. Exit codes: 0 success, 1 failure, 2 usage error; messages go to stderr."""
from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import platform
import sys
from pathlib import Path

from ..errors import PuzzlekitError


class UsageError(PuzzlekitError):
    """The command line itself is wrong (exit code 2)."""


def _emit(args, data: dict, text: str) -> None:
    print(json.dumps(data, indent=2) if args.json else text, end="" if not args.json and text.endswith("\n") else "\n")


def _load_plugins(modules: list[str]) -> None:
    if modules and "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")  # like `python -m`: a plugin module in the current directory is found
    for m in modules or []:
        try:
            importlib.import_module(m)
        except ImportError as e:
            raise UsageError(f"cannot import plugin {m!r}: {e}; is it on PYTHONPATH?") from None


def _model(args):
    from .. import ir
    from .default_model import model_path

    return ir.load(model_path(args.model))


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
    try:
        passes = parse_pipeline(resolve_pipeline(args.pipeline))
    except PipelineSyntaxError as e:
        raise UsageError(str(e)) from None
    src, out = model_path(args.model).resolve(), Path(args.output).resolve()
    if out == src or src.is_relative_to(out) or (src.is_dir() and out.is_relative_to(src)):
        raise UsageError(f"output {out} would overwrite or sit inside the input {src}; choose another -o")
    if out.exists() and not out.is_dir():
        raise UsageError(f"output {out} is a file; -o needs a directory")
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise UsageError(f"output {out} exists; pass --overwrite to replace it")
    prog = _model(args)
    ins = Instrumentation(verify_each=args.verify_each, print_ir_after=args.print_ir_after,
                          progress=not args.json and sys.stderr.isatty())
    before = prog.param_counts()
    pm = PassManager(passes, ins)
    pm.run(prog)
    prog.meta["provenance"] = {
        "pipeline": print_pipeline(passes), "versions": _versions(),
        "input": {"path": str(src), "sha256": _file_hashes(src)},
        "input_provenance": prog.meta.get("config", {}).get("provenance"),
    }
    ir.save(prog, out, overwrite=args.overwrite)
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

    cfg = TrainConfig(steps=args.steps, batch=args.batch, seq=args.seq, lr=args.lr, seed=args.seed,
                      checkpoint_every=args.checkpoint_every, max_minutes=args.max_minutes)
    m = train(Path(args.output), cfg, args.data, progress=not args.json)
    text = (f"step {m['step']}/{cfg.steps} in {m['train_seconds']:.0f} s\n"
            f"validation bits per byte {m['valid_bits_per_byte']:.3f} (unigram baseline "
            f"{m['unigram_bits_per_byte']:.3f}) on {m['valid_bytes']:,} bytes\n"
            f"MTP top-1 accuracy {m['mtp_top1_accuracy']:.3f}\nwrote {Path(args.output) / 'model'}\n")
    _emit(args, m, text)
    return 0


def _eval(args) -> int:
    from .. import evaluate, ir
    from ..backends.torch import materialize
    from ..data import load_corpus, sequential_windows
    from .default_model import model_path

    corpus = load_corpus(args.data)
    windows = sequential_windows(corpus.valid, args.seq + 1, limit=args.windows)
    model = materialize(ir.verify(_model(args)))
    res = {"model": str(model_path(args.model)), "valid_bytes": int(windows[:, 1:].numel()),
           "bits_per_byte": evaluate.bits_per_byte(model, windows),
           "unigram_bits_per_byte": evaluate.unigram_bits_per_byte(corpus.train, windows)}
    if model.program.find("mtp"):
        res["mtp_top1_accuracy"] = evaluate.mtp_accuracy(model, windows)
        prompts = windows[: args.prompts, : args.seq // 2]
        res["acceptance_length"] = evaluate.acceptance_length(model, prompts, args.k, args.new_tokens)
        res["draft_tokens"] = args.k
    if args.teacher:
        teacher = materialize(ir.verify(ir.load(model_path(args.teacher))))
        res.update(evaluate.teacher_agreement(teacher, model, windows))
    lines = [f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}" for k, v in res.items()]
    _emit(args, res, "\n".join(lines) + "\n")
    return 0


def _cost(args) -> int:
    from ..backends.cost import cost
    from ..ir.printer import format_table

    prog = _model(args)
    r = cost(prog, args.target, args.scenario, recipe=args.recipe, gpus=args.gpus, concurrency=args.concurrency)
    s = r.scenario
    gb = 1e9
    rows = [("kind", "count", "weights GB", "state MB/req", "decode ms", "prefill ms")]
    for k, v in r.by_kind.items():
        rows.append((k, str(v["count"]), f"{v['weight_bytes'] / gb:.3f}", f"{v['state_bytes_per_request'] / 1e6:.2f}",
                     f"{v['decode_seconds'] * 1e3:.3f}", f"{v['prefill_seconds'] * 1e3:.2f}"))
    rows.append(("total", "", f"{r.weight_bytes / gb:.3f}", f"{r.state_bytes_per_request / 1e6:.2f}",
                 f"{r.decode_step_seconds * 1e3:.3f}", f"{r.prefill_seconds * 1e3:.2f}"))
    table = format_table(rows).rstrip("\n")
    head = (f"{r.target}, scenario {s.name}: {s.input_len} in / {s.output_len} out, context {s.context_len}, "
            f"rate floor {s.rate_floor:g} tok/s, KV {s.kv_dtype}, weights {s.recipe or 'bf16'}\n")
    tail = (f"\nparams {r.params_total / 1e9:.2f}B total, {r.params_active / 1e9:.2f}B active\n"
            f"max concurrency at context {s.context_len}: {r.max_concurrency}\n"
            f"max batch meeting the rate floor: {r.max_batch} (decode step {r.decode_step_seconds * 1e3:.3f} ms)\n"
            f"throughput: {r.throughput_tokens_per_second:,.0f} tokens/s; prefill {r.prefill_seconds:.3f} s\n")
    if r.infeasible:
        tail += f"infeasible: {r.infeasible}\n"
    _emit(args, r.to_json(), head + table + tail)
    return 0


def _export_onnx(args) -> int:
    from .. import ir
    from ..backends.onnx import export_onnx
    from .default_model import model_path

    src = model_path(args.model).resolve()
    if Path(args.output).resolve() == src:
        raise UsageError("the output directory is the input checkpoint; choose another -o")
    prog = ir.verify(_model(args))
    rep = export_onnx(prog, args.output, target=args.target, opset=args.opset, overwrite=args.overwrite,
                      provenance={"input": str(src), "versions": _versions()})
    lines = [f"wrote {rep.directory}: {', '.join(rep.files)}"]
    errors = [f for f in rep.findings if f.severity == "error"]
    lines.append(f"TensorRT lint for {args.target}: {len(errors)} error(s), {len(rep.findings) - len(errors)} note(s)")
    lines += [f"  {f}" for f in rep.findings if f.severity == "error" or args.verbose]
    _emit(args, rep.to_json(), "\n".join(lines) + "\n")
    return 0


def _generate(args) -> int:
    import numpy as np
    import torch

    from .. import ir
    from ..backends.torch import materialize

    prog = ir.verify(_model(args))
    vocab = prog.find("embed")[0].op.vocab
    if vocab != 256:
        raise UsageError(f"generate encodes the prompt as bytes: it needs a byte-level model (vocab 256, not {vocab})")
    prompt = np.frombuffer(args.prompt.encode(), dtype=np.uint8).astype(np.int64)[None]
    if prompt.size == 0:
        raise UsageError("the prompt is empty")
    if args.backend == "onnx":
        import tempfile

        from ..backends.onnx import OnnxModel, export_onnx

        with tempfile.TemporaryDirectory() as d:
            export_onnx(prog, Path(d) / "onnx")
            tokens = OnnxModel(Path(d) / "onnx").generate(prompt, args.max_new_tokens)
    else:
        m = materialize(prog)
        seq = torch.from_numpy(prompt)
        with torch.no_grad():
            (logits, *_), state = m.prefill(seq)
            for _ in range(args.max_new_tokens):
                nxt = logits[:, -1].argmax(-1)
                seq = torch.cat([seq, nxt[:, None]], dim=1)
                (logits, *_), state = m.decode(nxt, state)
        tokens = seq.numpy()
    text = bytes(tokens[0, prompt.shape[1]:].astype(np.uint8).tolist()).decode("utf-8", errors="replace")
    _emit(args, {"prompt": args.prompt, "completion": text, "tokens": tokens[0].tolist(), "backend": args.backend},
          args.prompt + text + "\n")
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
    r.set_defaults(run=_run)

    t = sub.add_parser("train", help="train the default hybrid architecture on byte-level text (resumable)")
    t.add_argument("--output", "-o", required=True, help="run directory (re-run the same command to resume)")
    t.add_argument("--data", nargs="*", help="text files, directories or .jsonl (default: the Python stdlib)")
    t.add_argument("--steps", type=int, default=1200)
    t.add_argument("--batch", type=int, default=16)
    t.add_argument("--seq", type=int, default=256)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--checkpoint-every", type=int, default=50)
    t.add_argument("--max-minutes", type=float, default=0.0, help="stop and save after this long (0: no limit)")
    t.set_defaults(run=_train)

    e = sub.add_parser("eval", help="bits per byte, MTP accuracy, speculative acceptance, teacher agreement")
    e.add_argument("model", nargs="?", help=model_help)
    e.add_argument("--teacher", help="a second model: report KL(teacher || model) and top-1 agreement")
    e.add_argument("--data", nargs="*", help="text files, directories or .jsonl (default: the Python stdlib)")
    e.add_argument("--windows", type=int, default=64, help="held-out windows to score")
    e.add_argument("--seq", type=int, default=256, help="window length")
    e.add_argument("--k", type=int, default=3, help="tokens drafted per step by the MTP head")
    e.add_argument("--prompts", type=int, default=4, help="prompts for the speculative-decoding measurement")
    e.add_argument("--new-tokens", type=int, default=32, help="tokens generated per prompt")
    e.set_defaults(run=_eval)

    c = sub.add_parser("cost", help="price a model on a GPU target and deployment scenario")
    c.add_argument("model", nargs="?", help=model_help)
    c.add_argument("--target", default="h100", help="h100, h200, b200, 8xh100, ..., cpu, or a .toml/.json file")
    c.add_argument("--scenario", default="decode-heavy", help="long-1m, decode-heavy, prefill-heavy, chat")
    c.add_argument("--recipe", help="weight precisions: bf16, fp8, nvfp4, nvfp4-hybrid")
    c.add_argument("--gpus", type=int, help="devices to use (tensor parallel; default: all of the target)")
    c.add_argument("--concurrency", type=int, help="requests served at once (default: as many as fit)")
    c.set_defaults(run=_cost)

    x = sub.add_parser("export-onnx", help="lower a model to prefill/decode ONNX graphs, linted for TensorRT")
    x.add_argument("model", nargs="?", help=model_help)
    x.add_argument("--output", "-o", required=True, help="output directory")
    x.add_argument("--target", default="cpu", help="b200, h100, ... (TensorRT lint; errors fail) or cpu")
    x.add_argument("--opset", type=int, default=23)
    x.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    x.add_argument("--verbose", action="store_true", help="list every lint note, not just errors")
    x.set_defaults(run=_export_onnx)

    g = sub.add_parser("generate", help="greedy generation from a text prompt (byte-level models)")
    g.add_argument("model", nargs="?", help=model_help)
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--backend", choices=["torch", "onnx"], default="torch")
    g.set_defaults(run=_generate)

    for cmd in (s, r):
        cmd.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                         help="import MODULE first (it may register passes); repeatable")
    for cmd in (i, s, r, t, e, c, x, g):
        cmd.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)  # argparse exits with 2 on usage errors
    try:
        return args.run(args)
    except UsageError as e:
        print(f"puzzlekit {args.command}: error: {e}", file=sys.stderr)
        return 2
    except PuzzlekitError as e:
        print(f"puzzlekit {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
