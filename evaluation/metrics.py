"""Evaluation metrics over windows of text: bits per byte, agreement with a teacher, MTP accuracy. The one definition of each: distillation's loss terms and evaluations, the library's scores,
every report and benchmark compute theirs here, so that their figures mean the same thing."""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import PuzzlekitError

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


# -- per position: the math every figure below is made of ----------------------------------------------------
def kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """KL(teacher || student) of the next-token distributions softened by `temperature`, nats per position
    (logits [..., vocab]; float32 whatever their dtype)."""
    t = F.log_softmax(teacher_logits.float() / temperature, -1)
    s = F.log_softmax(student_logits.float() / temperature, -1)
    return (t.exp() * (t - s)).sum(-1)


def topk_kl(values: torch.Tensor, indices: torch.Tensor, student_logits: torch.Tensor,
            temperature: float = 1.0) -> torch.Tensor:
    """`kl` from the teacher's stored top-k alone: `values` its full-vocabulary log-probabilities at `indices`
    [..., k]. The teacher's distribution is renormalised over its top k (softened by the temperature there:
    exact, as softmax(logits / T) restricted to those tokens), the student's is its full log_softmax gathered
    at the same indices:

        sum_i p_i (log p_i - log q_i),  p = softmax(values / T) over the k,  q = softmax(student / T) over all

    An approximation: the teacher's mass outside its top k is dropped (the value is still >= 0, and least when
    the student puts the teacher's top-k proportions on those tokens and nothing elsewhere); with k = the
    vocabulary it is `kl`."""
    t = F.log_softmax(values.float() / temperature, -1)
    s = F.log_softmax(student_logits.float() / temperature, -1).gather(-1, indices.long())
    return (t.exp() * (t - s)).sum(-1)


def agrees(teacher_top1: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Per position, whether the student's most likely next token is the teacher's (`teacher_top1`: its
    argmax, or the first of its stored top-k)."""
    return student_logits.argmax(-1) == teacher_top1.to(student_logits.device)


def nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of `targets` [...] under `logits` [..., vocab], nats per position (float32); over a byte
    vocabulary its mean / LN2 is bits per byte."""
    flat = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                           targets.reshape(-1).to(logits.device), reduction="none")
    return flat.view(targets.shape)


def _batches(windows: torch.Tensor, batch: int):
    for i in range(0, len(windows), batch):
        yield windows[i:i + batch]


def _checked(out, model, who: str):
    out = out if isinstance(out, tuple) else (out, None)
    for name, t in zip(("logits", "MTP logits"), out):
        if t is not None:
            check_finite(t, f"{name}{who}", model)
    return out


def checked_outputs(model, ids, who: str = ""):
    """(logits, MTP logits or None) of `model` on `ids`, refused when not finite (`who` names the model)."""
    return _checked(model(ids), model, who)


def _forward(model, windows: torch.Tensor, batch: int, who: str = ""):
    """(ids, logits, MTP logits or None) per batch of windows. A streamed model (backends.torch.stream)
    runs all the windows through one layer before reading the next."""
    if not hasattr(model, "outputs"):
        for ids in _batches(windows, batch):
            yield ids, *checked_outputs(model, ids, who)
        return
    for rows, out in model.outputs(windows, batch):
        vals = tuple(out.values())
        yield windows[rows], *_checked(vals if len(vals) > 1 else vals[0], model, who)


@torch.no_grad()
def text_metrics(model, windows: torch.Tensor, token_bytes=None, batch: int = 8) -> dict:
    """Next-token cross-entropy over every position of windows [n, T] of token ids: bits per byte (the summed NLL
    in bits over the UTF-8 bytes the scored tokens stand for, `token_bytes[id]`; None: one byte per token, the
    byte codec), NLL per token (nats) and perplexity. Bits per byte compares models across tokenizers. With an
    MTP head, from the same pass, its top-1 accuracy (`mtp_accuracy`'s figure)."""
    total, count, nbytes, mtp_hit, mtp_count = 0.0, 0, 0, 0, 0
    for ids, logits, mtp in _forward(model, windows, batch):
        total += nll(logits[:, :-1], ids[:, 1:]).sum().item()
        count += ids[:, 1:].numel()
        nbytes += count_bytes(ids[:, 1:], token_bytes)
        if mtp is not None:
            hit, n = _mtp_hits(ids, mtp)
            mtp_hit, mtp_count = mtp_hit + hit, mtp_count + n
    if nbytes == 0:
        raise PuzzlekitError("the scored tokens stand for no text (only special tokens): bits per byte is undefined")
    return {"bits_per_byte": total / nbytes / LN2, "nll_per_token": total / count,
            "perplexity": math.exp(min(total / count, 700.0)), "tokens": count, "bytes": nbytes,
            **({"mtp_top1_accuracy": mtp_hit / mtp_count} if mtp_count else {})}


def count_bytes(ids: torch.Tensor, token_bytes=None) -> int:
    """UTF-8 bytes the token ids stand for (`token_bytes` per id; None: one each)."""
    if token_bytes is None:
        return ids.numel()
    return int(np.asarray(token_bytes)[ids.reshape(-1).cpu().numpy()].sum())


def bits_per_byte(model, windows: torch.Tensor, batch: int = 8, token_bytes=None) -> float:
    """`text_metrics`' bits per byte."""
    return text_metrics(model, windows, token_bytes, batch)["bits_per_byte"]


def unigram_bits_per_byte(train: np.ndarray, windows: torch.Tensor, vocab: int = 256, token_bytes=None) -> float:
    """The baseline: token frequencies of the training text (add-one smoothed over the vocabulary), scored like
    bits_per_byte."""
    p = (np.bincount(train, minlength=vocab)[:vocab] + 1.0) / (len(train) + float(vocab))
    targets = windows[:, 1:].reshape(-1).numpy()
    return float(-np.log2(p[targets]).sum()) / count_bytes(windows[:, 1:], token_bytes)


@torch.no_grad()
def teacher_agreement(teacher, student, windows: torch.Tensor, batch: int = 8) -> dict:
    """KL(teacher || student) of the next-token distributions (nats per token) and top-1 agreement."""
    total, agree, count = 0.0, 0, 0
    for (ids, t, _), (_, s, _) in zip(_forward(teacher, windows, batch, " (teacher)"),
                                      _forward(student, windows, batch, " (student)")):
        total += kl(t, s).sum().item()
        agree += agrees(t.argmax(-1), s).sum().item()
        count += ids.numel()
    return {"kl": total / count, "top1_agreement": agree / count}


@torch.no_grad()
def mtp_accuracy(model, windows: torch.Tensor, batch: int = 8) -> float:
    """Top-1 accuracy of the MTP head: its logits at t predict byte t+1 from the trunk's state at t-1.

    Position 0 (which sees a zero trunk state) is left out.
    """
    hit, count = 0, 0
    for ids, _, mtp in _forward(model, windows, batch):
        if mtp is None:
            raise ValueError("the model has no MTP head")
        h, n = _mtp_hits(ids, mtp)
        hit, count = hit + h, count + n
    return hit / count


def _mtp_hits(ids: torch.Tensor, mtp: torch.Tensor) -> tuple[int, int]:
    """(positions whose MTP top-1 is the token after next, positions scored): position 0 left out."""
    return (mtp[:, 1:-1].argmax(-1).cpu() == ids[:, 2:]).sum().item(), ids[:, 2:].numel()
