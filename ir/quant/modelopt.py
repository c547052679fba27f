"""The quantization config in NVIDIA Model Optimizer's layout, the one vLLM and TensorRT-LLM read.

Model Optimizer's Hugging Face export writes it twice. `hf_quant_config.json` holds
{"producer": {"name", "version"}, "quantization": {"quant_algo", "kv_cache_quant_algo", ...}}; config.json's
`quantization_config` holds the same flattened (`quant_method: "modelopt"`, `ignore` for the excluded
modules, `kv_cache_scheme`, compressed-tensors `config_groups`). When every quantised module uses one
algorithm, `quant_algo` names it (NVFP4 adds `group_size: 16`) and `exclude_modules` lists the
unquantised linear modules as prefix wildcards. Several algorithms give `quant_algo: "MIXED_PRECISION"`
and `quantized_layers`, one entry per module ({"quant_algo": "FP8"}, {"quant_algo": "NVFP4",
"group_size": 16}, {"quant_algo": "W4A16_NVFP4", "group_size": 16}); a module not listed is unquantised
(vLLM's ModelOptMixedPrecisionConfig, TensorRT-LLM's quant_config_dict).

Tensors, as in NVIDIA's FP8 and NVFP4 releases: `<module>.weight` (float8_e4m3fn, or uint8 holding two
E2M1 values per byte), `.weight_scale` (a float32 scalar for FP8; float8_e4m3fn per block of 16 for
NVFP4), `.weight_scale_2` (NVFP4's float32 global scale) and `.input_scale` (a float32 scalar, for the
formats that quantise activations). `fp8-weight` (FP8 weights, unquantised activations) has no Model
Optimizer algorithm, so it cannot be written in this layout.
"""
from __future__ import annotations

import json
import re
from fnmatch import translate

from ...errors import CheckpointError

#: our format -> Model Optimizer's quant_algo
ALGO = {"fp8": "FP8", "nvfp4": "NVFP4", "nvfp4-weight": "W4A16_NVFP4"}
FORMAT = {v: k for k, v in ALGO.items()}
GROUP = 16  # NVFP4's block size
MIXED = "MIXED_PRECISION"
HF_QUANT_CONFIG = "hf_quant_config.json"


def linear_modules(prog) -> dict[str, tuple]:
    """Every linear module of the program (a 2-D weight other than the embedding) -> (node, local weight name).

    Module names are the checkpoint's: `backbone.layers.1.mixer.experts.3.up_proj`, `mtp.layers.0.eh_proj`,
    `lm_head`."""
    out = {}
    for n in prog.nodes:
        if n.op.kind == "embed":
            continue
        for local, shape in n.op.params().items():
            if len(shape) == 2 and (local == "weight" or local.endswith(".weight")):
                out[n.path if local == "weight" else f"{n.path}.{local.removesuffix('.weight')}"] = (n, local)
    return out


def formats(prog) -> dict[str, str | None]:
    """Linear module -> its quantization format, or None."""
    return {m: dict(n.op.quant).get(local) for m, (n, local) in linear_modules(prog).items()}


def _entry(fmt: str) -> dict:
    return {"quant_algo": ALGO[fmt], **({"group_size": GROUP} if fmt.startswith("nvfp4") else {})}


def _prefix_wildcards(unquantised: list[str], quantised: list[str]) -> set[str]:
    """Model Optimizer's summary of the excluded modules: for each, the shortest prefix wildcard cut at a
    dot (`backbone.layers.3*`, else `backbone.layers.3.*`) that matches no quantised module, else its name."""
    taken = set()
    for q in quantised:
        taken |= {q} | {q[:i] + "*" for i in range(len(q) + 1)}
    out = set()
    for u in unquantised:
        cuts = [i for i, c in enumerate(u) if c == "."]
        candidates = [c for i in cuts for c in ([u[:i] + "*"], [u[:i], u[:i] + ".*"])] + [[u]]
        chosen = next(c for c in candidates if not any(w in taken for w in c))
        out.add(chosen[-1])  # of the pair {p, p.*} only p.* is written
    return out


