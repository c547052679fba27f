"""The text files of a TensorRT engine bundle: trtexec.sh (the engines' build by trtexec, TensorRT 10 and 11) and
the bundle's README (how to build, validate and deploy it, its memory plan and optimisation profiles)."""
from __future__ import annotations

import shlex


def trtexec_script(spec: dict) -> str:
    """trtexec command lines for TensorRT 10 (--stronglyTyped) and 11 (always strongly typed)."""
    s = spec["builder"]
    lines = ["#!/usr/bin/env bash", "# The engines of build.json by trtexec. TRT_MAJOR=10 (default) or 11.",
             f"# For {spec['target']} ({spec['compute_capability']}); an engine runs only on that architecture.",
             "set -euo pipefail", 'cd "$(dirname "$0")"', 'TRT_MAJOR="${TRT_MAJOR:-10}"',
             'TYPED=""; [ "$TRT_MAJOR" -lt 11 ] && TYPED="--stronglyTyped"']
    for e in spec["engines"]:
        args = [f"--onnx={e['onnx']}", f"--saveEngine={e['engine']}", "$TYPED"]
        for prof in e["profiles"]:  # one --minShapes/--optShapes/--maxShapes group per profile
            for k in ("min", "opt", "max"):
                shapes = ",".join(f"{n}:{'x'.join(map(str, sh[k]))}" for n, sh in prof["shapes"].items())
                args.append(f"--{k}Shapes={shapes}")
        args += [f"--builderOptimizationLevel={s['optimization_level']}",
                 f"--tilingOptimizationLevel={['NONE', 'FAST', 'MODERATE', 'FULL'].index(s['tiling_optimization_level'])}",
                 f"--memPoolSize=workspace:{s['workspace_bytes'] // 2**20}M", f"--timingCacheFile={s['timing_cache']}",
                 "--profilingVerbosity=detailed", f"--exportLayerInfo=layers.{e['name']}.json", "--skipInference"]
        lines.append("trtexec " + " \\\n    ".join(a if a == "$TYPED" else shlex.quote(a) for a in args))
    return "\n".join(lines) + "\n"


def readme(spec: dict, built: dict) -> str:
    """The bundle's README; `built`: the engines already built when it was written (then step 1 is done)."""
    plan, s = spec["memory_plan"], spec["scenario"]
    rows = "\n".join(f"| {e['name']} | {p['name']} | " + ", ".join(
        f"{n} {sh['min']}..{sh['max']} (opt {sh['opt']})" for n, sh in p['shapes'].items()
        if n == "input_ids" or n.endswith(".k")) + " |" for e in spec["engines"] for p in e["profiles"])
    return f"""# TensorRT engine bundle: {spec['target']} ({spec['compute_capability']}), {spec['precision']}

Written by puzzlekit build-engine for scenario `{s['name']}` ({s['input_len']} in / {s['output_len']} out,
context {spec['max_context']}). The engines are specific to {spec['compute_capability']} and to the TensorRT
version that builds them; the timing cache too.

## Deploy

{build_step(spec, built)}
2. There: `python validate.py` runs prefill and {spec['validation']['decode_steps']} decode steps on the engines and
   compares them with golden.npz (tolerance {spec['validation']['tolerance']} of the largest golden value).

## Memory plan ({spec['target']}, from the cost model)

weights {plan['weight_bytes'] / 1e9:.3f} GB, state {plan['state_bytes_per_request'] / 1e6:.2f} MB per request at
context {spec['max_context']}; up to {plan['max_concurrency']} requests fit; the largest decode batch meeting the
scenario's rate floor is {plan['max_batch']} (profiles cover batch 1..{plan['engine_max_batch']}).

## Optimisation profiles

| engine | profile | shapes |
|---|---|---|
{rows}

Builder: optimisation level {spec['builder']['optimization_level']}, tiling {spec['builder']['tiling_optimization_level']},
workspace {spec['builder']['workspace_bytes'] / 2**30:.2f} GiB, strongly typed (precision from the graphs' Q/DQ).
manifest.json holds the sha256 of every file and the provenance.
"""


def build_step(spec: dict, built: dict) -> str:
    if built:
        return (f"1. The engines ({', '.join(sorted(f'{g}.engine' for g in built))}) were built when this bundle was "
                f"written, with {spec['builder']['backend']}: nothing to build. Rebuild them only for another TensorRT "
                "version or GPU: `python build_engines.py`.")
    return (f"1. On a machine with TensorRT {spec['min_version']['tensorrt']}+ (10.x or 11.x) and a "
            f"{spec['compute_capability']} GPU:\n   `python build_engines.py` (or `bash trtexec.sh`; "
            "`TRT_MAJOR=11 bash trtexec.sh` for TensorRT 11).\n   RTX targets build anywhere with TensorRT-RTX: "
            "`python build_engines.py --builder tensorrt-rtx`.")
