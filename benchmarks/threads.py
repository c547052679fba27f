"""CPU threads against the work size: `generate` and a small library build of the built-in model, idle and
next to one competing CPU-bound process, with torch's default threads (one per core: `--threads` = the
CPUs) and with puzzlekit's choice (one per 20M parameters: 1 for the built-in model).

Run: python benchmarks/threads.py [--repeats 2]
Each figure is the median wall time of `repeats` fresh processes.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from puzzlekit.backends.torch.device import cpus

GRID = '[mamba2]\nheads = [4]\n[moe]\nexperts = [4]\n[attention]\nq_heads = [2]\n[mlp]\nd_ff = [0.5]\n'
COMPETITOR = "import torch\nwhile True:\n    torch.randn(512, 512) @ torch.randn(512, 512)\n"


def seconds(cmd: list[str], repeats: int, fresh: Path) -> float:
    times = []
    for _ in range(repeats):
        shutil.rmtree(fresh, ignore_errors=True)  # a library build would otherwise resume a finished one
        start = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="puzzlekit-threads-"))
    (work / "grid.toml").write_text(GRID)
    cli = [sys.executable, "-m", "puzzlekit.tools"]
    jobs = {
        "generate 64 tokens": [*cli, "generate", "--prompt", "def main():", "--max-new-tokens", "64"],
        "library (small grid)": [*cli, "library", "-o", str(work / "lib"), "--grid", str(work / "grid.toml"),
                                 "--calib-windows", "8", "--score-windows", "2", "--seq", "64", "--bld-tokens", "2048",
                                 "--json"],
    }
    rows = []
    for load in ("idle", "one competing process"):
        rival = subprocess.Popen([sys.executable, "-c", COMPETITOR]) if load != "idle" else None
        try:
            for job, cmd in jobs.items():
                got = {}
                for name, threads in (("default", str(cpus())), ("chosen", "0")):
                    got[name] = seconds([*cmd, "--threads", threads], args.repeats, work / "lib")
                rows.append((job, load, got["default"], got["chosen"]))
        finally:
            if rival:
                rival.kill()
    shutil.rmtree(work, ignore_errors=True)
    print(f"CPUs this process may use: {cpus()}; 'default' runs --threads {cpus()}, 'chosen' puzzlekit's choice")
    print(f"{'job':<22} {'load':<22} {'default s':>10} {'chosen s':>10} {'speed-up':>9}")
    for job, load, a, b in rows:
        print(f"{job:<22} {load:<22} {a:>10.1f} {b:>10.1f} {a / b:>8.1f}x")


if __name__ == "__main__":
    main()
