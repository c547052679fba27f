"""`puzzlekit train`: trains the default hybrid architecture on text, resumably: byte-level, or in the
vocabulary of a tokenizer (which the model then carries).

The run directory holds `train_state.pt` (model, optimiser, data RNG, step; written atomically every
`checkpoint_every` steps), `model/` (the final checkpoint) and `metrics.json`. Re-running the same
command continues from the last saved step, and the result equals an uninterrupted run.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .. import evaluation as evaluate, ir
from ..backends.torch import checkpoint_state, materialize, random_weights
from ..backends.torch.device import CPU, Compute
from ..text.data import DataError, held_out_windows, load_corpus, random_windows, require_windows
from ..text.tokenizer import BYTES
from ..errors import PuzzlekitError
from ..training import Schedule, fit
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


def loss_fn(model, ids: torch.Tensor, mtp_weight: float) -> tuple[torch.Tensor, dict]:
    """Next-token cross-entropy of the trunk plus `mtp_weight` times the MTP head's (from position 1), in
    float32 whatever the forward's precision."""
    x, y = ids[:, :-1], ids[:, 1:].to(model.compute.device)
    logits, mtp = model(x)
    trunk, head = evaluate.nll(logits, y).mean(), evaluate.nll(mtp[:, 1:], y[:, 1:]).mean()
    return trunk + mtp_weight * head, {"loss": trunk.item(), "mtp_loss": head.item()}


def check_trainable(corpus, length: int) -> None:
    """Before any step: the training text and the selection set (the figures at the end) must stand for some
    text (text of special tokens alone has no bytes: bits per byte would be undefined) and hold a window."""
    import numpy as np

    require_windows(corpus, "selection", length, "train's validation figures")
    for what, stream in (("training text", corpus.train), ("selection set", corpus.held_out("selection"))):
        counts = np.bincount(stream, minlength=len(corpus.token_bytes))[:len(corpus.token_bytes)]
        if int(counts @ corpus.token_bytes) == 0:
            raise DataError(f"the {what} is special tokens alone ({len(stream):,} tokens that stand for no text, "
                            "e.g. <s> and </s> written out in the documents): there is nothing to learn or measure; "
                            "give --data with ordinary text")


def train(out: Path, cfg: TrainConfig, data: list[str] | None = None, progress: bool = True,
          compute: Compute = CPU, tokenizer=BYTES) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state_file = out / "train_state.pt"
    tokenizer = tokenizer or BYTES
    corpus = load_corpus(data, tokenizer=tokenizer)
    check_trainable(corpus, cfg.seq + 1)
    prog = random_weights(default_architecture(vocab=tokenizer.vocab_size), seed=cfg.seed)
    if tokenizer is not BYTES:
        prog.meta["tokenizer"] = str(tokenizer.directory.resolve())
    model = materialize(prog, compute=compute)
    gen = torch.Generator().manual_seed(cfg.seed)
    schedule = Schedule(cfg.steps, cfg.lr, cfg.warmup, cfg.min_lr_ratio, cfg.weight_decay)
    identity = {**cfg.identity(), "data": data or [],
                **({"tokenizer": tokenizer.identity} if tokenizer is not BYTES else {})}  # byte runs resume as before
    run = fit(model, lambda step: loss_fn(model, random_windows(corpus.train, cfg.batch, cfg.seq + 1, gen),
                                          cfg.mtp_weight),
              schedule, rng=gen, state_file=state_file, every=cfg.checkpoint_every,
              identity=identity, progress=progress, max_seconds=cfg.max_minutes * 60, scaler=compute.grad_scaler(),
              postfix=lambda p: {"bpb": f"{p['loss'] / evaluate.LN2:.3f}", "mtp": f"{p['mtp_loss'] / evaluate.LN2:.3f}"})
    step, resumed_from = run.step, run.resumed_from
    model.eval()
    for name, t in checkpoint_state(model).items():
        prog.weights.set(name, t.detach().clone().cpu())
    windows = held_out_windows(corpus, "selection", cfg.seq + 1, limit=cfg.eval_windows)
    text = evaluate.text_metrics(model, windows, corpus.token_bytes)
    metrics = {
        "step": step, "resumed_from": resumed_from, "finished": run.finished, "train_seconds": round(run.seconds, 1),
        "valid_bits_per_byte": text["bits_per_byte"], "valid_nll_per_token": text["nll_per_token"],
        "unigram_bits_per_byte": evaluate.unigram_bits_per_byte(corpus.train, windows, tokenizer.vocab_size,
                                                                corpus.token_bytes),
        "mtp_top1_accuracy": text["mtp_top1_accuracy"],  # from the same pass
        "valid_bytes": text["bytes"], "valid_tokens": text["tokens"], "config": asdict(cfg),
    }
    prog.meta["provenance"] = {"training": metrics}
    ir.save(prog, out / "model", overwrite=True)
    tmp = out / "metrics.json.tmp"
    tmp.write_text(json.dumps(metrics, indent=2) + "\n")
    os.replace(tmp, out / "metrics.json")
    return metrics
