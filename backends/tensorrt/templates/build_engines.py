"""Builds this bundle's TensorRT engines from its ONNX graphs with the settings in build.json.

    python build_engines.py                  # datacenter TensorRT 10.x / 11.x, on the GPU named in build.json
    python build_engines.py --builder tensorrt-rtx   # TensorRT-RTX: ahead of time, no GPU needed

Writes <graph>.engine, timing.cache, layers.<graph>.json (the engine inspector's layer report, where a GPU
can load the engine) and engines.json (what was built, by which TensorRT, in how long). Refuses a GPU whose
compute capability is not the bundle's: an engine runs only on the architecture it was built for.
Needs only TensorRT (and nvidia-smi to identify the GPU); not puzzlekit.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def fail(msg: str) -> None:
    print(f"build_engines.py: error: {msg}", file=sys.stderr)
    sys.exit(1)


def load_tensorrt(builder: str):
    try:
        if builder == "tensorrt-rtx":
            import tensorrt_rtx_bindings as trt
        else:
            import tensorrt as trt
    except ImportError as e:
        want = ("pip install --no-deps tensorrt_rtx_cu12_libs tensorrt_rtx_cu12_bindings" if builder == "tensorrt-rtx"
                else "TensorRT 10.x or 11.x (pip install tensorrt, from NVIDIA's index)")
        fail(f"cannot import {builder} ({e}); install {want}")
    return trt


def version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".")[:3] if p.isdigit())


def gpu_compute_capability() -> str | None:
    """The first GPU's compute capability as "sm_XY", or None where no GPU (or no nvidia-smi) is found."""
    if shutil.which("nvidia-smi") is None:
        return None
    r = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                       text=True)
    line = r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else ""
    return "sm_" + line.replace(".", "") if line else None


def check_gpu(expected: str, found: str | None) -> None:
    """An engine is specific to one GPU architecture: refuse to build this bundle's on another."""
    if found is None:
        fail(f"no GPU found (nvidia-smi); this bundle's engines are for {expected}: build them on that GPU, or "
             "use --builder tensorrt-rtx for an RTX target")
    if found != expected:
        fail(f"this GPU is {found}, but the bundle is for {expected}: its engines would not run there. Build the "
             f"bundle for this GPU (puzzlekit build-engine --target ...) or run this on a {expected} GPU")


def build_one(trt, logger, cfg: dict, spec: dict, rtx: bool, cache_bytes: bytes) -> tuple[bytes, bytes, dict]:
    s = cfg["builder"]
    builder = trt.Builder(logger)
    flags = 0
    strongly_typed = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    if strongly_typed is not None:  # 10.x needs it for FP8/FP4 Q/DQ; 11 builds strongly typed regardless
        flags = 1 << int(strongly_typed)  # precision comes from the graph's Q/DQ and casts
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(HERE / spec["onnx"])):
        fail(f"{spec['onnx']} does not parse: " + "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors)))
    config = builder.create_builder_config()
    if rtx:  # ahead of time, for the bundle's architecture
        config.num_compute_capabilities = 1
        config.set_compute_capability(getattr(trt.ComputeCapability, cfg["compute_capability"].replace("sm_", "SM")), 0)
    config.builder_optimization_level = s["optimization_level"]
    if hasattr(config, "tiling_optimization_level"):  # TensorRT 10.8+
        config.tiling_optimization_level = getattr(trt.TilingOptimizationLevel, s["tiling_optimization_level"])
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, s["workspace_bytes"])
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    cache = config.create_timing_cache(cache_bytes)
    config.set_timing_cache(cache, ignore_mismatch=False)
    names = {network.get_input(i).name: len(network.get_input(i).shape) for i in range(network.num_inputs)}
    for prof in spec["profiles"]:
        p = builder.create_optimization_profile()
        for name, shapes in prof["shapes"].items():
            if name not in names:
                fail(f"build.json names input {name!r}, which {spec['onnx']} does not have")
            p.set_shape(name, shapes["min"], shapes["opt"], shapes["max"])
        config.add_optimization_profile(p)
    t0 = time.perf_counter()
    blob = builder.build_serialized_network(network, config)
    if blob is None:
        fail(f"TensorRT could not build {spec['onnx']} (see its log above)")
    seconds = time.perf_counter() - t0
    return bytes(blob), bytes(config.get_timing_cache().serialize()), {"build_seconds": round(seconds, 3),
                                                                      "profiles": [p["name"] for p in spec["profiles"]]}


def layer_report(trt, logger, blob: bytes) -> str | None:
    """The engine inspector's JSON layer report; None where no GPU can load the engine (ahead-of-time builds)."""
    try:
        engine = trt.Runtime(logger).deserialize_cuda_engine(blob)
    except Exception:
        return None
    if engine is None:
        return None
    return engine.create_engine_inspector().get_engine_information(trt.LayerInformationFormat.JSON)


def main(argv=None) -> int:
    cfg = json.loads((HERE / "build.json").read_text())
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--builder", choices=["tensorrt", "tensorrt-rtx"], default=cfg["builder"]["backend"])
    ap.add_argument("--graphs", nargs="*", help="build only these (default: all in build.json)")
    ap.add_argument("--verbose", action="store_true", help="TensorRT's own log at INFO level")
    args = ap.parse_args(argv)
    rtx = args.builder == "tensorrt-rtx"
    trt = load_tensorrt(args.builder)
    need = cfg["min_version"]["tensorrt-rtx" if rtx else "tensorrt"]
    if version(trt.__version__) < version(need):
        fail(f"{args.builder} {trt.__version__} is older than {need}, the oldest that builds this bundle's graphs")
    if not rtx:
        check_gpu(cfg["compute_capability"], gpu_compute_capability())
    logger = trt.Logger(trt.Logger.INFO if args.verbose else trt.Logger.WARNING)
    cache_file = HERE / cfg["builder"]["timing_cache"]
    cache = cache_file.read_bytes() if cache_file.exists() else b""
    record = {"builder": args.builder, "version": trt.__version__, "compute_capability": cfg["compute_capability"],
              "engines": {}}
    for spec in cfg["engines"]:
        if args.graphs and spec["name"] not in args.graphs:
            continue
        blob, cache, info = build_one(trt, logger, cfg, spec, rtx, cache)
        (HERE / spec["engine"]).write_bytes(blob)
        cache_file.write_bytes(cache)
        report = layer_report(trt, logger, blob) if gpu_compute_capability() else None
        if report is not None:
            (HERE / f"layers.{spec['name']}.json").write_text(report)
        info.update(bytes=len(blob), layer_report=report is not None)
        record["engines"][spec["name"]] = info
        print(f"{spec['engine']}: {len(blob) / 1e6:.1f} MB in {info['build_seconds']:.1f} s")
    (HERE / "engines.json").write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
