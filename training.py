"""The one training loop: AdamW with warmup and cosine decay, gradient clipping, non-finite checks, a
progress bar, gradient accumulation, and atomic checkpoints that make a killed run resume to the same result.

`train` (the default model), blockwise local distillation and global distillation all call `fit`; they
differ only in the model, the loss of a step, the callbacks and what they save afterwards.

Checkpoints come in two formats: `FileCheckpoint` (one `torch.save` file, written by rank 0: the default, for
unsharded and DDP models) and `ShardedCheckpoint` (a `torch.distributed.checkpoint` directory every rank
writes its shards into, for FSDP; it reshards on load, so a run resumes on another number of processes).
"""
from __future__ import annotations

import contextlib
import datetime
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .errors import PuzzlekitError, UsageError
from .eta import Remaining
from .outputs import atomic_file


class TrainingError(PuzzlekitError):
    """Training cannot go on (diverged, or a checkpoint of other settings)."""


@dataclass
class Schedule:
    """AdamW (betas 0.9/0.95) with linear warmup then cosine decay to `min_lr_ratio * lr`."""

    steps: int
    lr: float
    warmup: int = 0
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        t = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))

    def optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """Weight decay on matrices only (not on norms, biases, embeddings)."""
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        decay = [p for n, p in named if p.dim() >= 2 and "embeddings" not in n]
        rest = [p for n, p in named if not (p.dim() >= 2 and "embeddings" not in n)]
        return torch.optim.AdamW([{"params": decay, "weight_decay": self.weight_decay},
                                  {"params": rest, "weight_decay": 0.0}], lr=self.lr, betas=(0.9, 0.95))


@dataclass
class Fit:
    step: int
    resumed_from: int
    seconds: float
    finished: bool  # all steps ran, or a callback stopped the run
    log: list = field(default_factory=list)  # {"step", "lr", loss parts...} per step of this segment
    stopped: bool = False  # a callback asked to stop


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
    on its own GPU (cuda:LOCAL_RANK) where CUDA is, gloo otherwise, with `dist_timeout()`."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():
        timeout = dist_timeout()
        if torch.cuda.is_available():
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            dist.init_process_group("nccl", device_id=torch.device("cuda", local), timeout=timeout)
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
        device = local.device
        if not torch.isfinite(local).all():
            bad.append(n)
    if _any_rank(bool(bad), device) and not bad:
        bad = ["(a shard held by another rank)"]
    return bad


def barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def save_atomic(obj, path: Path) -> None:
    with atomic_file(path) as tmp:
        torch.save(obj, tmp)


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class FileCheckpoint:
    """The run's state in one `torch.save` file, replaced atomically; only the process with `write` writes
    (every data-parallel process holds the same model), every process reads."""

    def __init__(self, path: Path, write: bool = True):
        self.path, self.write = Path(path), write

    def read(self, model: torch.nn.Module) -> dict | None:
        """The saved state (step, identity, rng, ...) or None when there is none yet."""
        if not self.path.exists():
            return None
        return torch.load(self.path, weights_only=True, map_location=next(model.parameters()).device)

    def restore(self, st: dict, model: torch.nn.Module, opt: torch.optim.Optimizer, callbacks) -> list:
        """Loads the model and optimizer from `st` (what `read` gave); returns the callbacks' states."""
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optimizer"])
        return st.get("callbacks", [])

    def save(self, model: torch.nn.Module, opt: torch.optim.Optimizer, meta: dict, callback_states: list) -> None:
        if self.write:
            save_atomic({"step": meta["step"], "model": model.state_dict(), "optimizer": opt.state_dict(),
                         "rng": meta["rng"], "identity": meta["identity"], "callbacks": callback_states,
                         "seconds": meta["seconds"], "stopped": meta["stopped"], "scaler": meta.get("scaler")},
                        self.path)


_TENSOR = "__checkpoint_tensor__"


def _split_tensors(obj, path=(), out=None):
    """(`obj` with every tensor replaced by a placeholder naming it, {name: tensor}): the tensors go to the
    sharded checkpoint (as DTensors where they are), the rest into its small side file."""
    out = {} if out is None else out
    if isinstance(obj, torch.Tensor):
        name = f"t{len(out)}"
        out[name] = obj
        return {_TENSOR: name, "path": list(path), "shape": list(obj.shape), "dtype": str(obj.dtype)}, out
    if isinstance(obj, dict):
        return {k: _split_tensors(v, (*path, k), out)[0] for k, v in obj.items()}, out
    if isinstance(obj, (list, tuple)):
        return type(obj)(_split_tensors(v, (*path, i), out)[0] for i, v in enumerate(obj)), out
    return obj, out


