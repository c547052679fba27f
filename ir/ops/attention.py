"""Grouped-query attention block with a KV cache; no positional encoding (Nemotron-H)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .base import Axis, Block, OpSpec, RMSNorm, Work, dense_weights, positive


@dataclass(frozen=True)
class Attention(OpSpec):
    kind = "attention"
    letter = "*"
    is_block = True
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    eps: float = 1e-5

    def params(self):
        q, kv = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        return {
            "norm.weight": (self.hidden,),
            "mixer.q_proj.weight": (q, self.hidden),
            "mixer.k_proj.weight": (kv, self.hidden),
            "mixer.v_proj.weight": (kv, self.hidden),
            "mixer.o_proj.weight": (self.hidden, q),
        }

    def state_shapes(self):
        return {"k": ("B", self.kv_heads, "L", self.head_dim), "v": ("B", self.kv_heads, "L", self.head_dim)}

    def check(self):
        out = super().check() + positive(self, "hidden", "q_heads", "kv_heads", "head_dim")
        if self.kv_heads > 0 and self.q_heads % self.kv_heads:
            out.append(("kv_heads", f"q_heads={self.q_heads} must be divisible by kv_heads={self.kv_heads}"))
        return out

    def state_bytes(self, kv_bytes: float, ssm_bytes: float, act_bytes: float, context: int) -> float:
        """Per-sequence KV cache at `context` tokens."""
        return 2 * self.kv_heads * self.head_dim * context * kv_bytes

    def work(self, batch: int, tokens: int, context: int, decode: bool, kv_bytes: float, ssm_bytes: float,
             act_bytes: float, routing=None) -> Work:
        n = batch * tokens
        q, kv = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        past = context if decode else 0
        # each query attends to the past plus the causal part of its own chunk: QK^T and AV
        pairs = batch * (tokens * past + tokens * (tokens + 1) / 2)
        flops = 2 * n * self.hidden * (2 * q + 2 * kv) + 4 * pairs * q + 4 * n * self.hidden
        per_token = 2 * kv * kv_bytes
        return Work(flops, dense_weights(self), n * (2 * self.hidden + 2 * q + 2 * kv),
                    state_read=batch * past * per_token, state_write=n * per_token, kernels=5)

    def build(self):
        return Block(self, RMSNorm(self.hidden, self.eps), AttentionMixer(self))

    def axes(self):
        """Query heads (equal per group), KV groups (the query heads of a group follow), and merging KV
        heads while every query head stays (Puzzle's GQA reduction: consecutive KV heads merge into their
        mean)."""
        return {"q_heads": Axis(self.q_heads, self.kv_heads), "kv_heads": Axis(self.kv_heads),
                "kv_merge": Axis(self.kv_heads, ranked=False)}

    def _shrink(self, axis, keep, w):
        D, rep = self.head_dim, self.q_heads // self.kv_heads
        if axis == "kv_merge":
            n = len(keep)
            if self.kv_heads % n:
                raise ValueError(f"kv_merge: {self.kv_heads} KV heads do not merge evenly into {n}")
            for k in ("mixer.k_proj.weight", "mixer.v_proj.weight"):
                w[k] = w[k].reshape(n, self.kv_heads // n, D, self.hidden).mean(1).reshape(n * D, self.hidden)
            return self.resized(axis, n), w
        if axis == "kv_heads":
            kv, q = keep, (keep[:, None] * rep + torch.arange(rep)).reshape(-1)
        else:
            kv, q = torch.arange(self.kv_heads), keep
        rows = lambda heads: (heads[:, None] * D + torch.arange(D)).reshape(-1)
        for k in ("mixer.k_proj.weight", "mixer.v_proj.weight"):
            w[k] = w[k][rows(kv)]
        w["mixer.q_proj.weight"] = w["mixer.q_proj.weight"][rows(q)]
        w["mixer.o_proj.weight"] = w["mixer.o_proj.weight"][:, rows(q)]
        return self.resized(axis, len(keep)), w

    def resized(self, axis, n):
        if axis == "kv_heads":
            return self.replace(kv_heads=n, q_heads=n * (self.q_heads // self.kv_heads))
        return self.replace(kv_heads=n) if axis == "kv_merge" else super().resized(axis, n)


class AttentionMixer(nn.Module):
    """Eager runs go through `scaled_dot_product_attention` with grouped KV heads (no repeated K/V, fused
    kernels, no [t, L] score matrix held per head). The ONNX export asks for `export_form`: attention written
    out (MatMul -> masked Softmax -> MatMul over [b, kv, rep, t, d] groups), which every TensorRT version builds
    in every precision, where the ONNX Attention op builds only in 16-bit precisions with fused kernels."""

    stateful = True

    def __init__(self, spec: Attention):
        super().__init__()
        s = self.spec = spec
        self.q_proj = nn.Linear(s.hidden, s.q_heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.q_heads * s.head_dim, s.hidden, bias=False)
        self.export_form = False

    def forward(self, x, state=None, decode: bool = False):
        """x [b,t,hidden]; state (k, v) [b,kv_heads,L,head_dim] of the L tokens before, or None."""
        s = self.spec
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, s.q_heads, s.head_dim).transpose(1, 2)
        k = self.k_proj(x).reshape(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
        v = self.v_proj(x).reshape(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
        if state is not None:
            k, v = torch.cat([state[0], k], dim=2), torch.cat([state[1], v], dim=2)
        y = (self._written_out if self.export_form else self._fused)(q, k, v)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, s.q_heads * s.head_dim)), (k, v)

    def _fused(self, q, k, v):
        t, L = q.shape[2], k.shape[2]
        # a fresh prefill is plainly causal; a chunk after cached tokens needs the offset mask; one token sees all
        mask = _visible(t, L, q.device) if 1 < t < L else None
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=t > 1 and t == L,
                                              enable_gqa=self.spec.q_heads != self.spec.kv_heads)

    def _written_out(self, q, k, v):
        s = self.spec
        b, _, t, _ = q.shape
        rep = s.q_heads // s.kv_heads
        qg = q.reshape(b, s.kv_heads, rep, t, s.head_dim)
        scores = qg @ k.unsqueeze(2).transpose(-1, -2) * s.head_dim ** -0.5  # [b, kv, rep, t, L]
        probs = torch.softmax(scores.masked_fill(~_visible(t, k.shape[2], q.device), float("-inf")), dim=-1)
        return (probs @ v.unsqueeze(2)).reshape(b, s.q_heads, t, s.head_dim)


def _visible(t: int, L: int, device):
    """[t, L]: query i sits at absolute position L - t + i and sees keys 0 .. L - t + i."""
    return torch.arange(L, device=device)[None, :] <= torch.arange(t, device=device)[:, None] + (L - t)
