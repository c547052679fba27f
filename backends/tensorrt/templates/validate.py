"""Checks this bundle's engines against the golden outputs computed when the bundle was written.

    python validate.py                          # the engines, on the GPU (TensorRT, and torch for CUDA buffers)
    python validate.py --runtime onnxruntime    # the bundle's ONNX graphs on CPU (graphs without FP4)

Runs prefill on the golden prompt, then a decode loop over the golden tokens, feeding back the state each step
returns. Every model output is compared with its golden value: max |got - want| <= tolerance * max |want|,
with the tolerance of the bundle's precision (build.json "validation"), and the logits' argmax must agree on
at least the set share of positions. Exit code 0 when everything agrees.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


class OnnxRuntimeRunner:
    """Values stay OrtValues between steps: an FP8 KV cache is a type numpy cannot hold."""

    def __init__(self, cfg: dict):
        import onnxruntime as ort

        self.ort = ort
        opts = ort.SessionOptions()
        opts.log_severity_level = 3  # errors only
        self.sessions = {e["name"]: ort.InferenceSession(str(HERE / e["onnx"]), opts,
                                                         providers=["CPUExecutionProvider"]) for e in cfg["engines"]}

    def run(self, graph: str, feeds: dict) -> dict:
        s = self.sessions[graph]
        names = [o.name for o in s.get_outputs()]
        feeds = {k: self.ort.OrtValue.ortvalue_from_numpy(v) if isinstance(v, np.ndarray) else v
                 for k, v in feeds.items()}
        return dict(zip(names, s.run_with_ort_values(names, feeds)))

    @staticmethod
    def numpy(v) -> np.ndarray:
        return v.numpy()


class TensorRTRunner:
    """Inputs and outputs are torch CUDA tensors; the state stays on the GPU between steps."""

    def __init__(self, cfg: dict, builder: str):
        package = "tensorrt_rtx_bindings" if builder == "tensorrt-rtx" else "tensorrt"
        try:
            import torch
        except ImportError:
            sys.exit("validate.py: torch is not installed here; the engines' buffers are torch CUDA tensors: "
                     "pip install torch (a CUDA build), or check the ONNX graphs on CPU: "
                     "python validate.py --runtime onnxruntime")
        if not torch.cuda.is_available():
            sys.exit(f"validate.py: no CUDA GPU here, and the engines run on a {cfg['compute_capability']} GPU: run "
                     "this on that machine, or check the ONNX graphs on CPU: python validate.py --runtime onnxruntime")
        try:
            trt = __import__(package)
        except ImportError:
            wheels = "tensorrt_rtx_cu12_bindings tensorrt_rtx_cu12_libs" if builder == "tensorrt-rtx" else "tensorrt"
            sys.exit(f"validate.py: {package} is not installed here (pip install {wheels}), or check the ONNX graphs "
                     "on CPU: python validate.py --runtime onnxruntime")
        self.trt, self.torch, self.cfg = trt, torch, cfg
        self.dtypes = {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
                       trt.int64: torch.int64, trt.int32: torch.int32, trt.bool: torch.bool,
                       trt.fp8: torch.float8_e4m3fn}
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engines, self.contexts = {}, {}
        for e in cfg["engines"]:
            engine = runtime.deserialize_cuda_engine((HERE / e["engine"]).read_bytes())
            if engine is None:
                sys.exit(f"validate.py: cannot load {e['engine']} on this GPU (built for {cfg['compute_capability']} "
                         f"with another TensorRT version?)")
            self.engines[e["name"]], self.contexts[e["name"]] = engine, engine.create_execution_context()

    def _profile(self, graph: str, feeds: dict) -> int:
        spec = next(e for e in self.cfg["engines"] if e["name"] == graph)
        for i, prof in enumerate(spec["profiles"]):
            if all(all(lo <= d <= hi for lo, d, hi in zip(s["min"], feeds[n].shape, s["max"]))
                   for n, s in prof["shapes"].items()):
                return i
        sys.exit(f"validate.py: no {graph} profile holds the shapes {({n: a.shape for n, a in feeds.items()})}")

    def run(self, graph: str, feeds: dict) -> dict:
        trt, torch = self.trt, self.torch
        engine, ctx = self.engines[graph], self.contexts[graph]
        stream = torch.cuda.current_stream()
        ctx.set_optimization_profile_async(self._profile(graph, feeds), stream.cuda_stream)
        keep, outs = [], {}
        for name, a in feeds.items():
            t = torch.from_numpy(np.ascontiguousarray(a)).cuda() if isinstance(a, np.ndarray) else a.contiguous()
            keep.append(t)
            ctx.set_input_shape(name, tuple(a.shape))
            ctx.set_tensor_address(name, t.data_ptr())
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            if engine.get_tensor_mode(name) == trt.TensorIOMode.OUTPUT:
                dtype = self.dtypes[engine.get_tensor_dtype(name)]
                outs[name] = torch.empty(tuple(ctx.get_tensor_shape(name)), dtype=dtype, device="cuda")
                ctx.set_tensor_address(name, outs[name].data_ptr())
        if not ctx.execute_async_v3(stream.cuda_stream):
            sys.exit(f"validate.py: TensorRT failed to run {graph}")
        stream.synchronize()
        return outs

    @staticmethod
    def numpy(t) -> np.ndarray:
        return t.float().cpu().numpy()


def compare(where: str, got: dict, golden, prefix: str, names: list, tol: float) -> list[str]:
    problems = []
    for name in names:
        want, have = golden[f"{prefix}{name}"].astype(np.float64), got[name].astype(np.float64)  # numpy arrays
        if have.shape != want.shape:
            problems.append(f"{where} {name}: shape {have.shape}, golden {want.shape}")
            continue
        err, scale = np.abs(have - want).max(), max(np.abs(want).max(), 1e-30)
        status = "ok" if err <= tol * scale else "MISMATCH"
        print(f"{where:>10} {name:<12} max error {err:.3e} (tolerance {tol * scale:.3e})  {status}")
        if status != "ok":
            problems.append(f"{where} {name}: max error {err:.3e} above {tol * scale:.3e}")
    return problems


def main(argv=None) -> int:
    cfg = json.loads((HERE / "build.json").read_text())
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runtime", choices=["tensorrt", "onnxruntime"], default="tensorrt")
    ap.add_argument("--builder", choices=["tensorrt", "tensorrt-rtx"], default=cfg["builder"]["backend"])
    args = ap.parse_args(argv)
    v = cfg["validation"]
    if args.runtime == "onnxruntime" and cfg["precision"].startswith("nvfp4"):
        print(f"validate.py: onnxruntime cannot run {cfg['precision']} (FP4) graphs; validate the engines on the GPU",
              file=sys.stderr)
        return 2
    golden = np.load(HERE / v["golden"])
    runner = OnnxRuntimeRunner(cfg) if args.runtime == "onnxruntime" else TensorRTRunner(cfg, args.builder)
    names, tol = cfg["outputs"], v["tolerance"]
    out = runner.run("prefill", {"input_ids": golden["prefill.input_ids"]})
    got = {n: runner.numpy(out[n]) for n in names}
    problems = compare("prefill", got, golden, "prefill.", names, tol)
    agree = [np.mean(got["logits"].argmax(-1) == golden["prefill.logits"].argmax(-1))]
    for step in range(v["decode_steps"]):
        feeds = {"input_ids": golden[f"decode.{step}.input_ids"]}
        feeds.update({"past." + n[len("present."):]: a for n, a in out.items() if n.startswith("present.")})
        out = runner.run("decode", feeds)
        got = {n: runner.numpy(out[n]) for n in names}
        problems += compare(f"decode {step}", got, golden, f"decode.{step}.", names, tol)
        agree.append(np.mean(got["logits"].argmax(-1) == golden[f"decode.{step}.logits"].argmax(-1)))
    share = float(np.mean(agree))
    print(f"argmax agreement {share:.3f} (at least {v['argmax_agreement']})")
    if share < v["argmax_agreement"]:
        problems.append(f"argmax agreement {share:.3f} below {v['argmax_agreement']}")
    if problems:
        print("validate.py: FAILED\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    print("validate.py: all outputs agree with the golden ones")
    return 0


if __name__ == "__main__":
    sys.exit(main())
