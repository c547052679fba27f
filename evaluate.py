"""Evaluation metrics: bits per byte, agreement with a teacher, MTP accuracy, speculative acceptance length."""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from .errors import PuzzlekitError

LN2 = math.log(2.0)


class NonFiniteError(PuzzlekitError):
    """A model produced NaN or inf: a metric computed from it would be meaningless."""


def check_finite(values, what: str, model=None):
    """Returns `values` (a tensor or array) when all finite; otherwise raises NonFiniteError naming the
    likely cause: `model`'s non-finite parameters when it has some, else an overflowing activation."""
    finite = torch.isfinite(values).all() if isinstance(values, torch.Tensor) else np.isfinite(values).all()
    if finite:
        return values
    if not hasattr(model, "named_parameters"):
        cause = "its weights may hold NaN/inf"
    elif bad := [n for n, p in model.named_parameters() if p.is_floating_point() and not torch.isfinite(p).all()]:
        cause = f"its weights hold NaN/inf ({', '.join(bad[:3])}{f' and {len(bad) - 3} more' if len(bad) > 3 else ''})"
    else:
        cause = "its parameters are finite, so an activation overflowed (or a quantized weight is NaN/inf)"
    raise NonFiniteError(f"the model produced NaN/inf {what}: {cause}; check a checkpoint with "
                         "`puzzlekit inspect --check-finite`")


def _batches(windows: torch.Tensor, batch: int):
    for i in range(0, len(windows), batch):
        yield windows[i:i + batch]


def _checked(out, model, who: str):
    out = out if isinstance(out, tuple) else (out, None)
    for name, t in zip(("logits", "MTP logits"), out):
        if t is not None:
            check_finite(t, f"{name}{who}", model)
    return out


def _outputs(model, ids, who: str = ""):
    return _checked(model(ids), model, who)


def _forward(model, windows: torch.Tensor, batch: int, who: str = ""):
    """(ids, logits, MTP logits or None) per batch of windows. A streamed model (backends.torch.stream)
    runs all the windows through one layer before reading the next."""
    if not hasattr(model, "outputs"):
        for ids in _batches(windows, batch):
            yield ids, *_outputs(model, ids, who)
        return
    for rows, out in model.outputs(windows, batch):
        vals = tuple(out.values())
        yield windows[rows], *_checked(vals if len(vals) > 1 else vals[0], model, who)


@torch.no_grad()
def bits_per_byte(model, windows: torch.Tensor, batch: int = 8) -> float:
    """Mean next-byte cross-entropy in bits over every position of byte-level windows [n, T]."""
    total, count = 0.0, 0
    for ids, logits, _ in _forward(model, windows, batch):
        logits = logits[:, :-1]
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1).to(logits.device),
                                 reduction="sum").item()
        count += ids[:, 1:].numel()
    return total / count / LN2


def unigram_bits_per_byte(train: np.ndarray, windows: torch.Tensor) -> float:
    """The baseline: byte frequencies of the training text (add-one smoothed), scored like bits_per_byte."""
    p = (np.bincount(train, minlength=256) + 1.0) / (len(train) + 256.0)
    targets = windows[:, 1:].reshape(-1).numpy()
    return float(-np.log2(p[targets]).mean())


@torch.no_grad()
def teacher_agreement(teacher, student, windows: torch.Tensor, batch: int = 8) -> dict:
    """KL(teacher || student) of the next-token distributions (nats per token) and top-1 agreement."""
    kl, agree, count = 0.0, 0, 0
    for (ids, t, _), (_, s, _) in zip(_forward(teacher, windows, batch, " (teacher)"),
                                      _forward(student, windows, batch, " (student)")):
        t, s = F.log_softmax(t.float(), -1), F.log_softmax(s.float(), -1)
        kl += (t.exp() * (t - s)).sum().item()
        agree += (t.argmax(-1) == s.argmax(-1)).sum().item()
        count += ids.numel()
    return {"kl": kl / count, "top1_agreement": agree / count}


@torch.no_grad()
def mtp_accuracy(model, windows: torch.Tensor, batch: int = 8) -> float:
    """Top-1 accuracy of the MTP head: its logits at t predict byte t+1 from the trunk's state at t-1.

    Position 0 (which sees a zero trunk state) is left out.
    """
    hit, count = 0, 0
    for ids, _, mtp in _forward(model, windows, batch):
        if mtp is None:
            raise ValueError("the model has no MTP head")
        hit += (mtp[:, 1:-1].argmax(-1).cpu() == ids[:, 2:]).sum().item()
        count += ids[:, 2:].numel()
    return hit / count


# -- self-speculative decoding -------------------------------------------------------------------------------
Drafter = Callable[[torch.Tensor, int, int], list[int]]


def mtp_drafter(model) -> Drafter:
    """Drafts with the model's MTP head: the head's own pre-norm output stands in for the trunk state of a
    drafted token, so one head drafts k tokens in a row."""
    node = next(n for n in model.program.nodes if n.op.kind == "mtp")
    head = model.get_submodule(node.path)
    trunk_value = node.args[0]

    @torch.no_grad()
    def draft(seq: torch.Tensor, bonus: int, k: int) -> list[int]:
        h = model.values(seq[None], trunk_value)  # [1, n, hidden], on the model's device
        ids = torch.cat([seq, torch.tensor([bonus])])[None].to(h.device)
        out = []
        for _ in range(k):  # position j reads the state of j-1: h is one shorter than ids, pad its end
            with model.compute.autocast():
                logits, z = head.with_hidden(torch.cat([h, h[:, -1:]], dim=1), ids)
            tok = int(logits[0, -1].argmax())
            out.append(tok)
            h = torch.cat([h, z[:, -1:]], dim=1)
            ids = torch.cat([ids, torch.tensor([[tok]], device=ids.device)], dim=1)
        return out

    return draft


@torch.no_grad()
def acceptance_length(model, prompts: torch.Tensor, k: int, new_tokens: int, drafter: Drafter | None = None) -> float:
    """Mean tokens produced per trunk verification step of greedy self-speculative decoding.

    Each step takes the trunk's next token, drafts k more, and keeps the drafts up to the first that
    differs from the trunk's own greedy choice: a perfect drafter gives k + 1, a useless one 1.
    """
    drafter = drafter or mtp_drafter(model)
    lengths = []
    for prompt in prompts:
        seq = prompt.clone()
        bonus = int(_outputs(model, seq[None])[0][0, -1].argmax())
        produced = 0
        while produced < new_tokens:
            drafts = drafter(seq, bonus, k)
            cand = torch.cat([seq, torch.tensor([bonus] + drafts)])
            greedy = _outputs(model, cand[None])[0][0, len(seq):].argmax(-1).tolist()  # after bonus, d1, ..., dk
            accepted = 0
            while accepted < k and drafts[accepted] == greedy[accepted]:
                accepted += 1
            lengths.append(accepted + 1)
            seq = cand[: len(seq) + 1 + accepted]
            bonus = greedy[accepted]
            produced += accepted + 1
    return float(np.mean(lengths))
