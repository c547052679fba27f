"""The held-out evaluation of a distillation run: agreement with the live teacher or with its stored
top-k, by the `Evaluator` callback that keeps the best weights and calls the user's
`on_eval` callbacks; apart from the run because its state is checkpointed with it."""
from __future__ import annotations

import torch

from ...evaluation import metrics
from .sharding import _reshard


class Evaluator:
    """Every `every` steps: held-out KL and top-1 agreement with the teacher (and the MTP head's KL to the
    teacher's head, `mtp_kl`, and to its own trunk, `mtp_self_kl`); keeps the best weights (least `metric`)
    and calls the user's `on_eval` callbacks. Its state is checkpointed with the run, so a resumed run keeps
    the same best.

    `metric` "mtp_loss" is the head-only run's own loss on these windows: the sum of `mtp_weights`
    (metric name -> weight) times those metrics, so that a run that moves only the head is judged on the head.

    `teacher` None: the teacher's stored top-k on the windows (`stored`: values, indices) stand in for it.
    Under FSDP the best weights are the sharded state dict's clones (each process keeps its shards) and go
    into the sharded checkpoint as such."""

    def __init__(self, model, teacher, windows: torch.Tensor, every: int, metric: str, users: list,
                 stored: tuple[torch.Tensor, torch.Tensor] | None = None, mtp_weights: dict | None = None):
        self.model, self.teacher, self.windows, self.every, self.metric, self.users = \
            model, teacher, windows, every, metric, users
        self.stored = stored
        self.mtp_weights = mtp_weights or {}
        self.evals: list[dict] = []
        self.best: dict | None = None
        self.best_weights: dict | None = None

    @torch.no_grad()
    def measure(self) -> dict:
        """One forward of the student and one of the teacher per batch of windows, every figure from them (the
        MTP head's from position 1, as the losses)."""
        was = self.model.training
        self.model.eval()
        head = bool(self.model.program.find("mtp"))
        pair = head and self.teacher is not None and bool(self.teacher.program.find("mtp"))
        kl = agree = own = head_kl = 0.0
        for i in range(0, len(self.windows), 8):
            ids = self.windows[i:i + 8]
            logits, mtp = metrics.checked_outputs(self.model, ids, " (student)")
            if self.teacher is None:
                v, ix = (t[i:i + 8].to(logits.device) for t in self.stored)
                kl += metrics.topk_kl(v, ix, logits).sum().item()
                agree += metrics.agrees(ix[..., 0], logits).sum().item()
            else:
                t_logits, t_mtp = metrics.checked_outputs(self.teacher, ids, " (teacher)")
                kl += metrics.kl(t_logits, logits).sum().item()
                agree += metrics.agrees(t_logits.argmax(-1), logits).sum().item()
            if head:
                own += metrics.kl(logits[:, 1:], mtp[:, 1:]).sum().item()  # against the trunk that verifies it
            if pair:
                head_kl += metrics.kl(t_mtp[:, 1:], mtp[:, 1:]).sum().item()
        count, shifted = self.windows.numel(), self.windows[:, 1:].numel()
        m = {"kl": kl / count, "top1_agreement": agree / count}
        if head:
            m["mtp_self_kl"] = own / shifted
        if pair:
            m["mtp_kl"] = head_kl / shifted
        if self.metric == "mtp_loss":
            m["mtp_loss"] = sum(w * m[k] for k, w in self.mtp_weights.items())
        self.model.train(was)
        _reshard(self.model, self.teacher)
        return m

    def on_step(self, step: int, parts: dict) -> bool:
        stop = False
        for cb in self.users:
            if hasattr(cb, "on_step"):
                stop |= bool(cb.on_step(step, parts))
        if step % self.every:
            return stop
        m = {"step": step, **self.measure()}
        self.evals.append(m)
        self.keep(m)
        for cb in self.users:
            if hasattr(cb, "on_eval"):
                stop |= bool(cb.on_eval(step, m))
        return stop

    def keep(self, m: dict) -> None:
        """Remembers the current weights when `m` is the best evaluation so far (sharded: this process's
        shards)."""
        if self.best is None or m[self.metric] < self.best[self.metric]:
            self.best = m
            self.best_weights = {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def state_dict(self) -> dict:
        return {"evals": self.evals, "best": self.best, "best_weights": self.best_weights,
                "users": [cb.state_dict() if hasattr(cb, "state_dict") else None for cb in self.users]}

    def load_state_dict(self, st: dict) -> None:
        self.evals, self.best, self.best_weights = st["evals"], st["best"], st["best_weights"]
        for cb, s in zip(self.users, st["users"]):
            if s is not None:
                cb.load_state_dict(s)
