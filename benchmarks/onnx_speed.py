"""The ONNX export of the default model (cold: this process's first, into a fresh directory), then onnxruntime
against torch eager on it: decode and prefill tokens/s, side by side.

Run: python benchmarks/onnx_speed.py [--export-only] [--batch 1] [--prompt 128] [--steps 64]
The export time is what the first `puzzlekit generate --backend onnx` waits for (later runs reuse the cached
graphs); it is printed in wall and CPU seconds (the CPU figure moves less on a shared machine).
Goal: ORT decode at least 1.5x torch eager. Both keep the state between steps (ORT in its own
buffers via IO binding); the report says what dominates when the goal is missed.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from puzzlekit.backends.onnx import OnnxModel, export_onnx
from puzzlekit.backends.torch import materialize
from puzzlekit.tools.default_model import load_default


def timed(fn, repeats=3):
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@torch.no_grad()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--export-only", action="store_true", help="time the export and stop")
    args = ap.parse_args()
    prog = load_default()
    m = materialize(prog)
    with tempfile.TemporaryDirectory() as d:
        wall, cpu = time.perf_counter(), time.process_time()
        export_onnx(prog, Path(d) / "onnx")
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        print(f"ONNX export of the default model (cold, fresh directory): {wall:.1f} s wall, {cpu:.1f} s CPU, "
              f"{torch.get_num_threads()} threads")
        if args.export_only:
            return
        om = OnnxModel(Path(d) / "onnx")
        ids = torch.randint(0, 256, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0))
        tok = ids[:, -1]

        def torch_decode():
            _, st = m.prefill(ids)
            for _ in range(args.steps):
                _, st = m.decode(tok, st)

        def ort_decode():
            _, st = om.prefill(ids.numpy())
            for _ in range(args.steps):
                _, st = om.decode(tok.numpy(), st)

        t_pre = timed(lambda: m.prefill(ids))
        o_pre = timed(lambda: om.prefill(ids.numpy()))
        t_dec = (timed(torch_decode) - t_pre) / args.steps
        o_dec = (timed(ort_decode) - o_pre) / args.steps
    n = args.batch
    print(f"default model, batch {n}, prompt {args.prompt}, {args.steps} decode steps, {torch.get_num_threads()} threads")
    print(f"{'':10}{'torch eager':>14}{'onnxruntime':>14}{'ratio':>8}")
    print(f"{'decode':10}{n / t_dec:10.0f} t/s{n / o_dec:10.0f} t/s{t_dec / o_dec:8.2f}")
    print(f"{'prefill':10}{n * args.prompt / t_pre:10.0f} t/s{n * args.prompt / o_pre:10.0f} t/s{t_pre / o_pre:8.2f}")
    print(f"(prefill {t_pre * 1e3:.1f} ms vs {o_pre * 1e3:.1f} ms; decode step {t_dec * 1e3:.2f} ms vs {o_dec * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
