"""The held-out evaluation of a distillation run: agreement with the live teacher or with its stored
top-k, by the `Evaluator` callback that keeps the best weights and calls the user's
`on_eval` callbacks; apart from the run because its state is checkpointed with it."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from ...evaluation import vocab
from ...training.checkpoints import load_tensors, save_tensors
from ...training.ranks import _local, _world
from ..core import PassError
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
    into the sharded checkpoint as such. They wait in host memory (`best` "host"), or in `state_dir`
    (`best` "disk": a `torch.distributed.checkpoint` directory per best, which the run's checkpoint names
    instead of holding the weights), never on the device."""

    def __init__(self, model, teacher, windows: torch.Tensor, every: int, metric: str, users: list,
                 stored: tuple[torch.Tensor, torch.Tensor] | None = None, mtp_weights: dict | None = None,
                 best: str = "host", state_dir: Path | None = None):
        self.model, self.teacher, self.windows, self.every, self.metric, self.users = \
            model, teacher, windows, every, metric, users
        self.stored = stored
        self.mtp_weights = mtp_weights or {}
        self.evals: list[dict] = []
        self.best: dict | None = None
        # the best weights: host copies of the state dict (best="host"), or a directory of the state dir
        # (best="disk": `best_file`, its name); never on the device
        if best == "disk" and state_dir is None:
            raise PassError("distill: best=disk keeps the best weights in the run's state directory; set state=DIR "
                            "(or best=host)")
        self.best_mode, self.state_dir = best, state_dir
        self.best_weights: dict | None = None
        self.best_file: str | None = None
        self._referenced: set[str] = set()  # best_file names the newest complete checkpoints may name

    @torch.no_grad()
    def measure(self) -> dict:
        """One forward of the student and one of the teacher per batch of windows, every figure from them (the
        MTP head's from position 1, as the losses)."""
        was = self.model.training
        self.model.eval()
        head = bool(self.model.program.find("mtp"))
        pair = head and self.teacher is not None and bool(self.teacher.program.find("mtp"))
        kl = agree = own = head_kl = 0.0
        for i in range(0, len(self.windows), 8):  # the logits a chunk of tokens at a time (evaluation.vocab)
            ids = self.windows[i:i + 8]
            last, mtp = vocab.heads(self.model, ids, " (student)")
            s = last.rows()
            if self.teacher is None:
                v, ix = (t[i:i + 8].to(s.states.device).flatten(0, -2) for t in self.stored)
                kl += vocab.topk_kl_sum(v, ix, s).item()
                agree += (vocab.argmax(s) == ix[:, 0]).sum().item()
            else:
                t_last, t_mtp = vocab.heads(self.teacher, ids, " (teacher)")
                got = vocab.scores(t_last.rows(), s)
                kl += got["kl"].sum().item()
                agree += got["agree"].sum().item()
            if head:  # against the trunk that verifies it
                own += vocab.kl_sum(last.rows(1), mtp.rows(1)).item()
            if pair:
                head_kl += vocab.kl_sum(t_mtp.rows(1), mtp.rows(1)).item()
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
            self._hold(self.model.state_dict())

    def _hold(self, weights: dict) -> None:
        """Keeps `weights` (the best) in host memory, or writes them into the state directory."""
        if self.best_mode == "disk":
            self.best_file, self.best_weights = f"best-step{self.best['step']}.dcp", None
            save_tensors(weights, self.state_dir / self.best_file)
        else:
            self.best_file, self.best_weights = None, {k: _host(v) for k, v in weights.items()}

    def restore_best(self) -> None:
        """Puts the kept best weights back into the model (in place: each process its shards)."""
        if self.best_file is not None:
            load_tensors(self.model.state_dict(), self.state_dir / self.best_file)
            return
        with torch.no_grad():
            for k, t in self.model.state_dict().items():
                _local(t).copy_(_local(self.best_weights[k]))

    def state_dict(self) -> dict:
        if self.best_mode == "disk":  # the checkpoint about to be written names best_file: older ones may go
            keep = self._referenced | {self.best_file}
            if _world()[0] == 0:
                for old in self.state_dir.glob("best-step*.dcp"):
                    if old.name not in keep:
                        shutil.rmtree(old, ignore_errors=True)
            self._referenced = {self.best_file}
        return {"evals": self.evals, "best": self.best, "best_weights": self.best_weights,
                "best_file": self.best_file,
                "users": [cb.state_dict() if hasattr(cb, "state_dict") else None for cb in self.users]}

    def load_state_dict(self, st: dict) -> None:
        """A checkpoint's state, whichever `best` wrote it (the best weights moved to where this run keeps
        them)."""
        self.evals, self.best = st["evals"], st["best"]
        saved, name = st.get("best_weights"), st.get("best_file")
        if name is not None and self.best_mode == "disk":
            self.best_file, self.best_weights, self._referenced = name, None, {name}
        elif name is not None:  # written with best=disk, resumed with best=host
            if self.state_dir is None or not (self.state_dir / name).exists():
                raise PassError(f"distill: the checkpoint keeps its best weights in {name} of its state directory, "
                                "which is not there; resume with the same state directory")
            self._hold(load_tensors({k: _host(v) for k, v in self.model.state_dict().items()}, self.state_dir / name))
        elif saved is not None:
            self._hold(saved)
        else:
            self.best_weights = self.best_file = None
        for cb, s in zip(self.users, st["users"]):
            if s is not None:
                cb.load_state_dict(s)


def _host(t: torch.Tensor) -> torch.Tensor:
    """A copy in host memory (a DTensor stays one: its shard copied)."""
    return t.detach().to("cpu", copy=True)
