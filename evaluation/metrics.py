"""Evaluation metrics over windows of text: bits per byte, agreement with a teacher, MTP accuracy. The one definition of each: distillation's loss terms and evaluations, the library's scores,
every report and benchmark compute theirs here, so that their figures mean the same thing."""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import PuzzlekitError
from . import vocab
from .positions import NonFiniteError, agrees, check_finite, kl, nll, topk_kl  # noqa: F401  (the metrics' own math)

LN2 = math.log(2.0)


def _batches(windows: torch.Tensor, batch: int):
    for i in range(0, len(windows), batch):
        yield windows[i:i + batch]


def _checked(out, model, who: str):
    """(logits, MTP logits or None) of a model's outputs, refused when not finite (`who` names the model)."""
    out = out if isinstance(out, tuple) else (out, None)
    for name, t in zip(("logits", "MTP logits"), out):
        if t is not None:
            check_finite(t, f"{name}{who}", model)
    return out


def _forward(model, windows: torch.Tensor, batch: int, who: str = ""):
    """(ids, final `vocab.Hidden`, the MTP head's or None) per batch of windows: the figures build the logits
    from them a chunk of tokens at a time. A streamed model (backends.torch.stream) runs all the windows through
    one layer before reading the next."""
    if not hasattr(model, "outputs"):
        for ids in _batches(windows, batch):
            yield ids, *vocab.heads(model, ids, who)
        return
    logits = getattr(model, "project", False)  # a recording of the logits themselves (stream.Recorded)
    weight = None if logits else model.head_weight()
    for rows, out in model.outputs(windows, batch, project=logits):
        yield windows[rows], *vocab.hidden_of(model, list(out.values()), weight, who)


@torch.no_grad()
def text_metrics(model, windows: torch.Tensor, token_bytes=None, batch: int = 8) -> dict:
    """Next-token cross-entropy over every position of windows [n, T] of token ids: bits per byte (the summed NLL
    in bits over the UTF-8 bytes the scored tokens stand for, `token_bytes[id]`; None: one byte per token, the
    byte codec), NLL per token (nats) and perplexity. Bits per byte compares models across tokenizers. With an
    MTP head, from the same pass, its top-1 accuracy (`mtp_accuracy`'s figure)."""
    total, count, nbytes, mtp_hit, mtp_count = 0.0, 0, 0, 0, 0
    for ids, last, mtp in _forward(model, windows, batch):
        targets = ids[:, 1:].reshape(-1).to(last.states.device)
        total += vocab.nll_sum(last.rows(0, -1), targets).item()
        count += targets.numel()
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
        got = vocab.scores(t.rows(), s.rows())
        total += got["kl"].sum().item()
        agree += got["agree"].sum().item()
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


def _mtp_hits(ids: torch.Tensor, mtp) -> tuple[int, int]:
    """(positions whose MTP top-1 is the token after next, positions scored): position 0 left out."""
    return (vocab.argmax(mtp.rows(1, -1)).cpu() == ids[:, 2:].reshape(-1)).sum().item(), ids[:, 2:].numel()
