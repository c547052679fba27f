"""Dense squared-ReLU MLP block, and Puzzle's replacements: `noop` (identity) and `linear` (one dense layer)."""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .base import Axis, Block, OpSpec, RMSNorm, Work, dense_weights, positive
from .moe import _MLP


@dataclass(frozen=True)
class MLP(OpSpec):
    kind = "mlp"
    letter = "-"
    is_block = True
    hidden: int
    d_ff: int
    eps: float = 1e-5

    def params(self):
        return {
            "norm.weight": (self.hidden,),
            "mixer.up_proj.weight": (self.d_ff, self.hidden),
            "mixer.down_proj.weight": (self.hidden, self.d_ff),
        }

    def check(self):
        return super().check() + positive(self, "hidden", "d_ff")

    def work(self, batch, tokens, context, decode, kv_bytes, ssm_bytes, act_bytes, routing=None):
        n = batch * tokens
        return Work(n * (4 * self.hidden * self.d_ff + 4 * self.hidden), dense_weights(self),
                    n * (2 * self.hidden + self.d_ff), kernels=3)

    def build(self):
        return Block(self, RMSNorm(self.hidden, self.eps), _MLP(self.hidden, self.d_ff))

    def axes(self):
        return {"d_ff": Axis(self.d_ff)}

    def _shrink(self, axis, keep, w):
        w["mixer.up_proj.weight"] = w["mixer.up_proj.weight"][keep]
        w["mixer.down_proj.weight"] = w["mixer.down_proj.weight"][:, keep]
        return self.resized(axis, len(keep)), w


@dataclass(frozen=True)
class Noop(OpSpec):
    """The block is skipped: its output is its input."""

    kind = "noop"
    is_block = True
    hidden: int

    def check(self):
        return super().check() + positive(self, "hidden")

    def work(self, batch, tokens, context, decode, kv_bytes, ssm_bytes, act_bytes, routing=None):
        return Work()

    def build(self):
        return Block(self, None, None)


@dataclass(frozen=True)
class Linear(OpSpec):
    """The block's mixer is replaced by one dense hidden x hidden layer (after the block's norm)."""

    kind = "linear"
    is_block = True
    hidden: int
    eps: float = 1e-5

    def params(self):
        return {"norm.weight": (self.hidden,), "mixer.linear.weight": (self.hidden, self.hidden)}

    def check(self):
        return super().check() + positive(self, "hidden")

    def work(self, batch, tokens, context, decode, kv_bytes, ssm_bytes, act_bytes, routing=None):
        n = batch * tokens
        return Work(n * (2 * self.hidden * self.hidden + 4 * self.hidden), dense_weights(self), n * 2 * self.hidden,
                    kernels=2)

    def build(self):
        return Block(self, RMSNorm(self.hidden, self.eps), _LinearMixer(self.hidden))


class _LinearMixer(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):
        return self.linear(x)
