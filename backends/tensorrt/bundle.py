"""A TensorRT engine bundle for one target and scenario: everything needed to build and check its engines.

    prefill.onnx, decode.onnx (+ .data)  the graphs, in the program's precision (Q/DQ patterns TensorRT fuses)
    build.json       every builder setting: optimisation profiles from the scenario and the cost model's memory
                     plan, optimisation and tiling levels, workspace, compute capability, minimum TensorRT
    build_engines.py the TensorRT 10.x / 11.x (or TensorRT-RTX) Python build; trtexec.sh the same by trtexec
    validate.py      engines against golden.npz (onnxruntime, or the ONNX reference evaluator for FP4 graphs)
    manifest.json    sha256 of every file and the provenance; README.md  how to deploy it
    serve.sh, trtllm-llm-api.yaml  with a checkpoint given: vLLM, SGLang and TensorRT-LLM serving it as priced

Prefill and decode are separate engines: one profile spanning both picks poor kernels for each. Prefill gets
short / medium / long profiles; decode one profile over batch 1..max batch and the past up to the context.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from ...errors import PuzzlekitError
from ...ir import Program
from ...ir.companions import copy_companions
from ...outputs import check_output, staged_dir
from ..cost import Scenario, cost
from ..onnx import DECODE, PREFILL, export_onnx
from ..layout import Layout
from ..serving import TRTLLM_YAML, serving
from ..targets import Target
from .bundle_text import readme, trtexec_script

TEMPLATES = Path(__file__).with_name("templates")
FORMAT = "puzzlekit-trt-bundle/1"
#: decode batch a profile covers at most: a serving engine's batch limit, whatever memory would allow
MAX_ENGINE_BATCH = 256
#: tokens a prefill profile covers at once (batch x sequence), as serving engines bound a prefill step
PREFILL_TOKENS = 8192
#: prefill profiles: name -> longest prompt it covers (the last one reaches the scenario's input length)
PREFILL_BANDS = (("short", 512), ("medium", 8192), ("long", None))
#: validate.py's tolerance (max error / max |golden|) per precision, and the argmax agreement floor. fp32 engines
#: may use TF32 matmuls; FP8 and NVFP4 differ from onnxruntime in rounding of scales and accumulation order
TOLERANCE = {"fp32": 1e-2, "bf16": 3e-2, "fp8": 6e-2, "nvfp4-weight": 6e-2, "nvfp4": 0.15}
BUILDER = {"optimization_level": 3, "tiling_optimization_level": "FAST", "workspace_fraction": 0.25,
           "timing_cache": "timing.cache"}
#: the oldest TensorRT that builds each precision from ONNX: FP8 Q/DQ since 9 (10 is the oldest with the settings
#: used here), FLOAT4E2M1 and the dynamic FP4 quantizer since 10.8; TensorRT-RTX: the release tested here
MIN_VERSION = {"fp32": "10.0", "bf16": "10.0", "fp8": "10.0", "nvfp4-weight": "10.8", "nvfp4": "10.8"}
MIN_RTX_VERSION = "1.7"


class BundleError(PuzzlekitError):
    """A bundle cannot be made for this target (precision it lacks, no builder) or its engines failed to build."""


def precision(prog: Program) -> str:
    """The bundle's precision, named by the widest-reaching format in the program: nvfp4 (W4A4) > nvfp4-weight >
    fp8 > the program's float dtype."""
    have = formats(prog)
    for fmt in ("nvfp4", "nvfp4-weight", "fp8", "fp8-weight"):
        if fmt in have:
            return "fp8" if fmt == "fp8-weight" else fmt
    return "bf16" if prog.meta.get("dtype") == "bfloat16" else "fp32"


def formats(prog: Program) -> set[str]:
    return {fmt for n in prog.nodes for _, fmt in n.op.quant}


def check_fp4(fmts, target: Target, what: str = "the model is quantized with") -> None:
    """FP4 (weights or activations) needs FP4 hardware (Blackwell); refused here, before TensorRT is asked,
    which refuses it too, but only after the export, naming an internal data type."""
    fp4 = sorted(f for f in fmts if f.startswith("nvfp4"))
    if fp4 and not target.supports("nvfp4"):
        raise BundleError(f"target {target.name} ({target.compute_capability}) has no FP4 tensor cores, but {what} "
                          f"{', '.join(fp4)}: TensorRT cannot build FP4 for it. Use the `fp8` recipe on "
                          f"{target.name} (build-engine --recipe fp8 on the unquantized model)")


def builder_kind(target: Target) -> str:
    kind = target.trt.get("builder")
    if target.kind != "gpu" or kind not in ("tensorrt", "tensorrt-rtx"):
        raise BundleError(f"target {target.name} has no TensorRT builder; use a GPU target (b200, h100, h200, "
                          "rtx-sm120, rtx-sm89) or a target file with trt.builder")
    return kind


