"""Peak memory of streamed checkpoint quantisation: bounded by the largest tensor, not the checkpoint.

Run: python benchmarks/quant_stream.py [--layers 8] [--hidden 2048] [--ff 8192]
Writes a synthetic float32 checkpoint, then quantises it to NVFP4 (weight-only) in a fresh process
and prints that process's peak RSS above an import-only baseline, next to the checkpoint size.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

MB = 2**20


def peak_rss_of(code: str) -> float:
    """Max RSS (MiB) of a fresh Python process running `code` (it reports its own peak)."""
    report = "\nimport resource\nprint(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    out = subprocess.run([sys.executable, "-c", code + report], check=True, capture_output=True, text=True).stdout
    return int(out.split()[-1]) / 1024  # KiB on Linux


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ff", type=int, default=8192)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp())
    src, dst = work / "src", work / "dst"
    subprocess.run([sys.executable, "-c", f"""
import torch
from puzzlekit import ir
from puzzlekit.ir.ops import MLP, Embed, LMHead, Norm
from puzzlekit.backends.torch import random_weights
h = {args.hidden}
p = ir.assemble(Embed(256, h), [MLP(h, {args.ff}) for _ in range({args.layers})], Norm(h), LMHead(256, h),
                meta={{"dtype": "float32"}})
ir.save(random_weights(p), "{src}", max_shard_bytes=512 * 2**20)
"""], check=True)
    size = sum(f.stat().st_size for f in src.glob("*.safetensors")) / MB
    largest = args.hidden * args.ff * 4 / MB
    base = peak_rss_of("import torch, puzzlekit.passes.quant, puzzlekit.ir")
    peak = peak_rss_of(f"from puzzlekit.passes.quant import quantize_checkpoint\n"
                       f"quantize_checkpoint('{src}', '{dst}', 'nvfp4-weight')")
    print(f"checkpoint {size:,.0f} MiB float32 in {args.layers} layers; largest tensor {largest:,.0f} MiB")
    print(f"import-only baseline RSS   {base:8,.0f} MiB")
    print(f"quantisation peak RSS      {peak:8,.0f} MiB  (+{peak - base:,.0f} MiB over the baseline)")
    print(f"extra memory / checkpoint  {(peak - base) / size:8.2f}")
    print(f"extra memory / largest     {(peak - base) / largest:8.2f}")
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
