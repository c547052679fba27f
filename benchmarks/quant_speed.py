"""NVFP4 quantisation of a 4096 x 4096 matrix: ours next to NVIDIA Model Optimizer's, in one run.

Run: python benchmarks/quant_speed.py [--size 4096] [--repeats 5]
Prints the median time of each and the ratio (goal: ours at least as fast), and checks the bytes agree.
"""
from __future__ import annotations

import argparse

import torch
from puzzlekit.passes.quant import quantize_nvfp4
from timing import median_seconds


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    w = (torch.randn(args.size, args.size, generator=torch.Generator().manual_seed(0))).to(getattr(torch, args.dtype))
    ours = median_seconds(lambda: quantize_nvfp4(w), args.repeats, warmup=1)
    theirs = median_seconds(lambda: NVFP4QTensor.quantize(w.clone(), 16), args.repeats, warmup=1)
    a, (b, sb, s2) = quantize_nvfp4(w), NVFP4QTensor.quantize(w.clone(), 16)
    same = (torch.equal(a.data, b._quantized_data) and torch.equal(a.block_scale.view(torch.uint8), sb.view(torch.uint8))
            and torch.equal(a.global_scale.reshape(()), s2.float().reshape(())))
    print(f"NVFP4 quantise {args.size}x{args.size} {args.dtype}, {torch.get_num_threads()} threads")
    print(f"  puzzlekit          {ours * 1e3:9.1f} ms")
    print(f"  Model Optimizer    {theirs * 1e3:9.1f} ms")
    print(f"  speed-up           {theirs / ours:9.2f}x   (identical values and scales: {same})")


if __name__ == "__main__":
    main()