def _placeholders(obj):
    if isinstance(obj, dict):
        if _TENSOR in obj:
            yield obj
            return
        for v in obj.values():
            yield from _placeholders(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _placeholders(v)


def _at(obj, path):
    for k in path:
        try:
            obj = obj[k]
        except (KeyError, IndexError, TypeError):
            return None
    return obj


def _join_tensors(obj, tensors: dict):
    if isinstance(obj, dict):
        if _TENSOR in obj:
            return tensors[obj[_TENSOR]]
        return {k: _join_tensors(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_join_tensors(v, tensors) for v in obj)
    return obj


@contextlib.contextmanager
def _single_process_quiet():
    """Without a process group DCP saves and loads in this process alone, as meant here: no warning."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


class ShardedCheckpoint:
    """The run's state as a `torch.distributed.checkpoint` directory: every process writes its shards of the
    model, the optimizer and the callbacks' tensors (an FSDP run's best weights stay sharded), rank 0 a small
    side file with the rest (step, identity, rng, the callbacks' other state). Parameters and optimizer state
    are keyed by name, so a later run on another number of processes (1 included) loads and reshards them.

    Atomic: written into `<path>.tmp`, the side file last; then the complete previous checkpoint is moved to
    `<path>.old`, the new one into place, and the old one removed, so a kill at any point leaves a complete
    checkpoint (`<path>`, else `<path>.old`) to resume from.
    """

    META = "puzzlekit_state.pt"

    def __init__(self, path: Path):
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self.old = self.path.with_name(self.path.name + ".old")

    def exists(self) -> bool:
        return self._complete() is not None

    def _complete(self) -> Path | None:
        for d in (self.path, self.old):
            if (d / self.META).exists():
                return d
        return None

    def read(self, model: torch.nn.Module) -> dict | None:
        where = self._complete()
        if where is None:
            return None
        st = torch.load(where / self.META, weights_only=True)
        st["_dir"] = str(where)
        return st

    def restore(self, st: dict, model: torch.nn.Module, opt: torch.optim.Optimizer, callbacks) -> list:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        msd, osd = get_state_dict(model, opt)  # this run's layout (sharded or not) is what the load fills in
        skeleton = st.get("callbacks", [])
        templates = [cb.state_dict() if hasattr(cb, "state_dict") else None for cb in callbacks]
        tensors = {}
        for ph in _placeholders(skeleton):
            like = _at(templates, ph["path"])
            if isinstance(like, torch.Tensor) and list(like.shape) == ph["shape"] and str(like.dtype) == ph["dtype"]:
                tensors[ph[_TENSOR]] = like.detach().clone()  # its sharding; the load overwrites the values
            else:
                tensors[ph[_TENSOR]] = torch.empty(ph["shape"], dtype=getattr(torch, ph["dtype"].split(".")[-1]))
        state = {"model": msd, "optimizer": osd, "callbacks": tensors}
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=st["_dir"])
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        return _join_tensors(skeleton, state["callbacks"])

    def save(self, model: torch.nn.Module, opt: torch.optim.Optimizer, meta: dict, callback_states: list) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        rank, world = _world()
        msd, osd = get_state_dict(model, opt)
        skeleton, tensors = _split_tensors(list(callback_states))
        if rank == 0:
            shutil.rmtree(self.tmp, ignore_errors=True)  # a checkpoint a kill left half-written
            self.tmp.mkdir(parents=True)
        barrier(world)
        with _single_process_quiet():
            dcp.save({"model": msd, "optimizer": osd, "callbacks": tensors}, checkpoint_id=str(self.tmp))
        barrier(world)
        if rank == 0:
            save_atomic({**meta, "callbacks": skeleton}, self.tmp / self.META)  # last: marks it complete
            if self.path.exists():
                shutil.rmtree(self.old, ignore_errors=True)
                os.replace(self.path, self.old)
            os.replace(self.tmp, self.path)
            shutil.rmtree(self.old, ignore_errors=True)
        barrier(world)


def fit(model: torch.nn.Module, step_loss: Callable[..., tuple[torch.Tensor, dict]], schedule: Schedule, *,
        rng: torch.Generator | None = None, state_file: Path | None = None, every: int = 50,
        identity: dict | None = None, desc: str = "train", progress: bool = False,
        max_seconds: float = 0.0, postfix: Callable[[dict], dict] | None = None, callbacks: list = (),
        write: bool = True, micro: int = 1, no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
        checkpoint: FileCheckpoint | ShardedCheckpoint | None = None, zero_unused: bool = False,
        scaler=None) -> Fit:
    """Trains `model` for `schedule.steps` steps of `step_loss(step) -> (loss, parts)`.

    `schedule` is a `Schedule` or any object with `steps`, `clip`, `lr_at(step)` and `optimizer(model)`.
    With `state_file`, the model, optimiser, step, `rng` (the data sampler's generator) and the callbacks'
    state are saved atomically every `every` steps and at the end; a later call with the same `identity`
    (the settings that must not change) resumes from there, and ends where an uninterrupted run would.
    `checkpoint` (a `FileCheckpoint` or `ShardedCheckpoint`) replaces `state_file` with another format.
    After each step every callback's `on_step(step, parts)` runs (e.g. an evaluation); one returning True
    stops the run. Data-parallel processes all read the state and pass `write` only on rank 0.

    Gradient accumulation: with `micro` = n > 1 a step calls `step_loss(step, k)` for k in range(n), each
    micro-batch's forward and backward in turn, then takes one optimizer step; each call returns its share
    of the step's loss (the n losses, and each part, sum to the step's), so n micro-batches of one batch make
    the step one big batch would. `no_sync()` is the context the micro-batches before the last run in (DDP's
    `no_sync`: gradients are all-reduced once, after the last). `zero_unused` gives every trainable parameter
    that got no gradient (a routed expert no token chose) a zero one before the step, as FSDP's
    reduce-scatter of unused parameters does, so a 1-process run steps like a sharded one.

    `scaler` (`Compute.grad_scaler()`: float16) scales each loss before its backward and unscales the
    gradients before clipping; a step whose gradients overflowed is skipped and the scale lowered. Its state
    is checkpointed.
    """
    opt = schedule.optimizer(model)
    step = resumed_from = 0
    earlier, stopped = 0.0, False
    ck = checkpoint or (FileCheckpoint(state_file, write) if state_file is not None else None)
    st = ck.read(model) if ck is not None else None
    if st is not None:
        if st.get("identity") != (identity or {}):
            raise TrainingError(f"{ck.path} was written with other settings {st.get('identity')}; "
                                "use the same settings to resume, or a new output directory")
        cb_states = ck.restore(st, model, opt, callbacks)
        if rng is not None:
            rng.set_state(st["rng"].cpu())
        for cb, cb_state in zip(callbacks, cb_states):
            if cb_state is not None:
                cb.load_state_dict(cb_state)
        if scaler is not None and st.get("scaler"):
            scaler.load_state_dict(st["scaler"])
        step = resumed_from = st["step"]
        earlier, stopped = st.get("seconds", 0.0), st.get("stopped", False)
    start, log = time.monotonic(), []
    model.train()
    bar = tqdm(total=schedule.steps, initial=step, desc=desc, disable=not (progress and write), leave=False)
    left = Remaining(desc, schedule.steps - step, unit="step", enabled=progress and write)

    def save():
        bad = nonfinite_parameters(model)
        if bad:  # nothing non-finite is ever saved
            raise TrainingError(f"{desc}: training diverged at step {step}: weights became NaN/inf "
                                f"({', '.join(bad[:3])}); lower the learning rate (--lr) and start again")
        ck.save(model, opt, {"step": step, "rng": rng.get_state() if rng is not None else None,
                             "identity": identity or {}, "seconds": earlier + time.monotonic() - start,
                             "stopped": stopped, "scaler": scaler.state_dict() if scaler is not None else None},
                [cb.state_dict() if hasattr(cb, "state_dict") else None for cb in callbacks])

    def backward(loss):
        (scaler.scale(loss) if scaler is not None else loss).backward()

    while step < schedule.steps and not stopped:  # a run a callback stopped stays stopped when resumed
        lr = schedule.lr_at(step)
        for g in opt.param_groups:
            g["lr"] = lr
        if micro == 1:
            loss, parts = step_loss(step)
            here, everywhere = _finite_everywhere(loss)
            if everywhere:
                opt.zero_grad(set_to_none=True)
                backward(loss)
        else:
            opt.zero_grad(set_to_none=True)
            loss, parts = None, {}
            for k in range(micro):
                with no_sync() if no_sync is not None and k < micro - 1 else contextlib.nullcontext():
                    part, got = step_loss(step, k)
                    backward(part)  # a NaN here makes NaN gradients, and the check below stops before the step
                loss = part.detach() if loss is None else loss + part.detach()
                for n, v in got.items():
                    parts[n] = parts.get(n, 0.0) + v
            here, everywhere = _finite_everywhere(loss)
        if not everywhere:
            where = f"the loss is {loss.item()}" if not here else "the loss is not finite on another rank"
            raise TrainingError(f"{desc}: training diverged at step {step + 1}: {where} at learning rate {lr:.3g}; "
                                "lower the learning rate (--lr) and start again")
        if zero_unused:
            for p in model.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
        if scaler is not None:
            scaler.unscale_(opt)  # clip the true gradients
        if schedule.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), schedule.clip)
        if scaler is not None:
            scaler.step(opt)  # skipped when a gradient overflowed
            scaler.update()
        else:
            opt.step()
        step += 1
        log.append({"step": step, "lr": lr, **parts})
        bar.update(1)
        left.done()
        bar.set_postfix(postfix(parts) if postfix else {k: f"{v:.4g}" for k, v in parts.items()})
        stopped = any([bool(cb.on_step(step, parts)) for cb in callbacks])  # every callback runs
        timed_out = max_seconds and time.monotonic() - start > max_seconds
        if ck is not None and (step % every == 0 or step == schedule.steps or timed_out or stopped):
            save()
        if timed_out or stopped:
            break
    bar.close()
    model.eval()
    return Fit(step, resumed_from, earlier + time.monotonic() - start, step >= schedule.steps or stopped, log,
               stopped)
