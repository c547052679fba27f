"""The per-position math every figure is made of: KL between next-token distributions (whole, or from a
teacher's stored top-k), cross-entropy, top-1 agreement, and the refusal of non-finite values. The one
definition of each (`metrics` over windows and `vocab` over token chunks are built from these)."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import PuzzlekitError


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
