"""Figures over the vocabulary without its logits whole: every loss and score that needs next-token
distributions (distillation's KL, CE and MTP terms, the held-out evaluation, the library's replace-one-block
scores) builds them from the final hidden states and the LM head's matrix, a chunk of tokens at a time.

At a 131,072-token vocabulary one float32 logits tensor is 0.5 MB a token: 8 rows of 4,096 tokens are 17 GB,
and a distillation held several (student, teacher, their log-softmax, the gradient; the MTP head's again).
Here at most one chunk's are alive: without grad each chunk is scored and dropped; with grad each chunk's
term is checkpointed (`torch.utils.checkpoint`, non-reentrant), so the forward keeps only the chunk's hidden
rows and the backward rebuilds its logits, the teacher's without grad, one chunk at a time. The sums are the
full computation's, in another order (float32: ~1e-7 relative)."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .positions import check_finite, kl, nll, topk_kl

#: float32 logits bytes of one chunk (at Super's vocabulary, 512 tokens: large enough for an efficient matmul)
CHUNK_BYTES = 256 << 20


@dataclass
class Hidden:
    """A model's hidden states [..., hidden] and the [vocab, hidden] matrix that projects them onto the
    vocabulary; `autocast` the context the model's own projection runs in (its compute precision). `head`: the
    LM head module itself, where it does more than the product (a quantised input); `weight` None: the states
    are the logits already (a model that gives only those)."""

    states: torch.Tensor
    weight: torch.Tensor | None
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    head: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def vocab(self) -> int:
        return self.states.shape[-1] if self.weight is None else self.weight.shape[0]

    def rows(self, start: int = 0, stop: int | None = None) -> Hidden:
        """The same at positions `start`..`stop` of each sequence, flattened to [positions, hidden]."""
        s = self.states[..., start:stop, :] if start or stop is not None else self.states
        return Hidden(s.reshape(-1, s.shape[-1]), self.weight, self.autocast, self.head)

    def detach(self) -> Hidden:
        w = None if self.weight is None else self.weight.detach()
        return Hidden(self.states.detach(), w, self.autocast, self.head)

    def logits(self, rows: slice = slice(None)) -> torch.Tensor:
        """float32 logits of `rows` of the flattened states (all of them: the whole tensor, for what needs it)."""
        x = self.states.reshape(-1, self.states.shape[-1])[rows]
        if self.weight is None:
            return x.float()
        with self.autocast():
            return (self.head(x) if self.head is not None else F.linear(x, self.weight)).float()


def chunks(positions: int, vocab: int) -> Iterator[slice]:
    """Slices of `positions` whose float32 logits take at most `CHUNK_BYTES` (at least one position each)."""
    step = max(1, CHUNK_BYTES // (4 * vocab))
    for i in range(0, positions, step):
        yield slice(i, min(i + step, positions))


def summed(term: Callable[[slice], torch.Tensor], positions: int, vocab: int) -> torch.Tensor:
    """sum over chunks of `term(rows)` (a scalar over those rows). With grad enabled each chunk is
    checkpointed: its logits are rebuilt in the backward instead of kept."""
    total = None
    for rows in chunks(positions, vocab):
        part = checkpoint(term, rows, use_reentrant=False) if torch.is_grad_enabled() else term(rows)
        total = part if total is None else total + part
    return total


def argmax(h: Hidden) -> torch.Tensor:
    """The most likely next token at each of the flattened rows, without grad."""
    with torch.no_grad():
        return torch.cat([h.logits(rows).argmax(-1) for rows in chunks(len(h.states), h.vocab)])


def heads(model, ids: torch.Tensor, who: str = "") -> tuple[Hidden, Hidden | None]:
    """A model's final hidden states and its MTP head's (None without one) on `ids`, with its LM head's matrix
    and precision, refused when not finite (`who` names the model). A model that gives only logits (not a
    ProgramModule) gives those, as they are."""
    if not hasattr(model, "head_weight"):
        out = model(ids)
        out = out if isinstance(out, tuple) else (out, None)
        return tuple(None if t is None else Hidden(check_finite(t, f"logits{who}", model), None) for t in out)
    *states, weight = model(ids, project=False)
    return hidden_of(model, states, weight, who)


def hidden_of(model, states, weight: torch.Tensor | None, who: str = "") -> tuple[Hidden, Hidden | None]:
    """(final, MTP head's or None) `Hidden` of a model's unprojected outputs (`weight` None: its logits), refused
    when not finite."""
    head = projection(model) if weight is not None else None
    for name, h in zip(("logits", "MTP logits"), states):  # (checked where they come from: the hidden states)
        check_finite(h, f"{name}{who}", model)
    out = [Hidden(h, weight, model.compute.autocast, head) for h in states]
    return out[0], out[1] if len(out) > 1 else None


def projection(model):
    """The LM head module where its product is not all it does (a quantised input's hook), else None."""
    head = getattr(model, "head_module", lambda: None)()
    return head if head is not None and head._forward_pre_hooks else None


# -- the figures: each from flattened Hidden rows (`Hidden.rows`) -----------------------------------------------
def kl_sum(teacher: Hidden, student: Hidden, temperature: float = 1.0) -> torch.Tensor:
    """Summed KL(teacher || student) (`positions.kl`) over the positions of both flattened rows; the teacher's
    logits without grad."""
    def term(rows):
        with torch.no_grad():
            t = teacher.logits(rows)
        return kl(t, student.logits(rows), temperature).sum()
    return summed(term, len(student.states), student.vocab)


def topk_kl_sum(values: torch.Tensor, indices: torch.Tensor, student: Hidden, temperature: float = 1.0):
    """Summed `positions.topk_kl` from the teacher's stored top-k ([positions, k] each)."""
    return summed(lambda rows: topk_kl(values[rows], indices[rows], student.logits(rows), temperature).sum(),
                  len(student.states), student.vocab)


def nll_sum(student: Hidden, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of `targets` [positions]."""
    return summed(lambda rows: nll(student.logits(rows), targets[rows]).sum(), len(student.states), student.vocab)


def scores(teacher: Hidden, student: Hidden, targets: torch.Tensor | None = None) -> dict:
    """Without grad, per position: KL(teacher || student), whether their top-1 agree, and (with `targets`) the
    student's cross-entropy; each [positions], the logits built a chunk at a time."""
    out = {"kl": [], "agree": [], **({"nll": []} if targets is not None else {})}
    with torch.no_grad():
        for rows in chunks(len(student.states), student.vocab):
            t, s = teacher.logits(rows), student.logits(rows)
            out["kl"].append(kl(t, s))
            out["agree"].append(t.argmax(-1) == s.argmax(-1))
            if targets is not None:
                out["nll"].append(nll(s, targets[rows]))
            del t, s
    return {k: torch.cat(v) for k, v in out.items()}
