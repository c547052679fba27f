"""What every `puzzlekit` command shares: argument types and groups, the model and device a command runs on,
its scenario, plugins, provenance, and one way to print results (text or --json). Each command family's module
imports this, never the CLI that wires them."""
from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import json
import math
import platform
import sys
from pathlib import Path

from ..errors import UsageError

#: generation lengths (tokens per prompt, draft tokens) above this are refused: decoding a million tokens one
#: at a time takes hours, and a bigger number is a typo rather than a plan
MAX_TOKENS = 1_000_000
#: ONNX opsets export-onnx writes: torch's exporter emits opset 18 and converts upwards; TensorRT reads up to 24
OPSETS = (18, 24)


def number(cast, lo, hi=None, above: bool = False):
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


positive_int = number(int, 1)
positive_float, nonneg_float = number(float, 0, above=True), number(float, 0)
token_count = number(int, 1, MAX_TOKENS)


#: the options whose values are paths a command reads (as argparse names them), and how the user wrote each: no
#: output may equal, contain or lie inside one (outputs.declared_inputs)
INPUT_OPTIONS = {"model": "MODEL", "library": "--library", "parent": "--parent", "data": "--data",
                 "tokenizer": "--tokenizer", "teacher": "--teacher", "cost_table": "--cost-table",
                 "include_path": "--include-path", "grid": "--grid", "pipeline": "--pipeline", "plugin": "--plugin",
                 "target": "--target", "scenario": "--scenario"}
#: the options whose values are paths a command writes
OUTPUT_OPTIONS = ("output", "report")


def input_paths(args) -> list[tuple[str, str]]:
    """(path, option) of every input path the command was given (see INPUT_OPTIONS)."""
    out = []
    for dest, option in INPUT_OPTIONS.items():
        value = getattr(args, dest, None)
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, str) and v:
                out.append((v, option))
    return out


def check_outputs(args) -> None:
    """Before any work: each output the command writes (-o, --report) is refused when it equals, contains or lies
    inside one of its inputs (outputs.check_inputs), except the run's own files (`owns`, under -o)."""
    from ..outputs import check_inputs

    if getattr(args, "command", None) == "report":  # `report OUT` reads the run it writes the report of
        return
    out = getattr(args, "output", None)
    own = [Path(out) / name for name in getattr(args, "owns", ())] if out else []
    for dest in OUTPUT_OPTIONS:
        if isinstance(getattr(args, dest, None), str):
            check_inputs(getattr(args, dest), own=own)


def add_compute_arguments(parser) -> None:
    """`--device` and `--dtype` for a command that computes (see backends.torch.device)."""
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (auto: CUDA when available; "
                                                         "under torchrun each rank takes cuda:LOCAL_RANK)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="the forward's precision (auto: bfloat16 on CUDA, float32 on CPU); weights, optimizer "
                             "state and losses stay float32")
    parser.add_argument("--threads", type=int, default=0, metavar="N",
                        help="CPU threads per process (0 or left out: one per 20M parameters; at most the CPUs this "
                             "process may use, a larger N is clamped to them with a warning)")
    parser.add_argument("--max-memory", default="", metavar="SIZE",
                        help="host memory for weights and activations, e.g. 24GB (default: half of what is available); "
                             "a larger model is run layer by layer from its checkpoint")


DATA_HELP = ("text files, directories, .jsonl (text, chat messages, or prompt/completion per line), .parquet, a "
             "datasets directory (save_to_disk) or a hub dataset (owner/name[:split]); default: the Python stdlib")


def add_text_arguments(parser, data: bool = True) -> None:
    """`--tokenizer` (and `--data`) for a command that turns text into the model's token ids."""
    parser.add_argument("--tokenizer", metavar="PATH",
                        help="the model's tokenizer: a directory of tokenizer files or a hub id (default: the one beside "
                             "the checkpoint; byte-level models use their byte codec)")
    if data:
        parser.add_argument("--data", nargs="*", help=DATA_HELP)


