"""The `puzzlekit` command line: wires each command's parser to its body (tools/program.py, text.py,
deploy.py, puzzle.py, compress.py). Exit codes: 0 success, 1 failure, 2 usage error; messages go to stderr."""
from __future__ import annotations

import argparse
import os
import sys

from ..text.data import HELD_OUT
from ..errors import PuzzlekitError, UsageError
from ..memory import return_freed_memory
from ..outputs import OutputError, declared_inputs
from . import deploy, program, text
from .common import (MAX_TOKENS, OPSETS, add_compute_arguments, add_text_arguments, add_workload_arguments,
                     check_outputs, input_paths, nonneg_float, number, positive_float, positive_int, token_count)
from .compress import add_parsers as add_compress_parsers
from .estimate import add_estimate_arguments
from .puzzle import EXTENDED_HELP, add_plan_parser
from .puzzle import add_parser as add_library_parser


# -- wiring --------------------------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="puzzlekit", description="A compiler for hybrid Mamba/MoE/attention LMs.")
    sub = p.add_subparsers(dest="command", required=True)
    model_help = "checkpoint directory or config.json (default: the built-in model)"

    i = sub.add_parser("inspect", help="verify a model and print its IR and parameter table")
    i.add_argument("model", nargs="?", help=model_help)
    i.add_argument("--check-finite", action="store_true", help="also reject NaN/inf weights (reads every tensor)")
    i.set_defaults(run=program.inspect)

    s = sub.add_parser("passes", help="list every registered pass with its options")
    s.set_defaults(run=program.passes)

    r = sub.add_parser("run", help="run a pass pipeline and write the resulting checkpoint")
    r.add_argument("model", nargs="?", help=model_help)
    r.add_argument("--pipeline", "-p", required=True, help="pipeline text, a .pipeline file, or a named pipeline")
    r.add_argument("--output", "-o", required=True, help="output checkpoint directory")
    r.add_argument("--verify-each", action="store_true", help="run the verifier after every pass")
    r.add_argument("--print-ir-after", action="store_true", help="print the IR after every pass (stderr)")
    r.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    r.add_argument("--extended", action="store_true", help=EXTENDED_HELP)
    add_estimate_arguments(r)
    r.set_defaults(run=program.run)

    t = sub.add_parser("train", help="train the default hybrid architecture on text (resumable): byte-level, or in "
                                     "the vocabulary of --tokenizer")
    t.add_argument("--output", "-o", required=True, help="run directory (re-run the same command to resume)")
    t.add_argument("--steps", type=positive_int, default=1200)
    t.add_argument("--batch", type=positive_int, default=16)
    t.add_argument("--seq", type=number(int, 2), default=256, help="window length (>= 2: the MTP head needs two)")
    t.add_argument("--lr", type=positive_float, default=3e-3)
    t.add_argument("--seed", type=number(int, 0, 2**63 - 1), default=0)
    t.add_argument("--checkpoint-every", type=positive_int, default=50)
    t.add_argument("--max-minutes", type=nonneg_float, default=0.0, help="stop and save after this long (0: no limit)")
    t.set_defaults(run=text.train)

    e = sub.add_parser("eval", help="bits per byte, NLL per token, MTP accuracy, speculative acceptance, teacher "
                                    "agreement")
    e.add_argument("model", nargs="?", help=model_help)
    e.add_argument("--teacher", help="a second model: report KL(teacher || model) and top-1 agreement")
    e.add_argument("--windows", type=positive_int, help="windows to score, at most (default: with --data the whole "
                                                         "file; otherwise, and with --held-out, 64)")
    e.add_argument("--held-out", choices=HELD_OUT, metavar="SET",
                   help="score only one held-out set of the text (scoring, selection or report), as a run that "
                        "trained or chose on the same --data saw it (default without --data: report)")
    e.add_argument("--seq", type=number(int, 2), default=256, help="window length (>= 2)")
    e.add_argument("--k", type=token_count, default=3, help="tokens drafted per step by the MTP head")
    e.add_argument("--prompts", type=positive_int, default=4, help="prompts for the speculative-decoding measurement")
    e.add_argument("--new-tokens", type=token_count, default=32,
                   help=f"tokens generated per prompt (at most {MAX_TOKENS:,})")
    e.add_argument("--tasks", help="lm-evaluation-harness tasks instead (comma-separated, e.g. arc_easy,hellaswag; "
                                   "needs puzzlekit[eval]): a table of their metrics")
    e.add_argument("--limit", type=positive_int, help="--tasks: at most this many examples per task")
    e.add_argument("--num-fewshot", type=number(int, 0), help="--tasks: few-shot examples (default: the task's)")
    e.add_argument("--include-path", action="append", default=[], metavar="DIR",
                   help="--tasks: a folder of task YAMLs of your own (e.g. reading data on disk); repeatable")
    e.add_argument("--batch-size", type=positive_int, default=8, help="--tasks: requests scored per forward")
    e.set_defaults(run=text.evaluate)

    c = sub.add_parser("cost", help="price a model on a GPU target and deployment scenario")
    c.add_argument("model", nargs="?", help=model_help)
    c.add_argument("--target", default="h100", help="h100, h200, b200, 8xh100, ..., cpu, or a .toml/.json file")
    c.add_argument("--scenario", default="decode-heavy", help="long-1m, decode-heavy, prefill-heavy, chat, or a "
                                                               ".toml file of one (FILE.toml:NAME for one of several)")
    c.add_argument("--recipe", help="weight precisions: bf16, fp8, nvfp4, nvfp4-hybrid")
    c.add_argument("--concurrency", type=positive_int, help="requests served at once (default: as many as fit)")
    c.add_argument("--engine", choices=["tensorrt-llm", "vllm", "sglang"], default="tensorrt-llm",
                   help="whose measured kernel tables price it (with the tables; default tensorrt-llm)")
    c.add_argument("--explain", action="store_true", help="each op kind's time by part, with where its price came "
                                                          "from (measured, borrowed, roofline, puzzlekit's term)")
    add_workload_arguments(c)
    c.set_defaults(run=deploy.cost)

    x = sub.add_parser("export-onnx", help="lower a model to prefill/decode ONNX graphs, linted for TensorRT")
    x.add_argument("model", nargs="?", help=model_help)
    x.add_argument("--output", "-o", required=True, help="output directory")
    x.add_argument("--target", default="cpu", help="b200, h100, ... (TensorRT lint; errors fail) or cpu")
    x.add_argument("--opset", type=number(int, *OPSETS), default=23, help=f"ONNX opset ({OPSETS[0]}-{OPSETS[1]})")
    x.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    x.add_argument("--verbose", action="store_true", help="list every lint note, not just errors")
    x.set_defaults(run=deploy.export_onnx)

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
    be.set_defaults(run=deploy.build_engine)

    cs = sub.add_parser("check-serving", help="what vLLM, SGLang and TensorRT-LLM build from a published checkpoint, "
                                              "layer by layer, from its config and tensor headers (no weights read); "
                                              "exit 1 on a mismatch")
    cs.add_argument("model", help="a checkpoint directory (the published nemotron_h_puzzle form)")
    cs.add_argument("--engine", choices=["vllm", "sglang", "tensorrt-llm", "all"], default="all")
    cs.add_argument("--layout", help="a parallel layout to check the splits of: tp2, tp8.ep8, tp1.dp8.ep8, ...")
    cs.add_argument("--verbose", action="store_true", help="list every layer each engine builds")
    cs.add_argument("--context", type=int, help="the context a serve command asks for: refused past the "
                    "checkpoint's max_position_embeddings")
    cs.set_defaults(run=deploy.check_serving)

    g = sub.add_parser("generate", help="greedy generation from a text prompt, in the model's own tokenization")
    g.add_argument("model", nargs="?", help=model_help)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="send the prompt as a user message through the tokenizer's chat "
                                                       "template (with the assistant's turn opened)")
    g.add_argument("--max-new-tokens", type=token_count, default=64, help=f"at most {MAX_TOKENS:,}")
    g.add_argument("--backend", choices=["torch", "onnx"], default="torch")
    g.set_defaults(run=text.generate)

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
    for cmd in (i, s, r, t, e, c, x, be, cs, g, lb, pl, cp, rp):
        cmd.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    return p


def main(argv: list[str] | None = None) -> int:
    """Runs one command: errors are one message on stderr, never a traceback (PUZZLEKIT_DEBUG=1 re-raises)."""
    args = parser().parse_args(argv)  # argparse exits with 2 on usage errors
    return_freed_memory()
    import torch

    threads = torch.get_num_threads()  # a command sets its own (device.use_threads); a caller's is restored
    try:
        with declared_inputs(input_paths(args)):  # every path it reads: no output may touch one
            check_outputs(args)
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
