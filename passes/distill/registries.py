"""The distill pass's extension points and their built-ins: the registries of loss terms, data sources,
optimisers and callbacks with their `register_*` decorators, what a loss term sees (`Batch`, `Outputs`) and
what a data source gives (`Source`), and the built-in entries (`kl`, `cos`, `lm`, `mtp`, `mtp-self`; `text`;
`adamw-cosine`), registered when this module is imported. Kept apart from the run so that a plugin
extends the registries without the training machinery. (`Distill` in annotations is the pass,
`passes.distill.Distill`: not imported, since the package imports this module.)"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from ...evaluation import metrics, vocab
from ...evaluation.vocab import Hidden
from ...training import Schedule
from ..core import PassError

# -- the registries ------------------------------------------------------------------------------------------
LOSSES: dict[str, Callable] = {}  # name -> fn(batch: Batch) -> scalar tensor
DATA: dict[str, Callable] = {}  # name -> fn(settings: Distill, tokenizer) -> Source
OPTIMIZERS: dict[str, Callable] = {}  # name -> fn(settings: Distill) -> a Schedule-like object (see training.fit)
CALLBACKS: dict[str, Callable] = {}  # name -> fn(settings: Distill) -> object with on_step / on_eval


def _registrar(table: dict, what: str):
    def register_as(name: str):
        def wrap(fn):
            if name in table and table[name] is not fn:
                raise PassError(f"a {what} named {name!r} is already registered ({table[name].__module__})")
            table[name] = fn
            return fn
        return wrap
    return register_as


register_loss = _registrar(LOSSES, "loss term")
register_data = _registrar(DATA, "data source")
register_optimizer = _registrar(OPTIMIZERS, "optimizer")
register_callback = _registrar(CALLBACKS, "callback")


@dataclass
class Outputs:
    """One model's outputs on a batch: its final hidden states with the LM head's matrix (`last`, a
    `vocab.Hidden`), the MTP head's (`mtp_last`; None without a head), and the output of every block (layer i's
    residual stream after it; a noop block's output is its input). The built-in terms build the logits from
    `last` a chunk of tokens at a time (`evaluation.vocab`); `logits` and `mtp` build the whole float32
    [B, T, vocab] tensors, for a registered term that needs them (at a large vocabulary, the most memory
    of the step: prefer `vocab.summed` over chunks)."""

    last: Hidden | None
    mtp_last: Hidden | None
    hidden: list[torch.Tensor]

    @staticmethod
    def _whole(h: Hidden | None) -> torch.Tensor | None:
        return None if h is None else h.logits().view(*h.states.shape[:-1], h.vocab)

    @cached_property
    def logits(self) -> torch.Tensor | None:
        return self._whole(self.last)

    @cached_property
    def mtp(self) -> torch.Tensor | None:
        return self._whole(self.mtp_last)


@dataclass
class Batch:
    """What a loss term sees: token ids [B, T + 1] (inputs are ids[:, :-1], targets ids[:, 1:]).

    With stored teacher logits (`teacher_logits=`) the teacher's outputs are not there (`teacher.last` is
    None, no hidden states, no MTP head); `teacher_topk` holds its top-k log-probabilities and their
    vocabulary indices instead, each [B, T, k]."""

    ids: torch.Tensor
    student: Outputs
    teacher: Outputs
    temperature: float = 1.0
    teacher_topk: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class Source:
    """A data source: `sample(generator)` gives a global batch of token ids [batch, seq + 1]; `held_out`
    the evaluation windows [n, seq + 1]; `token_bytes` the UTF-8 bytes per token id, for bits per byte (None:
    one byte per token)."""

    sample: Callable[[torch.Generator], torch.Tensor]
    held_out: torch.Tensor
    token_bytes: object = None


# -- built-in loss terms ------------------------------------------------------------------------------------------
def soft_kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """`evaluate.kl` of the softened distributions, averaged over positions and scaled by T^2 (Hinton et al.:
    the gradient keeps its size whatever the temperature)."""
    return metrics.kl(teacher_logits, student_logits, temperature).mean() * temperature ** 2


def topk_kl(values: torch.Tensor, indices: torch.Tensor, student_logits: torch.Tensor,
            temperature: float) -> torch.Tensor:
    """`soft_kl` from the teacher's stored top-k (`evaluate.topk_kl`: its mass outside them is dropped; with
    k = the vocabulary it is the full KL)."""
    return metrics.topk_kl(values, indices, student_logits, temperature).mean() * temperature ** 2


def _mean_kl(teacher: Hidden, student: Hidden, temperature: float, start: int = 0) -> torch.Tensor:
    """`soft_kl` from hidden states (from position `start` of each sequence), over chunks of tokens."""
    s = student.rows(start)
    return vocab.kl_sum(teacher.rows(start), s, temperature) / len(s.states) * temperature ** 2


@register_loss("kl")
def kl_loss(b: Batch) -> torch.Tensor:
    """KL of the student's next-token distribution from the teacher's (from its stored top-k with
    `teacher_logits=`: see `topk_kl`)."""
    if b.teacher.last is None and b.teacher_topk is not None:
        s = b.student.last.rows()
        v, ix = (t.reshape(-1, t.shape[-1]) for t in b.teacher_topk)
        return vocab.topk_kl_sum(v, ix, s, b.temperature) / len(s.states) * b.temperature ** 2
    return _mean_kl(b.teacher.last, b.student.last, b.temperature)


@register_loss("cos")
def cosine_loss(b: Batch) -> torch.Tensor:
    """1 - cosine similarity of the hidden states at every block boundary, averaged over layers and tokens."""
    if len(b.student.hidden) != len(b.teacher.hidden):
        raise PassError(f"the cos loss pairs layers one to one, but the student has {len(b.student.hidden)} "
                        f"layers and the teacher {len(b.teacher.hidden)}; set cos=0")
    terms = [1 - F.cosine_similarity(s.float(), t.float(), dim=-1).mean()
             for s, t in zip(b.student.hidden, b.teacher.hidden)]
    return torch.stack(terms).mean()


@register_loss("lm")
def lm_loss(b: Batch) -> torch.Tensor:
    """Next-token cross-entropy on the text itself."""
    s = b.student.last.rows()
    return vocab.nll_sum(s, b.ids[:, 1:].reshape(-1).to(s.states.device)) / len(s.states)


@register_loss("mtp")
def mtp_loss(b: Batch) -> torch.Tensor:
    """KL of the student's MTP-head distribution from the teacher's (from position 1: position 0 of the
    head sees no trunk state)."""
    if b.student.mtp_last is None or b.teacher.mtp_last is None:
        who = "student" if b.student.mtp_last is None else "teacher"
        raise PassError(f"the mtp loss needs an MTP head on both models, and the {who} has none; set mtp=0")
    return _mean_kl(b.teacher.mtp_last, b.student.mtp_last, b.temperature, start=1)


@register_loss("mtp-self")
def mtp_self_loss(b: Batch) -> torch.Tensor:
    """KL of the student's MTP-head distribution at t from its own trunk's next-token distribution at t (held
    fixed). A draft is accepted when it matches the trunk it is attached to, not the teacher's: after pruning,
    the teacher's head answers for another trunk (self-distillation, as speculative draft heads are trained).
    From position 1, as `mtp`."""
    if b.student.mtp_last is None:
        raise PassError("the mtp-self loss needs an MTP head on the student, and it has none; set mtp_self=0")
    return _mean_kl(b.student.last.detach(), b.student.mtp_last, b.temperature, start=1)


# -- built-in data, optimiser ---------------------------------------------------------------------------------------
@register_data("text")
def text_source(d: Distill, tokenizer) -> Source:
    """Random windows of the `data` (or the Python standard library) in the model's tokenization; evaluated on
    the held-out `selection` set, which no reported figure uses (the best weights are chosen there)."""
    from ...text.data import held_out_windows, load_corpus, random_windows

    corpus = load_corpus(list(d.data) or None, tokenizer=tokenizer)
    return Source(lambda g: random_windows(corpus.train, d.batch, d.seq + 1, g),
                  held_out_windows(corpus, "selection", d.seq + 1, limit=d.eval_windows), corpus.token_bytes)


@register_optimizer("adamw-cosine")
def adamw_cosine(d: Distill) -> Schedule:
    """AdamW with linear warmup and cosine decay to a tenth of the learning rate."""
    return Schedule(d.steps, d.lr, warmup=min(d.warmup, d.steps), weight_decay=0.0)
