"""Multi-token-prediction head, Nemotron style.

Position t of the head fuses the trunk's hidden state at t-1 (before the final norm) with the
embedding of token t: eh_proj(cat(enorm(embed(x_t)), hnorm(h_{t-1}))). Its own small stack of
blocks follows (e.g. pattern `*E`), then a final RMSNorm and the trunk's LM head. So its logits at
t predict x_{t+1} from h_{t-1} plus x_t: the token after next, seen from the hidden state used.
The last trunk hidden state is part of the decode state; a fresh sequence starts from zeros.
Weight names follow the published checkpoints: mtp.layers.{i}.*, with enorm/hnorm/eh_proj on the
first layer and final_layernorm on the last.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .base import OpSpec, RMSNorm, Work, positive


@dataclass(frozen=True)
class MTP(OpSpec):
    kind = "mtp"
    inputs = ("hidden", "ids")
    hidden: int
    blocks: tuple  # OpSpecs of the head's own residual blocks
    eps: float = 1e-5

    @property
    def pattern(self) -> str:
        return "".join(b.letter or "?" for b in self.blocks)

    def params(self):
        h, last = self.hidden, len(self.blocks) - 1
        p = {
            "layers.0.enorm.weight": (h,),
            "layers.0.hnorm.weight": (h,),
            "layers.0.eh_proj.weight": (h, 2 * h),
            f"layers.{last}.final_layernorm.weight": (h,),
        }
        for i, b in enumerate(self.blocks):
            p.update({f"layers.{i}.{k}": v for k, v in b.params().items()})
        return p

    def active_params(self):
        fused = 3 * self.hidden + 2 * self.hidden * self.hidden  # enorm, hnorm, final norm, eh_proj
        return fused + sum(b.active_params() for b in self.blocks)

    def fp32_params(self):
        return frozenset(f"layers.{i}.{n}" for i, b in enumerate(self.blocks) for n in b.fp32_params())

    def state_shapes(self):
        s = {"h": ("B", self.hidden)}
        for i, b in enumerate(self.blocks):
            s.update({f"layers.{i}.{k}": v for k, v in b.state_shapes().items()})
        return s

    def state_bytes(self, kv_bytes, ssm_bytes, act_bytes, context):
        return self.hidden * act_bytes + sum(b.state_bytes(kv_bytes, ssm_bytes, act_bytes, context) for b in self.blocks)

    def work(self, batch, tokens, context, decode, kv_bytes, ssm_bytes, act_bytes, routing=None):
        """One pass of the head (fusion, its blocks); the shared LM head is costed by the lm_head node."""
        n, h = batch * tokens, self.hidden
        total = Work(n * (4 * h * h + 12 * h), {"layers.0.eh_proj.weight": 2.0 * h * h, "layers.0.enorm.weight": h,
                                                "layers.0.hnorm.weight": h,
                                                f"layers.{len(self.blocks) - 1}.final_layernorm.weight": h},
                     n * 5 * h, kernels=3)
        for i, b in enumerate(self.blocks):
            w = b.work(batch, tokens, context, decode, kv_bytes, ssm_bytes, act_bytes,
                       None if routing is None else routing.get(i))
            total.flops += w.flops
            total.act += w.act
            total.state_read += w.state_read
            total.state_write += w.state_write
            total.kernels += w.kernels
            total.weights.update({f"layers.{i}.{k}": v for k, v in w.weights.items()})
        return total

    def check(self):
        out = super().check() + positive(self, "hidden")
        if not self.blocks:
            out.append(("blocks", "the MTP head needs at least one block"))
        for i, b in enumerate(self.blocks):
            if not getattr(b, "is_block", False):
                out.append((f"blocks[{i}]", f"{b.kind!r} is not a residual block"))
                continue
            if b.hidden != self.hidden:
                out.append((f"blocks[{i}].hidden", f"{b.hidden} differs from the head's hidden {self.hidden}"))
            out += [(f"blocks[{i}].{a}", m) for a, m in b.check()]
        return out

    def build(self):
        return MTPHead(self)


class MTPHead(nn.Module):
    def __init__(self, spec: MTP):
        super().__init__()
        self.spec = spec
        self.layers = nn.ModuleList(b.build() for b in spec.blocks)
        first, last = self.layers[0], self.layers[-1]
        first.enorm = RMSNorm(spec.hidden, spec.eps)
        first.hnorm = RMSNorm(spec.hidden, spec.eps)
        first.eh_proj = nn.Linear(2 * spec.hidden, spec.hidden, bias=False)
        last.final_layernorm = RMSNorm(spec.hidden, spec.eps)

    def bind(self, embed: nn.Module, head: nn.Module):
        """The trunk's embedding and LM head, held by reference (they stay owned by the trunk)."""
        object.__setattr__(self, "shared", (embed, head))

    def forward(self, h, ids, state=None, decode: bool = False, project: bool = True):
        """h: trunk hidden [b,t,hidden] before the final norm; ids: the tokens [b,t].

        state: (last trunk hidden [b,hidden], *per-block states flattened) or None.
        Returns logits [b,t,vocab] (`project` false: the normed hidden state the shared LM head projects) and
        the new state.
        """
        z, new_state = self._stack(h, ids, state, decode)
        z = self.layers[-1].final_layernorm(z)
        return (self.shared[1](z) if project else z), new_state

    def with_hidden(self, h, ids):
        """Logits and the head's own hidden state before its final norm (a fresh sequence)."""
        z, _ = self._stack(h, ids, None, False)
        return self.shared[1](self.layers[-1].final_layernorm(z)), z

    def _stack(self, h, ids, state, decode):
        embed = self.shared[0]
        first = self.layers[0]
        prev = h.new_zeros(h.shape[0], 1, h.shape[2]) if state is None else state[0][:, None]
        shifted = torch.cat([prev, h[:, :-1]], dim=1)
        z = first.eh_proj(torch.cat([first.enorm(embed(ids)), first.hnorm(shifted)], dim=-1))
        new_state, i = [h[:, -1]], 1
        for layer in self.layers:
            n = len(layer.spec.state_shapes())
            z, st = layer(z, None if state is None else tuple(state[i:i + n]), decode)
            new_state += list(st)
            i += n
        return z, tuple(new_state)
