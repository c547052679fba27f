"""The ends of the trunk: token embedding, final norm, LM head (tied or not)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .base import OpSpec, RMSNorm, Work, dense_weights, positive


@dataclass(frozen=True)
class Embed(OpSpec):
    kind = "embed"
    inputs = ("ids",)
    vocab: int
    hidden: int

    def params(self):
        return {"weight": (self.vocab, self.hidden)}

    def check(self):
        return super().check() + positive(self, "vocab", "hidden")

    def work(self, batch, tokens, context, decode, kv_bytes, ssm_bytes, act_bytes, routing=None):
        n = batch * tokens  # a gather: only the rows of the tokens seen are read
        return Work(0.0, {"weight": float(min(n, self.vocab) * self.hidden)}, n * self.hidden, kernels=1)

    def build(self):
        w = torch.empty(self.vocab, self.hidden)
        if not w.is_meta:  # as nn.Embedding initialises; on the meta device nothing (its normal_ costs 2 s there)
            nn.init.normal_(w)
        return nn.Embedding(self.vocab, self.hidden, _weight=w)


@dataclass(frozen=True)
class Norm(OpSpec):
    kind = "norm"
    hidden: int
    eps: float = 1e-5

    def params(self):
        return {"weight": (self.hidden,)}

    def check(self):
        return super().check() + positive(self, "hidden")

    def work(self, batch, tokens, context, decode, kv_bytes, ssm_bytes, act_bytes, routing=None):
        n = batch * tokens
        return Work(4.0 * n * self.hidden, dense_weights(self), 2.0 * n * self.hidden, kernels=1)

    def build(self):
        return RMSNorm(self.hidden, self.eps)


@dataclass(frozen=True)
class LMHead(OpSpec):
    kind = "lm_head"
    vocab: int
    hidden: int
    tied: bool = False  # reuse the embedding matrix

    def params(self):
        return {} if self.tied else {"weight": (self.vocab, self.hidden)}

    def check(self):
        return super().check() + positive(self, "vocab", "hidden")

    def work(self, batch, tokens, context, decode, kv_bytes, ssm_bytes, act_bytes, routing=None):
        """Serving computes logits for the last position of each sequence only (a tied head reads the
        embedding matrix, named "weight" here too)."""
        return Work(2.0 * batch * self.hidden * self.vocab, {"weight": float(self.vocab * self.hidden)},
                    batch * (self.hidden + self.vocab), kernels=1)

    def build(self):
        return TiedHead() if self.tied else nn.Linear(self.hidden, self.vocab, bias=False)


class TiedHead(nn.Module):
    """Projects onto the vocabulary with the embedding's matrix, set by the materialiser."""

    embedding: nn.Embedding

    def forward(self, h):
        return F.linear(h, self.embedding.weight)

    def bind(self, embedding: nn.Embedding):
        object.__setattr__(self, "embedding", embedding)  # a reference, not a second owner
