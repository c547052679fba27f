"""The one training loop: AdamW with warmup and cosine decay, gradient clipping, non-finite checks, a
progress bar, and atomic checkpoints that make a killed run resume to the same result.

`train` (the default model), blockwise local distillation and global distillation all call `fit`; they
differ only in the model, the loss of a step, the callbacks and what they save afterwards.
"""
from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .errors import PuzzlekitError


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


def distributed() -> tuple[int, int]:
    """(rank, world size); joins the torchrun process group when launched by torchrun: NCCL with each rank
    on its own GPU (cuda:LOCAL_RANK) where CUDA is, gloo otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():
        if torch.cuda.is_available():
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        else:
            dist.init_process_group("gloo")
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


def barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def save_atomic(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def fit(model: torch.nn.Module, step_loss: Callable[[int], tuple[torch.Tensor, dict]], schedule: Schedule, *,
        rng: torch.Generator | None = None, state_file: Path | None = None, every: int = 50,
        identity: dict | None = None, desc: str = "train", progress: bool = False,
        max_seconds: float = 0.0, postfix: Callable[[dict], dict] | None = None, callbacks: list = (),
        write: bool = True) -> Fit:
    """Trains `model` for `schedule.steps` steps of `step_loss(step) -> (loss, parts)`.

    `schedule` is a `Schedule` or any object with `steps`, `clip`, `lr_at(step)` and `optimizer(model)`.
    With `state_file`, the model, optimiser, step, `rng` (the data sampler's generator) and the callbacks'
    state are saved atomically every `every` steps and at the end; a later call with the same `identity`
    (the settings that must not change) resumes from there, and ends where an uninterrupted run would.
    After each step every callback's `on_step(step, parts)` runs (e.g. an evaluation); one returning True
    stops the run. Data-parallel processes all read the state and pass `write` only on rank 0.
    """
    opt = schedule.optimizer(model)
    step = resumed_from = 0
    earlier, stopped = 0.0, False
    if state_file is not None and Path(state_file).exists():
        st = torch.load(state_file, weights_only=True, map_location=next(model.parameters()).device)
        if st.get("identity") != (identity or {}):
            raise TrainingError(f"{state_file} was written with other settings {st.get('identity')}; "
                                "use the same settings to resume, or a new output directory")
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optimizer"])
        if rng is not None:
            rng.set_state(st["rng"].cpu())
        for cb, cb_state in zip(callbacks, st.get("callbacks", [])):
            if cb_state is not None:
                cb.load_state_dict(cb_state)
        step = resumed_from = st["step"]
        earlier, stopped = st.get("seconds", 0.0), st.get("stopped", False)
    start, log = time.monotonic(), []
    model.train()
    bar = tqdm(total=schedule.steps, initial=step, desc=desc, disable=not (progress and write), leave=False)

    def save():
        bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
        if bad:  # nothing non-finite is ever saved
            raise TrainingError(f"{desc}: training diverged at step {step}: weights became NaN/inf "
                                f"({', '.join(bad[:3])}); lower the learning rate (--lr) and start again")
        if write:
            save_atomic({"step": step, "model": model.state_dict(), "optimizer": opt.state_dict(),
                         "rng": rng.get_state() if rng is not None else None, "identity": identity or {},
                         "callbacks": [cb.state_dict() if hasattr(cb, "state_dict") else None for cb in callbacks],
                         "seconds": earlier + time.monotonic() - start, "stopped": stopped}, Path(state_file))

    while step < schedule.steps and not stopped:  # a run a callback stopped stays stopped when resumed
        lr = schedule.lr_at(step)
        for g in opt.param_groups:
            g["lr"] = lr
        loss, parts = step_loss(step)
        here, everywhere = _finite_everywhere(loss)
        if not everywhere:
            where = f"the loss is {loss.item()}" if not here else "the loss is not finite on another rank"
            raise TrainingError(f"{desc}: training diverged at step {step + 1}: {where} at learning rate {lr:.3g}; "
                                "lower the learning rate (--lr) and start again")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if schedule.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), schedule.clip)
        opt.step()
        step += 1
        log.append({"step": step, "lr": lr, **parts})
        bar.update(1)
        bar.set_postfix(postfix(parts) if postfix else {k: f"{v:.4g}" for k, v in parts.items()})
        stopped = any([bool(cb.on_step(step, parts)) for cb in callbacks])  # every callback runs
        timed_out = max_seconds and time.monotonic() - start > max_seconds
        if state_file is not None and (step % every == 0 or step == schedule.steps or timed_out or stopped):
            save()
        if timed_out or stopped:
            break
    bar.close()
    model.eval()
    return Fit(step, resumed_from, earlier + time.monotonic() - start, step >= schedule.steps or stopped, log,
               stopped)
