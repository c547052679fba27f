"""Where and in what precision the torch backend computes: `--device auto|cpu|cuda|cuda:N` and `--dtype
auto|float32|bfloat16|float16`.

Mixed precision as training code in this field does it: weights (the master copy) and optimizer state keep
their stored dtype, the forward runs under autocast in the compute dtype, and the losses, the Mamba SSM state
and its scan, and MoE routing stay in float32 (`ir.ops.base.full_precision`). Nothing here touches CUDA at import time.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import time
from dataclasses import dataclass

import torch

from ...errors import UsageError
from ...memory import budget, parse_size

DEVICES = "auto, cpu, cuda or cuda:N"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class DeviceError(UsageError):
    """The device or dtype asked for does not exist here."""


@dataclass(frozen=True)
class Compute:
    """A device, the dtype the forward computes in (float32: no autocast) and the memory budget in bytes
    (`--max-memory`; 0: half of what is available, see puzzlekit.memory)."""

    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    memory: int = 0

    @property
    def budget(self) -> int:
        return budget(self.memory)

    def autocast(self):
        """The forward's precision: autocast to `dtype`, or nothing at float32."""
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def synchronize(self) -> None:
        """Waits for the device's queued work (timing on a GPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def time(self, fn, timer=time.perf_counter) -> float:
        """Seconds of one call of `fn`: wall time (by `timer`) on the CPU; on CUDA the device's own time between
        two events recorded around it, after the queued work. The one way puzzlekit times work."""
        if self.device.type != "cuda":
            t0 = timer()
            fn()
            return timer() - t0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def __str__(self) -> str:
        return f"{self.device}/{str(self.dtype).removeprefix('torch.')}"


CPU = Compute()


def median_seconds(fn, compute: Compute = CPU, repeats: int = 15, warmup: int = 3) -> float:
    """The median of `repeats` timed calls (`Compute.time`) after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    return statistics.median(compute.time(fn) for _ in range(repeats))

#: parameters per intra-op thread: below it a thread spends more time waiting for the others than computing
PARAMS_PER_THREAD = 20_000_000


def cpus() -> int:
    """The CPUs this process may run on (its affinity mask: taskset, cgroups' cpusets), not the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_for(params: int, requested: int = 0) -> int:
    """Intra-op threads for a model of `params` parameters: `requested` (--threads) when given, else one per
    20M parameters, at least 1 and at most `cpus()`. A small model's matmuls are too short to split: more
    threads only spin against each other, and against any other process on the machine (8-20x slower)."""
    if requested < 0:
        raise DeviceError(f"--threads {requested}: give a positive number of threads (or leave it out)")
    if requested:
        return requested
    return max(1, min(cpus(), params // PARAMS_PER_THREAD))


def use_threads(params: int, requested: int = 0) -> int:
    """Sets torch's intra-op threads for this model (see threads_for); returns the number."""
    n = threads_for(params, requested)
    torch.set_num_threads(n)
    return n


def resolve(device: str | None = "auto", dtype: str | None = "auto", max_memory: str | int | None = None) -> Compute:
    """`auto` picks CUDA when it is available (under torchrun, the rank's own `cuda:LOCAL_RANK`), and then
    bfloat16; on CPU float32. An explicit CUDA device on a machine without one is refused. `max_memory`
    bounds the host memory of weights and activations (a size like `24GB`)."""
    memory = max_memory if isinstance(max_memory, int) else parse_size(max_memory) if max_memory else 0
    device, dtype = device or "auto", dtype or "auto"
    if device == "auto":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise DeviceError(f"--device {device!r} is not a device; use {DEVICES}") from None
    if dev.type not in ("cpu", "cuda"):
        raise DeviceError(f"--device {device!r}: puzzlekit computes on {DEVICES}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"--device {device}: CUDA is not available here (torch {torch.__version__}, "
                              f"CUDA build: {torch.version.cuda or 'no'}); use --device cpu or auto")
        if dev.index is None:
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        if dev.index >= torch.cuda.device_count():
            raise DeviceError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        torch.backends.cuda.matmul.allow_tf32 = True  # float32 matmuls (the losses' inputs) on tensor cores
        torch.backends.cudnn.allow_tf32 = True
    if dtype == "auto":
        dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    elif dtype in DTYPES:
        dt = DTYPES[dtype]
    else:
        raise DeviceError(f"--dtype {dtype!r}: use auto, {', '.join(DTYPES)}")
    if dt == torch.float16 and dev.type == "cpu":
        raise DeviceError("--dtype float16 computes on CUDA only; on CPU use bfloat16 or float32")
    return Compute(dev, dt, memory)

