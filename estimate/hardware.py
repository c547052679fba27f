"""The hardware an estimate is for: `--hardware h100:8`, `b200:16`, `cpu` (or, left out, what this process sees),
as processes with their memory and their rates.

A GPU's memory and datasheet peaks are the cost model's own (backends/targets.py); a training or inference step
reaches `GPU_EFFICIENCY` of the dense bf16 peak and of the memory bandwidth (stated in every estimate). On the CPU
the rates are measured on this machine: each distinct block is run (forward, or forward and backward) at the
stage's own batch and sequence with random weights of its shapes, and other blocks of its kind (the library's
variants) take its time per unit of work; a block too large to run here is priced at the measured rate of a
float32 matrix product.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
import time
from dataclasses import dataclass

from ..errors import UsageError

#: the share of a GPU's dense bf16 peak, and of its memory bandwidth, a step of this kind reaches: training
#: frameworks report 0.3-0.5 model FLOP utilisation for models of this kind; stated with every GPU estimate
GPU_EFFICIENCY = 0.4
#: a CUDA context, cuBLAS workspaces and the allocator's slack, per process
GPU_RESERVED = int(1.5e9)
#: bytes a second a checkpoint's layers are read at where they cannot be timed (a local NVMe disk)
READ_RATE = 2e9
#: blocks with more parameters than this are not run on the CPU to time them (their matrix products are)
TIMED_PARAMS = 64_000_000
#: the most tokens a block is timed over (rows x seq): longer work is priced from that timing by its FLOPs
TIMED_TOKENS = 8192


#: a DGX node's host memory per GPU (8 GPUs: DGX H100 and H200 2 TB, DGX B200 4 TB): what offloaded state, kept best
#: weights and tapes may take
HOST_PER_GPU = {"h100": 2e12 / 8, "h200": 2e12 / 8, "b200": 4e12 / 8}


@dataclass(frozen=True)
class Hardware:
    """What the stages run on: `processes` processes (torchrun ranks), each with `memory_bytes` (a GPU's, or on
    the CPU the host memory available to each) and, on GPUs, `target` for the rates."""

    name: str
    kind: str  # "gpu" or "cpu"
    processes: int
    memory_bytes: int
    target: object = None  # backends.targets.Target on GPUs

    @property
    def host_bytes(self) -> int:
        """Host memory one process may hold: on GPUs its share of a DGX node's (`HOST_PER_GPU`: a node of another
        GPU as an H100's), on the CPU the memory it has."""
        if self.kind != "gpu":
            return self.memory_bytes
        return int(HOST_PER_GPU.get(str(self.target.name).lower(), HOST_PER_GPU["h100"]))

    @property
    def compute_bytes(self) -> int:
        """Bytes of the forward's precision: bf16 autocast on GPUs, float32 on the CPU (the commands' default)."""
        return 2 if self.kind == "gpu" else 4

    def describe(self) -> dict:
        out = {"name": self.name, "kind": self.kind, "processes": self.processes, "memory_bytes": self.memory_bytes}
        if self.kind == "gpu":
            out |= {"bf16_flops": self.target.peak_flops["bf16"], "bandwidth": self.target.bandwidth,
                    "efficiency": GPU_EFFICIENCY, "reserved_bytes": GPU_RESERVED}
        else:
            out["rates"] = "measured on this machine"
        return out


def parse_hardware(text: str | None, device: str = "auto") -> Hardware:
    """`NAME[:COUNT]` (h100, h200, b200, a target file's GPU, or cpu; COUNT processes, one per GPU), or with no
    text the visible GPUs (under torchrun, WORLD_SIZE processes) or this CPU."""
    if not text:
        return _visible(device)
    m = re.fullmatch(r"\s*([^:]+?)\s*(?::\s*(\d+))?\s*", text)
    if not m or (m.group(2) is not None and int(m.group(2)) < 1):
        raise UsageError(f"--hardware {text!r}: write it as NAME:COUNT, e.g. h100:8, b200:16 or cpu")
    name, count = m.group(1), int(m.group(2) or 1)
    if name.lower() == "cpu":
        return _cpu(count)
    from ..backends.targets import TARGETS, get_target
    from ..errors import PuzzlekitError

    try:
        target = get_target(name.lower() if name.lower() in TARGETS else name)  # a built-in name, or a target file
    except PuzzlekitError:
        gpus = sorted(n for n, t in TARGETS.items() if t.kind == "gpu" and t.devices == 1)
        raise UsageError(f"--hardware {text!r}: unknown GPU {name!r}; known: {', '.join(gpus)} (or a target file), "
                         "or cpu") from None
    if target.kind != "gpu":
        return _cpu(count)
    if target.devices > 1:  # a node ("8xb200", or a target file with `devices`): its GPUs are the processes
        prefix = f"{target.devices}x"
        gpu = target.name[len(prefix):] if target.name.startswith(prefix) else f"GPU of {target.name}"
        count, target = count * target.devices, dataclasses.replace(target, name=gpu, devices=1)
    return Hardware(f"{count} x {target.name}", "gpu", count, int(target.memory_bytes), target)