def _dims(vi) -> list:
    return [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]


def _inputs(path: Path) -> dict[str, list]:
    m = onnx.load(str(path), load_external_data=False)
    return {vi.name: _dims(vi) for vi in m.graph.input}


def _kv_dtype(decode: Path) -> str:
    """The element type of the decode graph's KV cache inputs (as ONNX names it), or "none" without attention."""
    m = onnx.load(str(decode), load_external_data=False)
    kv = [vi for vi in m.graph.input if vi.name.endswith((".k", ".v"))]
    return onnx.TensorProto.DataType.Name(kv[0].type.tensor_type.elem_type).lower() if kv else "none"


def _shape(dims: list, sizes: dict) -> list[int]:
    return [sizes[d] if isinstance(d, str) else d for d in dims]


def _profile(name: str, inputs: dict, lo: dict, opt: dict, hi: dict) -> dict:
    return {"name": name, "shapes": {n: {"min": _shape(d, lo), "opt": _shape(d, opt), "max": _shape(d, hi)}
                                     for n, d in inputs.items()}}


def plan_profiles(prefill_inputs: dict, decode_inputs: dict, max_batch: int, input_len: int,
                  max_context: int) -> dict:
    """Optimisation profiles: prefill bands over the prompt length (batch bounded by PREFILL_TOKENS), and one
    decode profile over batch 1..max_batch and past lengths 1..max_context - 1."""
    longest = max(1, min(input_len, max_context))
    prefill, start = [], 1
    for band, end in PREFILL_BANDS:
        end = longest if end is None else min(end, longest)
        if end < start:
            continue
        b = max(1, min(max_batch, PREFILL_TOKENS // end))
        prefill.append(_profile(band, prefill_inputs, {"batch": 1, "sequence": start},
                                {"batch": max(1, b // 2), "sequence": (start + end) // 2},
                                {"batch": b, "sequence": end}))
        start = end + 1
    past = max(1, max_context - 1)
    decode = [_profile("decode", decode_inputs, {"batch": 1, "past_sequence": 1},
                       {"batch": max_batch, "past_sequence": min(max(1, input_len), past)},
                       {"batch": max_batch, "past_sequence": past})]
    return {"prefill": prefill, "decode": decode}


@dataclass
class BundleReport:
    directory: Path
    target: str
    precision: str
    files: list
    engines: dict  # graph -> {"bytes", "build_seconds", ...} for engines built here
    build: dict  # build.json

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["directory"] = str(self.directory)
        return d


def _golden(directory: Path, spec: dict, vocab: int, batch: int, outputs: list, seed: int = 0) -> dict:
    """Prefill and decode outputs for a seeded prompt from onnxruntime, or from the ONNX reference evaluator
    where a graph holds FP4 (onnxruntime cannot run it)."""
    rng = np.random.default_rng(seed)
    v = spec["validation"]
    runs = {}
    for name in (PREFILL, DECODE):
        model = onnx.load(str(directory / name))
        fp4 = any(t.data_type == onnx.TensorProto.FLOAT4E2M1 for t in model.graph.initializer) or \
            any(n.domain == "trt" for n in model.graph.node)
        if fp4:
            from onnx.reference import ReferenceEvaluator

            from ..onnx.trt_ops import TRT_FP4DynamicQuantize

            ref = ReferenceEvaluator(model, new_ops=[TRT_FP4DynamicQuantize])
            names = [o.name for o in model.graph.output]
            runs[name] = lambda feeds, ref=ref, names=names: dict(zip(names, ref.run(None, feeds)))
        else:  # OrtValues in and out: the state may be FP8, which numpy cannot hold
            import onnxruntime as ort

            opts = ort.SessionOptions()
            opts.log_severity_level = 3  # errors only: not a line per unused constant
            sess = ort.InferenceSession(str(directory / name), opts, providers=["CPUExecutionProvider"])
            names = [o.name for o in sess.get_outputs()]

            def run(feeds, sess=sess, names=names):
                feeds = {k: ort.OrtValue.ortvalue_from_numpy(v) if isinstance(v, np.ndarray) else v
                         for k, v in feeds.items()}
                return dict(zip(names, sess.run_with_ort_values(names, feeds)))
            runs[name] = run
    g = {"prefill.input_ids": rng.integers(0, vocab, (batch, v["prompt_len"]), dtype=np.int64)}
    out = runs[PREFILL]({"input_ids": g["prefill.input_ids"]})
    g.update({f"prefill.{n}": _array(out[n]) for n in outputs})
    for step in range(v["decode_steps"]):
        ids = rng.integers(0, vocab, (batch, 1), dtype=np.int64)
        feeds = {"input_ids": ids, **{"past." + n[8:]: a for n, a in out.items() if n.startswith("present.")}}
        out = runs[DECODE](feeds)
        g[f"decode.{step}.input_ids"] = ids
        g.update({f"decode.{step}.{n}": _array(out[n]) for n in outputs})
    bad = [k for k, a in g.items() if a.dtype.kind == "f" and not np.isfinite(a).all()]
    if bad:
        raise BundleError(f"the golden outputs {bad[:3]} are not finite: the model or its quantization produces "
                          "NaN or infinity; check it with `puzzlekit eval` before building engines")
    return g


def _array(v) -> np.ndarray:
    return v if isinstance(v, np.ndarray) else v.numpy()


def _fp8_kv_cache(prog: Program, directory: Path, ids=None) -> None:
    """Calibrates per-state KV amax with a torch prefill and rewrites both graphs to carry the cache in FP8."""
    import torch

    from ..onnx.kv_cache import fp8_kv_cache, is_kv, kv_scales
    from ..torch import materialize

    module = materialize(prog)
    vocab = prog.find("embed")[0].op.vocab
    if ids is None:
        ids = torch.randint(0, vocab, (4, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, state = module.prefill(ids)
    scales = kv_scales({n: float(t.abs().amax()) for n, t in zip(module.state_names, state) if is_kv(n)})
    for name in (PREFILL, DECODE):
        path = directory / name
        model = onnx.load(str(path), load_external_data=False)
        fp8_kv_cache(model, scales)
        onnx.save_model(model, str(path))
        onnx.checker.check_model(str(path), full_check=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def can_build(kind: str) -> bool:
    """Whether engines can be built on this machine: TensorRT-RTX needs only its package; datacenter TensorRT
    its package and a GPU (build_engines.py then checks it is the bundle's)."""
    import importlib.util

    if kind == "tensorrt-rtx":
        return importlib.util.find_spec("tensorrt_rtx_bindings") is not None
    return importlib.util.find_spec("tensorrt") is not None and shutil.which("nvidia-smi") is not None


def run_build(directory: Path, kind: str, timeout: float | None = None) -> dict:
    """Runs the bundle's own build_engines.py (the script users run) in a child process; its engines.json."""
    r = subprocess.run([sys.executable, "build_engines.py", "--builder", kind], cwd=directory, capture_output=True,
                       text=True, timeout=timeout)
    if r.returncode != 0:
        tail = "\n  ".join((r.stderr or r.stdout).strip().splitlines()[-6:])
        raise BundleError(f"building the engines in {directory} failed:\n  {tail}")
    return json.loads((directory / "engines.json").read_text())["engines"]


def write_bundle(prog: Program, out, target: Target, scenario: Scenario, build: str = "auto",
                 overwrite: bool = False, provenance: dict | None = None, opset: int = 23,
                 calibration_ids=None, checkpoint=None, layout=None, draft_tokens: int | None = None,
                 ssm_dtype: str | None = None) -> BundleReport:
    """Writes the bundle for `target` into `out`, atomically; builds its engines here when `build` is "yes", or
    "auto" and a builder is present. The program is exported as it is: quantize it first for the target. Where
    the scenario plans an FP8 KV cache, its scales are calibrated on `calibration_ids` [batch, tokens] (default:
    seeded random tokens). With `checkpoint` (the program's saved directory) the bundle also says how to serve it
    with vLLM, SGLang and TensorRT-LLM (backends/serving.py) as priced: in `layout` (default: the best one, as
    `cost` picks), with `draft_tokens` drafted by the MTP head and the SSM state in `ssm_dtype` (default: the
    scenario's)."""
    check_output(out, prog.input_paths(), overwrite)  # before the work, not after
    kind = builder_kind(target)
    check_fp4(formats(prog), target)
    if build not in ("auto", "yes", "no"):
        raise BundleError(f"build must be auto, yes or no, not {build!r}")
    if build == "yes" and not can_build(kind):
        raise BundleError(f"cannot build {target.name} engines here: {kind} is not installed"
                          + ("" if kind == "tensorrt-rtx" else " or no GPU is present")
                          + "; pass --build no to write the bundle only")
    if layout:  # the memory plan and the serving commands priced in the layout asked for
        layout = str(Layout.parse(str(layout)))
        if scenario.layout and str(Layout.parse(scenario.layout)) != layout:
            raise BundleError(f"layout {layout} differs from the one scenario {scenario.name} pins, {scenario.layout}")
        scenario = dataclasses.replace(scenario, layout=layout).check()
    if ssm_dtype:  # the state dtype served is the one priced
        from ..cost.scenario import SSM_STATE_DTYPES

        by_engine = {v: k for k, v in SSM_STATE_DTYPES.items()}
        scenario = dataclasses.replace(scenario, ssm_dtype=by_engine.get(ssm_dtype, ssm_dtype)).check()
    report = cost(prog, target, scenario)
    if report.max_concurrency < 1:
        raise BundleError(f"the model does not fit {target.name} for scenario {scenario.name}: {report.infeasible}")
    serve = serving(prog, checkpoint, report.layout, scenario, report.max_batch, draft_tokens, ssm_dtype) \
        if checkpoint is not None else None
    prec = precision(prog)
    engine_batch = max(1, min(report.max_batch or 1, MAX_ENGINE_BATCH))
    outputs = list(prog.outputs)
    vocab = prog.find("embed")[0].op.vocab
    with staged_dir(out, overwrite, prog.input_paths()) as tmp:
        onnx_dir = tmp / "onnx"
        export_onnx(prog, onnx_dir, target=target, opset=opset, provenance=provenance)
        for f in onnx_dir.iterdir():
            os.replace(f, tmp / f.name)
        onnx_dir.rmdir()
        if scenario.kv_dtype == "fp8":
            _fp8_kv_cache(prog, tmp, calibration_ids)
        tokenizer_files = copy_companions(prog, tmp)  # the runtime tokenizes and stops at EOS as the parent did
        profiles = plan_profiles(_inputs(tmp / PREFILL), _inputs(tmp / DECODE), engine_batch, scenario.input_len,
                                 scenario.context_len)
        spec = {
            "format": FORMAT, "target": target.name, "compute_capability": target.compute_capability,
            "precision": prec, "formats": sorted(formats(prog)),
            "kv_cache_dtype": _kv_dtype(tmp / DECODE),
            "min_version": {"tensorrt": MIN_VERSION[prec], "tensorrt-rtx": MIN_RTX_VERSION},
            "scenario": dataclasses.asdict(scenario), "max_context": scenario.context_len,
            "memory_plan": {"max_batch": report.max_batch, "engine_max_batch": engine_batch,
                            "max_concurrency": report.max_concurrency, "weight_bytes": report.weight_bytes,
                            "state_bytes_per_request": report.state_bytes_per_request,
                            "memory_available_bytes": report.memory_available_bytes,
                            "decode_step_seconds": report.decode_step_seconds, "infeasible": report.infeasible},
            "builder": {"backend": kind, "optimization_level": BUILDER["optimization_level"],
                        "tiling_optimization_level": BUILDER["tiling_optimization_level"],
                        "workspace_bytes": int(min(target.memory_bytes * BUILDER["workspace_fraction"], 2**36)),
                        "timing_cache": BUILDER["timing_cache"], "strongly_typed": True},
            "outputs": outputs, "tokenizer_files": tokenizer_files,
            "engines": [{"name": "prefill", "onnx": PREFILL, "engine": "prefill.engine", "profiles": profiles["prefill"]},
                        {"name": "decode", "onnx": DECODE, "engine": "decode.engine", "profiles": profiles["decode"]}],
            "validation": {"golden": "golden.npz", "tolerance": TOLERANCE[prec], "argmax_agreement": 0.9,
                           "prompt_len": min(12, profiles["prefill"][0]["shapes"]["input_ids"]["max"][1]),
                           "decode_steps": 6},
        }
        if serve:
            spec["serving"] = serve.to_json()
            (tmp / "serve.sh").write_text(serve.serve_sh())
            (tmp / "serve.sh").chmod(0o755)
            (tmp / TRTLLM_YAML).write_text(serve.trtllm_yaml())
        (tmp / "build.json").write_text(json.dumps(spec, indent=2) + "\n")
        batch = min(2, engine_batch, profiles["prefill"][0]["shapes"]["input_ids"]["max"][0])
        np.savez(tmp / "golden.npz", **_golden(tmp, spec, vocab, batch, outputs))
        for name in ("build_engines.py", "validate.py"):
            shutil.copyfile(TEMPLATES / name, tmp / name)
        (tmp / "trtexec.sh").write_text(trtexec_script(spec))
        (tmp / "trtexec.sh").chmod(0o755)
        engines = run_build(tmp, kind) if build == "yes" or (build == "auto" and can_build(kind)) else {}
        (tmp / "README.md").write_text(readme(spec, engines) + ("\n" + serve.readme() if serve else ""))
        files = sorted(p.name for p in tmp.iterdir() if p.is_file())
        manifest = {"format": FORMAT, "files": {f: _sha256(tmp / f) for f in files},
                    "provenance": provenance or {}, "engines_built_here": engines}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return BundleReport(Path(out).resolve(), target.name, prec, files + ["manifest.json"], engines, spec)