def add_workload_arguments(parser, mtp: bool = True) -> None:
    """The workload a target is priced at, over the named --scenario (or a scenario .toml file): lengths, the
    per-user rate floor, GPUs, the parallel layout and (with `mtp`) speculative decoding with the MTP head."""
    g = parser.add_argument_group("workload (overrides the scenario's)")
    g.add_argument("--input-len", type=number(int, 1), help="prompt tokens per request")
    g.add_argument("--output-len", type=number(int, 1), help="generated tokens per request")
    g.add_argument("--rate-floor", type=nonneg_float, help="tokens/s each user must see (0: none)")
    g.add_argument("--gpus", type=positive_int, help="devices to use (default: all of the target's)")
    g.add_argument("--layout", help="pin a parallel layout, e.g. tp8, tp8.ep8, tp1.dp8.ep8, tp2.r4 (default: the "
                                    "best one is searched)")
    g.add_argument("--ssm-cache-dtype", choices=["float32", "bfloat16", "float16"],
                   help="the Mamba SSM state cache, priced and served (default: the checkpoint's "
                        "mamba_ssm_cache_dtype, else the scenario's, float32)")
    g.add_argument("--prices", choices=["auto", "tables", "analytic"],
                   help="what prices a GPU target: NVIDIA's measured kernel tables (puzzlekit[tables]), puzzlekit's "
                        "analytic roofline, or auto (default): the tables where installed and covering the GPU")
    g.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false", default=None,
                   help="price decode without CUDA graphs (each kernel a host launch; vLLM --enforce-eager)")
    if not mtp:
        return
    g.add_argument("--mtp", action="store_true", help="serve with speculative decoding: the MTP head drafts "
                                                      "--mtp-draft tokens per step")
    g.add_argument("--mtp-draft", type=positive_int, help="tokens drafted per step with --mtp (default 3)")
    g.add_argument("--mtp-acceptance", type=number(float, 1),
                   help="mean tokens per step with --mtp (default: what mtp-check measured, from the checkpoint)")


def measured_acceptance(prog) -> dict | None:
    """The MTP acceptance mtp-check measured in the run that wrote `prog` ({"length", "drafts"}), if any."""
    prov = prog.meta.get("provenance") or prog.meta.get("config", {}).get("provenance") or {}
    return prov.get("mtp_acceptance")


def ssm_dtype_of(args, prog=None) -> str | None:
    """The SSM state dtype to price: --ssm-cache-dtype, else the checkpoint's `mamba_ssm_cache_dtype` (what vLLM
    defaults to), else None (the scenario's)."""
    from ..backends.cost.scenario import SSM_STATE_DTYPES

    by_engine = {v: k for k, v in SSM_STATE_DTYPES.items()}
    given = getattr(args, "ssm_cache_dtype", None)
    if given:
        return by_engine[given]
    config = (prog.meta.get("config") or {}) if prog is not None else {}
    found = config.get("mamba_ssm_cache_dtype")
    if found is None:
        return None
    if found not in by_engine:
        raise UsageError(f"the checkpoint's mamba_ssm_cache_dtype is {found!r}; the engines take "
                         f"{', '.join(by_engine)}: give --ssm-cache-dtype")
    return by_engine[found]