def hf_quant_config(prog, producer: dict) -> dict | None:
    """The `hf_quant_config.json` of a program (None when nothing is quantised); raises for a format
    Model Optimizer's layout cannot express."""
    modules = formats(prog)
    quantised = {m: f for m, f in modules.items() if f}
    if not quantised:
        return None
    bad = next((m for m, f in quantised.items() if f not in ALGO), None)
    if bad is not None:
        raise CheckpointError(f"save: module {bad} is quantised as {quantised[bad]!r}, which Model Optimizer's layout "
                              f"(read by vLLM and TensorRT-LLM) has no algorithm for (it has {', '.join(ALGO)}); "
                              "quantise it with one of those, or save with extended=True (CLI: --extended)")
    layers = {m: _entry(f) for m, f in sorted(quantised.items())}
    q = {"quant_algo": None, "kv_cache_quant_algo": prog.meta.get("kv_cache_quant_algo")}
    if len({json.dumps(e, sort_keys=True) for e in layers.values()}) > 1:
        q.update(quant_algo=MIXED, quantized_layers=layers)
    else:
        q.update(next(iter(layers.values())))
        q["exclude_modules"] = sorted(_prefix_wildcards([m for m, f in modules.items() if not f], list(quantised)))
    return {"producer": producer, "quantization": q}


def _group(entry: dict) -> dict:
    """A compressed-tensors config group for one algorithm."""
    def fmt(bits: int) -> dict:
        return {"dynamic": False, "num_bits": bits, "type": "float",
                **({"group_size": entry["group_size"]} if "group_size" in entry else {})}

    bits = 8 if entry["quant_algo"] == "FP8" else 4
    return {**({} if entry["quant_algo"] == "W4A16_NVFP4" else {"input_activations": fmt(bits)}), "weights": fmt(bits)}


def inline_config(hf: dict) -> dict:
    """config.json's `quantization_config`: `hf_quant_config.json` flattened, as Model Optimizer writes it."""
    q = hf["quantization"]
    out: dict = {}
    if q["quant_algo"] == MIXED:
        groups: dict[str, list[str]] = {}
        for module, entry in q["quantized_layers"].items():
            groups.setdefault(json.dumps(sorted(entry.items())), []).append(module)
        out["config_groups"] = {f"group_{i}": {**_group(dict(json.loads(k))), "targets": sorted(mods)}
                                for i, (k, mods) in enumerate(groups.items())}
        out["quantized_layers"] = q["quantized_layers"]
    else:
        out["config_groups"] = {"group_0": {**_group(q), "targets": ["Linear"]}}
    out["ignore"] = q.get("exclude_modules") or []
    out["quant_algo"] = q["quant_algo"]
    if q.get("kv_cache_quant_algo") == "FP8":
        out["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
    out["producer"] = hf["producer"]
    out["quant_method"] = "modelopt"
    return out


def read(qc: dict, modules: list[str], where) -> tuple[dict[str, str], str | None]:
    """({module: format}, KV cache algorithm) from either shape; `modules` are the program's linear modules."""
    if not isinstance(qc, dict):
        raise CheckpointError(f"{where}: the quantization config must be an object, got {type(qc).__name__}")
    legacy = "quantization" in qc
    q = qc["quantization"] if legacy else qc
    if not isinstance(q, dict):
        raise CheckpointError(f"{where}: `quantization` must be an object")
    algo = q.get("quant_algo")
    kv = q.get("kv_cache_quant_algo") if legacy else ("FP8" if isinstance(q.get("kv_cache_scheme"), dict) and
                                                      q["kv_cache_scheme"].get("num_bits") == 8 else None)
    if kv not in (None, "FP8"):
        raise CheckpointError(f"{where}: kv cache algorithm {kv!r} is not supported (FP8 or none)")
    if algo == MIXED:
        layers = q.get("quantized_layers")
        if not isinstance(layers, dict) or not layers:
            raise CheckpointError(f"{where}: quant_algo MIXED_PRECISION needs a non-empty `quantized_layers` object")
        out = {}
        for module, entry in layers.items():
            a = entry.get("quant_algo") if isinstance(entry, dict) else None
            if a not in FORMAT:
                raise CheckpointError(f"{where}: quantized_layers[{module!r}] has quant_algo {a!r}; puzzlekit reads "
                                      f"{', '.join(FORMAT)}")
            out[module] = FORMAT[a]
        return out, kv
    if algo not in FORMAT:
        raise CheckpointError(f"{where}: quant_algo {algo!r} is not supported; puzzlekit reads {', '.join(FORMAT)} "
                              f"and {MIXED}")
    excluded = q.get("exclude_modules" if legacy else "ignore") or []
    if not isinstance(excluded, list) or not all(isinstance(p, str) for p in excluded):
        raise CheckpointError(f"{where}: the excluded modules must be a list of names or wildcards")
    # one expression for every name and wildcard: a module is matched once, not once per pattern (a full-size
    # config lists tens of thousands of modules)
    names, wild = set(excluded), re.compile("|".join(f"(?:{translate(p)})" for p in excluded) or "(?!)")
    return {m: FORMAT[algo] for m in modules if m not in names and not wild.match(m)}, kv
