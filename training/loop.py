"""The one training loop: AdamW with warmup and cosine decay, gradient clipping, non-finite checks, a
progress bar, gradient accumulation, and atomic checkpoints that make a killed run resume to the same result.

`train` (the default model), blockwise local distillation and global distillation all call `fit`; they
differ only in the model, the loss of a step, the callbacks and what they save afterwards.
"""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..errors import PuzzlekitError
from ..eta import Remaining, bars
from .checkpoints import FileCheckpoint, ShardedCheckpoint
from .optimizers import build
from .ranks import _finite_everywhere, nonfinite_parameters


class TrainingError(PuzzlekitError):
    """Training cannot go on (diverged, or a checkpoint of other settings)."""


@dataclass
class Schedule:
    """AdamW (betas 0.9/0.95) with linear warmup then cosine decay to `min_lr_ratio * lr`. `algorithm` is the
    AdamW's state (training.optimizers): "adamw" (float32 moments, torch's), "adamw-bf16" (bfloat16 moments,
    bfloat16 parameters rounded stochastically, by `seed`) or "adamw-8bit" (torchao's 8-bit moments)."""

    steps: int
    lr: float
    warmup: int = 0
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0
    algorithm: str = "adamw"
    seed: int = 0

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
        return build(self.algorithm, [{"params": decay, "weight_decay": self.weight_decay},
                                      {"params": rest, "weight_decay": 0.0}], lr=self.lr, seed=self.seed)


@dataclass
class Fit:
    step: int
    resumed_from: int
    seconds: float
    finished: bool  # all steps ran, or a callback stopped the run
    log: list = field(default_factory=list)  # {"step", "lr", loss parts...} per step of this segment
    stopped: bool = False  # a callback asked to stop


def fit(model: torch.nn.Module, step_loss: Callable[..., tuple[torch.Tensor, dict]], schedule: Schedule, *,
        rng: torch.Generator | None = None, state_file: Path | None = None, every: int = 50,
        identity: dict | None = None, desc: str = "train", progress: bool | str = False,
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
    stops the run. Data-parallel processes all read the state and pass `write` only on rank 0. `progress`
    (with `write`): a bar on a terminal, lines on stderr in a log (eta.Remaining).

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
    bar = tqdm(total=schedule.steps, initial=step, desc=desc, disable=not (write and bars(progress)), leave=False)
    left = Remaining(desc, schedule.steps - step, unit="step", progress=progress if write else False)

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
            if isinstance(g["lr"], torch.Tensor):  # (torchao's optimizers hold it as a tensor)
                g["lr"].fill_(lr)
            else:
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
