"""Where and in what precision the torch backend computes: `--device auto|cpu|cuda|cuda:N` and `--dtype
auto|float32|bfloat16|float16`.

Mixed precision as training code in this field does it: weights (the master copy) and optimizer state keep
their stored dtype, the forward runs under autocast in the compute dtype, and the losses, the Mamba SSM state
and its scan, and MoE routing stay in float32 (`ir.ops.base.full_precision`). float32 stays IEEE float32 on
CUDA unless a `Compute` asks for TF32 (`tf32=True`, distillation's training forward): nothing here sets
torch's process-wide TF32 flags, so importance and scoring are exact. Nothing here touches CUDA at import time.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import time
import warnings
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
    """A device, the dtype the forward computes in (float32: no autocast), the memory budget in bytes
    (`--max-memory`; 0: half of what is available, see puzzlekit.memory) and whether float32 matmuls and
    convolutions may use TF32 on CUDA (`tf32`: only forwards that trade exactness for speed ask for it)."""

    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    memory: int = 0
    tf32: bool = False

    @property
    def budget(self) -> int:
        return budget(self.memory)

    @contextlib.contextmanager
    def matmul_precision(self):
        """On CUDA, torch's TF32 flags (matmul and cuDNN) set to `tf32` inside, restored on exit: each forward
        gets the float32 precision its Compute asks for, whatever another one set. Nothing on CPU."""
        if self.device.type != "cuda":
            yield
            return
        flags = torch.backends.cuda.matmul, torch.backends.cudnn
        before = [f.allow_tf32 for f in flags]
        for f in flags:
            f.allow_tf32 = self.tf32
        try:
            yield
        finally:
            for f, b in zip(flags, before):
                f.allow_tf32 = b

    @contextlib.contextmanager
    def autocast(self):
        """The forward's precision: autocast to `dtype` (nothing at float32), within `matmul_precision`."""
        with self.matmul_precision():
            if self.dtype == torch.float32:
                yield
            else:
                with torch.autocast(self.device.type, dtype=self.dtype):
                    yield

    def grad_scaler(self, sharded: bool = False):
        """The loss scaler training in this precision needs: float16's gradients underflow without one
        (bfloat16 and float32 need none: None). A `torch.amp.GradScaler`, or for FSDP2's sharded gradients
        its `ShardedGradScaler`, which agrees on skipped steps over the ranks."""
        if self.dtype != torch.float16:
            return None
        enabled = self.device.type == "cuda"  # float16 computes on CUDA only (resolve refuses it on CPU)
        if sharded:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            return ShardedGradScaler(self.device.type, enabled=enabled)
        return torch.amp.GradScaler(self.device.type, enabled=enabled)

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
    20M parameters, at least 1 and at most `cpus()` (0: that choice). A small model's matmuls are too short to
    split: more threads only spin against each other, and against any other process on the machine (8-20x
    slower). More than `cpus()` is clamped, with a warning: torch's thread pool crashes far past them."""
    if requested < 0:
        raise DeviceError(f"--threads {requested}: give a positive number of threads (or 0 / leave it out: one "
                          "per 20M parameters)")
    if requested > cpus():
        warnings.warn(f"--threads {requested}: this process may use {cpus()} CPUs; using {cpus()} threads",
                      stacklevel=2)
        return cpus()
    if requested:
        return requested
    return max(1, min(cpus(), params // PARAMS_PER_THREAD))


def use_threads(params: int, requested: int = 0) -> int:
    """Sets torch's intra-op threads for this model (see threads_for); returns the number."""
    n = threads_for(params, requested)
    torch.set_num_threads(n)
    return n


def _local_rank() -> tuple[int, int]:
    """(LOCAL_RANK, WORLD_SIZE) of a torchrun process; (0, 1) outside torchrun."""
    return int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def resolve(device: str | None = "auto", dtype: str | None = "auto", max_memory: str | int | None = None) -> Compute:
    """`auto` picks CUDA when it is available (under torchrun, the rank's own `cuda:LOCAL_RANK`), and then
    bfloat16; on CPU float32. An explicit CUDA device on a machine without one is refused, and so is, under
    a torchrun of several processes, a `cuda:N` other than the rank's own (every rank would share GPU N).
    `max_memory` bounds the host memory of weights and activations (a size like `24GB`)."""
    memory = max_memory if isinstance(max_memory, int) else parse_size(max_memory) if max_memory else 0
    device, dtype = device or "auto", dtype or "auto"
    local, world = _local_rank()
    if device == "auto":
        device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
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
            dev = torch.device("cuda", local)
        elif world > 1 and dev.index != local:
            raise DeviceError(f"--device {device}: under torchrun with {world} processes every rank would compute "
                              f"on GPU {dev.index}; use --device cuda (or auto): each rank takes its own "
                              f"cuda:LOCAL_RANK (this one cuda:{local})")
        count = torch.cuda.device_count()
        if dev.index >= count:
            more = (f" (LOCAL_RANK {local}: torchrun starts more processes on this node than it has GPUs; "
                    f"--nproc-per-node {count} at most)") if world > 1 and dev.index == local else ""
            raise DeviceError(f"--device {device}: this machine has {count} CUDA device(s){more}")
    if dtype == "auto":
        dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    elif dtype in DTYPES:
        dt = DTYPES[dtype]
    else:
        raise DeviceError(f"--dtype {dtype!r}: use auto, {', '.join(DTYPES)}")
    if dt == torch.float16 and dev.type == "cpu":
        raise DeviceError("--dtype float16 computes on CUDA only; on CPU use bfloat16 or float32")
    return Compute(dev, dt, memory)