def _cpu(processes: int) -> Hardware:
    """This machine: the memory available now, shared by the processes (`--max-memory` is what the streamed stages
    keep within, not what the machine has)."""
    from ..memory import available

    return Hardware("cpu" if processes == 1 else f"cpu x {processes} processes", "cpu", processes,
                    available() // processes)


def _visible(device: str) -> Hardware:
    """The GPUs this process sees (one per torchrun rank), or the CPU."""
    import torch

    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if device == "cpu" or not torch.cuda.is_available():
        return _cpu(world)
    from ..backends.targets import TARGETS

    props = torch.cuda.get_device_properties(0)
    name = props.name.lower()
    known = next((t for n, t in TARGETS.items() if t.kind == "gpu" and t.devices == 1 and n in name), None)
    if known is None:  # its memory as it reports it, an H100's rates (said in its name)
        known, name = dataclasses.replace(TARGETS["h100"], name=name), f"{name} (rates: an H100's)"
    return Hardware(f"{world} x {name}", "gpu", world, int(props.total_memory), known)


class Rates:
    """Seconds of one process's work: `forward(op, rows, seq)` and `train(op, rows, seq)` (forward and backward)
    of a block or of the LM head, and `elements(n)`, an elementwise pass over n weights (quantising)."""

    def __init__(self, hw: Hardware):
        self.hw = hw
        self._per_flop: dict = {}
        self._gemm: float | None = None
        self._read: float | None = None

    def forward(self, op, rows: int, seq: int) -> float:
        return self._seconds(op, rows, seq, False)

    def train(self, op, rows: int, seq: int) -> float:
        return self._seconds(op, rows, seq, True)

    def elements(self, n: float) -> float:
        """Reading, scaling and writing n weights once (memory-bound)."""
        bw = self.hw.target.bandwidth * GPU_EFFICIENCY if self.hw.kind == "gpu" else self._cpu_bandwidth()
        return 12 * n / bw

    def _seconds(self, op, rows: int, seq: int, train: bool) -> float:
        flops = _flops(op, rows, seq) * (3 if train else 1)
        if self.hw.kind == "gpu":
            t = self.hw.target
            weights = op.param_count() * 2 * (3 if train else 1)
            return max(flops / (t.peak_flops["bf16"] * GPU_EFFICIENCY), weights / (t.bandwidth * GPU_EFFICIENCY))
        if op.param_count() > TIMED_PARAMS or op.kind not in _TIMED:
            return flops / self._gemm_rate()
        # the first block of a kind at a shape is timed, at most TIMED_TOKENS of it (a longer one scales by work: the
        # timing answers in seconds, and in memory); others scale by work
        r, q = max(1, min(rows, TIMED_TOKENS // seq)), min(seq, TIMED_TOKENS)
        key = (op.kind, r, q, train)
        if key not in self._per_flop:
            self._per_flop[key] = _time_block(op, r, q, train) / max(_flops(op, r, q) * (3 if train else 1), 1.0)
        return flops * self._per_flop[key]

    def read_rate(self, prog) -> float:
        """Bytes a second a layer is read from the checkpoint into float32 tensors: on the CPU one read of the
        program's largest block when it has weights (into fresh memory, as a stream reads), else `READ_RATE`."""
        if self._read is None:
            self._read = READ_RATE
            if self.hw.kind == "cpu" and not prog.is_meta:
                node = max(prog.blocks(), key=lambda n: n.op.param_count())
                start = time.perf_counter()
                nbytes = sum(t.float().nbytes for t in prog.node_weights(node).values())
                self._read = nbytes / (time.perf_counter() - start)
        return self._read

    def _gemm_rate(self) -> float:
        if self._gemm is None:
            import torch

            a, b = torch.randn(512, 1024), torch.randn(1024, 1024)
            self._gemm = 2 * 512 * 1024 * 1024 / _least_seconds(lambda: a @ b, 5)
        return self._gemm

    def _cpu_bandwidth(self) -> float:
        import torch

        t = torch.randn(4_000_000)
        return 8 * t.numel() / _least_seconds(lambda: t.mul(2.0), 5)


_TIMED = {"mamba2", "moe", "attention", "mlp", "linear", "noop"}


@functools.lru_cache(maxsize=4096)
def _flops(op, rows: int, seq: int) -> float:
    """A forward's FLOPs as the cost model counts them (once per op and shape: an MoE's count walks its experts)."""
    if op.kind == "lm_head":
        return 2 * rows * seq * op.hidden * op.vocab
    w = op.work(rows, seq, 0, False, 2, 4, 2)
    return w.flops


def _least_seconds(run, repeats: int) -> float:
    """The least of `repeats` timed runs after an untimed one: the work's own time, whatever else the machine
    does."""
    run()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best


def _time_block(op, rows: int, seq: int, train: bool) -> float:
    """One block at (rows, seq) with random weights of its shapes, as the stages run it (float32 on the CPU)."""
    import torch

    g = torch.Generator().manual_seed(0)
    m = op.build()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    x = torch.randn(rows, seq, op.hidden, generator=g)
    if train:
        x.requires_grad_(True)

        def run():
            m(x)[0].square().mean().backward()
        return _least_seconds(run, 2)
    with torch.no_grad():
        return _least_seconds(lambda: m(x), 2)


class Untimed:
    """Rates for the check before a run: memory decides, so no block is timed."""

    def __init__(self, hw):
        self.hw = hw

    def forward(self, op, rows, seq) -> float:
        return 0.0

    train = forward

    def elements(self, n) -> float:
        return 0.0

    def read_rate(self, prog) -> float:
        return float("inf")
