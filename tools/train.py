"""`puzzlekit train`: trains the default hybrid architecture on byte-level text, resumably.

The run directory holds `train_state.pt` (model, optimiser, data RNG, step; written atomically every
`checkpoint_every` steps), `model/` (the final checkpoint) and `metrics.json`. Re-running the same
command continues from the last saved step, and the result equals an uninterrupted run.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .. import evaluate, ir
from ..backends.torch import materialize, random_weights
from ..data import load_corpus, random_windows, sequential_windows
from ..errors import PuzzlekitError
from .default_model import default_architecture


@dataclass
class TrainConfig:
    steps: int = 1200
    batch: int = 16
    seq: int = 256
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    mtp_weight: float = 0.3
    seed: int = 0
    checkpoint_every: int = 50
    eval_windows: int = 128
    max_minutes: float = 0.0  # stop early (and save) after this long; 0 = no limit

    def __post_init__(self):
        """Refuses settings that cannot train, for the Python API too (the CLI's flags are checked by argparse)."""
        least = {"steps": 1, "batch": 1, "seq": 2, "warmup": 0, "checkpoint_every": 1, "eval_windows": 1}
        bad = [f"{k}={getattr(self, k)} (needs an integer >= {lo})" for k, lo in least.items()
               if not isinstance(getattr(self, k), int) or getattr(self, k) < lo]
        bad += [f"{k}={getattr(self, k)} (needs a finite number >= 0)" for k in
                ("lr", "min_lr_ratio", "weight_decay", "mtp_weight", "max_minutes")
                if not math.isfinite(getattr(self, k)) or getattr(self, k) < 0]
        if self.lr == 0:
            bad.append("lr=0 (needs a number > 0)")
        if bad:
            raise PuzzlekitError(f"bad training settings: {', '.join(bad)}")

    def identity(self) -> dict:
        """The settings a resumed run must share (evaluation size and time limit may change)."""
        return {k: v for k, v in asdict(self).items() if k not in ("eval_windows", "max_minutes")}

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        t = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def loss_fn(model, ids: torch.Tensor, mtp_weight: float) -> tuple[torch.Tensor, dict]:
    """Next-byte cross-entropy of the trunk plus `mtp_weight` times the MTP head's (from position 1)."""
    x, y = ids[:, :-1], ids[:, 1:]
    logits, mtp = model(x)
    trunk = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    head = F.cross_entropy(mtp[:, 1:].reshape(-1, mtp.shape[-1]), y[:, 1:].reshape(-1))
    return trunk + mtp_weight * head, {"loss": trunk.item(), "mtp_loss": head.item()}


def _optimizer(model, cfg: TrainConfig):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embeddings" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embeddings" not in n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(0.9, 0.95))


def _save_state(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def _diverged(step: int, what: str, cfg: TrainConfig) -> PuzzlekitError:
    """Training stops at the first non-finite loss or weight, so nothing NaN is saved."""
    return PuzzlekitError(f"training diverged at step {step}: {what} at learning rate {cfg.lr_at(step - 1):.3g} "
                          f"(--lr {cfg.lr:g}); lower --lr and start again in a new output directory")


def train(out: Path, cfg: TrainConfig, data: list[str] | None = None, progress: bool = True) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state_file = out / "train_state.pt"
    corpus = load_corpus(data)
    prog = random_weights(default_architecture(), seed=cfg.seed)
    model = materialize(prog).train()
    opt = _optimizer(model, cfg)
    gen = torch.Generator().manual_seed(cfg.seed)
    step = resumed_from = 0
    earlier = 0.0  # seconds spent by earlier segments of this run
    if state_file.exists():
        st = torch.load(state_file, weights_only=True)
        if st["config"] != cfg.identity() or st.get("data") != (data or []):
            raise PuzzlekitError(f"{state_file} was written with other settings {st['config']} "
                                 f"(data {st.get('data') or 'the Python stdlib'}); "
                                 "use the same settings to resume or a new output directory")
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optimizer"])
        gen.set_state(st["generator"])
        step = resumed_from = st["step"]
        earlier = st.get("seconds", 0.0)
    start, log = time.monotonic(), []
    bar = tqdm(total=cfg.steps, initial=step, desc="train", disable=not progress)
    while step < cfg.steps:
        for g in opt.param_groups:
            g["lr"] = cfg.lr_at(step)
        loss, parts = loss_fn(model, random_windows(corpus.train, cfg.batch, cfg.seq + 1, gen), cfg.mtp_weight)
        if not all(math.isfinite(v) for v in parts.values()):
            raise _diverged(step + 1, f"the loss is {parts['loss']} (MTP {parts['mtp_loss']})", cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        bar.update(1)
        bar.set_postfix(bpb=f"{parts['loss'] / evaluate.LN2:.3f}", mtp=f"{parts['mtp_loss'] / evaluate.LN2:.3f}")
        log.append({"step": step, **parts})
        timed_out = cfg.max_minutes and time.monotonic() - start > cfg.max_minutes * 60
        if step % cfg.checkpoint_every == 0 or step == cfg.steps or timed_out:
            if bad := [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]:
                raise _diverged(step, f"weights became NaN/inf ({', '.join(bad[:3])})", cfg)
            _save_state(state_file, {"step": step, "model": model.state_dict(), "optimizer": opt.state_dict(),
                                     "generator": gen.get_state(), "config": cfg.identity(), "data": data or [],
                                     "seconds": earlier + time.monotonic() - start})
        if timed_out:
            break
    bar.close()
    model.eval()
    for name, t in model.state_dict().items():
        prog.weights.set(name, t.detach().clone())
    windows = sequential_windows(corpus.valid, cfg.seq + 1, limit=cfg.eval_windows)
    metrics = {
        "step": step, "resumed_from": resumed_from, "finished": step >= cfg.steps, "train_seconds": round(earlier + time.monotonic() - start, 1),
        "valid_bits_per_byte": evaluate.bits_per_byte(model, windows),
        "unigram_bits_per_byte": evaluate.unigram_bits_per_byte(corpus.train, windows),
        "mtp_top1_accuracy": evaluate.mtp_accuracy(model, windows),
        "valid_bytes": int(windows[:, 1:].numel()), "config": asdict(cfg),
    }
    prog.meta["provenance"] = {"training": metrics}
    ir.save(prog, out / "model", overwrite=True)
    tmp = out / "metrics.json.tmp"
    tmp.write_text(json.dumps(metrics, indent=2) + "\n")
    os.replace(tmp, out / "metrics.json")
    return metrics
