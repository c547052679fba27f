"""Processes of one training run: joining torchrun's process group, deciding together whether a step's loss and
parameters are finite, waiting for the others."""
from __future__ import annotations

import datetime
import math
import os

import torch

from ..errors import UsageError


#: seconds a collective waits for the other ranks (`$PUZZLEKIT_DIST_TIMEOUT`): long, because one rank may work
#: alone for a while (rank 0 sweeping a large parent layer by layer before the layers are shared out)
DIST_TIMEOUT_ENV, DIST_TIMEOUT_S = "PUZZLEKIT_DIST_TIMEOUT", 4 * 3600


def dist_timeout() -> datetime.timedelta:
    """How long a collective waits: $PUZZLEKIT_DIST_TIMEOUT seconds, by default 4 hours (NCCL's own default,
    10 minutes, ends a run whose rank 0 alone sweeps a 120B parent)."""
    raw = os.environ.get(DIST_TIMEOUT_ENV, "").strip()
    if not raw:
        return datetime.timedelta(seconds=DIST_TIMEOUT_S)
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not (seconds > 0 and math.isfinite(seconds)):
        raise UsageError(f"${DIST_TIMEOUT_ENV}={raw!r}: give the seconds a collective may wait for the other "
                         f"ranks, a positive number (default {DIST_TIMEOUT_S})")
    return datetime.timedelta(seconds=seconds)


def distributed() -> tuple[int, int]:
    """(rank, world size); joins the torchrun process group when launched by torchrun: NCCL with each rank
    on its own GPU (cuda:LOCAL_RANK) and gloo for host tensors where CUDA is, gloo otherwise, with
    `dist_timeout()`."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():
        timeout = dist_timeout()
        if torch.cuda.is_available():
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            # gloo beside NCCL: FSDP's shards in host memory (offload) reduce their gradient norms on the host
            dist.init_process_group("cpu:gloo,cuda:nccl", device_id=torch.device("cuda", local), timeout=timeout)
        else:
            dist.init_process_group("gloo", timeout=timeout)
    return dist.get_rank(), world


def _finite_everywhere(loss: torch.Tensor) -> tuple[bool, bool]:
    """(this rank's loss is finite, every rank's is). Data-parallel ranks decide together, so that a loss
    that diverges on one rank stops all of them at the same step instead of leaving the others waiting in
    the next gradient all-reduce."""
    here = bool(torch.isfinite(loss))
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return here, here
    flag = torch.tensor([0.0 if here else 1.0], device=loss.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return here, flag.item() == 0.0


def _any_rank(flag: bool, device: torch.device | str = "cpu") -> bool:
    """Whether `flag` holds on any process (the flag itself without a process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item() > 0.0


def _local(t: torch.Tensor) -> torch.Tensor:
    """This process's part of a tensor (a DTensor's local shard; a plain tensor itself)."""
    return t.to_local() if hasattr(t, "to_local") else t


def nonfinite_parameters(model: torch.nn.Module) -> list[str]:
    """Names of the parameters holding NaN/inf. With sharded (FSDP) parameters every rank checks its shards
    and the ranks decide together: all of them see a non-empty list (the names found here, or a note) when
    any shard anywhere is bad, so they stop at the same step."""
    bad, device = [], "cpu"
    for n, p in model.named_parameters():
        local = _local(p)
        device = torch.device(p.device_mesh.device_type) if hasattr(p, "device_mesh") else local.device
        if not torch.isfinite(local).all():
            bad.append(n)
    if _any_rank(bool(bad), device) and not bad:
        bad = ["(a shard held by another rank)"]
    return bad


def barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