def scenario_of(args, prog=None, name: str | None = None, **more):
    """The scenario named by --scenario (or `name`) with the workload options (and `more` fields) applied; the
    drafting options without --mtp are said to do nothing (once, on stderr)."""
    from ..backends.cost import get_scenario
    from ..backends.serving import DEFAULT_DRAFTS

    over = {"input_len": args.input_len, "output_len": args.output_len, "rate_floor": args.rate_floor,
            "gpus": args.gpus, "layout": args.layout, "ssm_dtype": ssm_dtype_of(args, prog),
            "cuda_graphs": getattr(args, "cuda_graphs", None), **more}
    drafting = {"mtp_draft": "--mtp-draft", "mtp_acceptance": "--mtp-acceptance",
                "child_mtp_acceptance": "--child-mtp-acceptance"}
    unused = [flag for dest, flag in drafting.items() if getattr(args, dest, None) is not None]
    if unused and not getattr(args, "mtp", False) and not getattr(args, "drafting_noted", False):
        args.drafting_noted = True  # once per command, however many scenarios it prices
        print(f"note: {' and '.join(unused)} {'has' if len(unused) == 1 else 'have'} no effect without --mtp "
              "(plain decoding is priced)", file=sys.stderr)
    if getattr(args, "mtp", False):
        if prog is not None and not prog.find("mtp"):
            raise UsageError("--mtp prices drafting with the model's MTP head, and the model has none "
                             "(Nemotron-3-Nano and the dense Nemotron-H have none): drop --mtp")
        measured = measured_acceptance(prog) if prog is not None else None
        acceptance = args.mtp_acceptance or (measured or {}).get("length")
        if not acceptance:
            raise UsageError("--mtp needs the head's acceptance length: give --mtp-acceptance (mean tokens per step), "
                             "or price a checkpoint written by a pipeline that ran mtp-check")
        given = args.mtp_draft or DEFAULT_DRAFTS
        drafts = given if args.mtp_acceptance or not measured else measured.get("drafts", given)
        if args.mtp_draft and drafts != args.mtp_draft:  # the stored acceptance belongs to its own draft count
            raise UsageError(f"--mtp-draft {args.mtp_draft}: the checkpoint's acceptance ({acceptance:g}) was "
                             f"measured drafting {drafts}; give --mtp-acceptance for {args.mtp_draft} drafts, or drop "
                             "--mtp-draft")
        over |= {"mtp_draft": drafts, "mtp_acceptance": acceptance}
    return get_scenario(name or args.scenario, **over)


def check_prices(target: str, prices: str | None) -> None:
    """Before any work: a `--prices` the target cannot take (the tables for a GPU they do not cover, or without
    the extra; any on the cpu target) is refused, naming why and what to give instead (backends/cost/prices.py)."""
    from ..backends.cost.prices import source_of
    from ..backends.targets import get_target

    source_of(get_target(target), prices)


def note_head_options(args, prog, options: dict) -> None:
    """Options that only mean something for a model with an MTP head (`options`: argparse name -> flag), given
    for a model without one: said once on stderr, rather than ignored without a word."""
    given = [flag for dest, flag in options.items() if getattr(args, dest, None) is not None]
    if given and not prog.find("mtp"):
        print(f"note: {' and '.join(given)} {'has' if len(given) == 1 else 'have'} no effect: "
              f"{getattr(args, 'model', None) or 'the model'} has no MTP head (no head work is run)", file=sys.stderr)


def compute_of(args):
    """The command's device and precision, refused here (exit 2) when this machine has no such device."""
    from ..backends.torch.device import resolve

    return resolve(args.device, args.dtype, args.max_memory)


def emit(args, data: dict, text: str) -> None:
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


def load_plugins(modules: list[str]) -> None:
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


def load_model(args, text: bool = False):
    """The command's model, with the CPU threads chosen for its size (--threads overrides) and the tokenizer
    --tokenizer names; with `text` (the command reads or writes text) its tokenizer is checked now, before any
    work: a subword model without one is refused."""
    from .. import ir
    from ..backends.torch.device import use_threads
    from ..text.tokenizer import set_tokenizer, tokenizer_of
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


#: the held-out set each text pass measures on (data.HELD_OUT), the option that sets its window and what the window
#: adds to it (one target token past the tokens read)
HELD_OUT_USE = {"library": ("scoring", "seq", 1), "distill": ("selection", "seq", 1),
                "mtp-check": ("report", "prompt_len", 0)}


def check_held_out(passes, corpus) -> None:
    """Before any work: every held-out set a pipeline's passes (nested ones too) will draw windows from holds one
    (data.require_windows names the set, its tokens and what to change)."""
    from ..text.data import require_windows

    for p in passes:
        if p.pass_name in HELD_OUT_USE:
            role, option, plus = HELD_OUT_USE[p.pass_name]
            require_windows(corpus, role, getattr(p, option) + plus, f"pass {p.pass_name}: {option}={getattr(p, option)}")
        check_held_out(getattr(p, "body", None) or [], corpus)


def file_hashes(src: Path) -> dict[str, str]:
    files = sorted(p for p in (src.iterdir() if src.is_dir() else [src]) if p.is_file())
    out = {}
    for f in files:
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        out[f.name] = h.hexdigest()
    return out


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("puzzlekit", "torch", "safetensors", "onnx", "onnxruntime"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


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
