"""Mamba-2 mixer block: in_proj -> causal depthwise conv1d -> SSD scan with groups -> gated RMSNorm -> out_proj."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .base import Axis, Block, OpSpec, RMSNorm, Work, dense_weights, full_precision, positive


@dataclass(frozen=True)
class Mamba2(OpSpec):
    kind = "mamba2"
    letter = "M"
    is_block = True
    hidden: int
    heads: int
    head_dim: int
    state: int
    groups: int
    conv: int = 4
    chunk: int = 128
    conv_bias: bool = True
    dt_min: float = 0.0
    eps: float = 1e-5
    dt_max: float = math.inf  # dt's upper clamp (`time_step_limit`'s upper end; inf: none)

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner + 2 * self.groups * self.state

    def params(self):
        p = {
            "norm.weight": (self.hidden,),
            "mixer.in_proj.weight": (self.inner + self.conv_dim + self.heads, self.hidden),
            "mixer.conv1d.weight": (self.conv_dim, 1, self.conv),
            "mixer.A_log": (self.heads,),
            "mixer.D": (self.heads,),
            "mixer.dt_bias": (self.heads,),
            "mixer.norm.weight": (self.inner,),
            "mixer.out_proj.weight": (self.hidden, self.inner),
        }
        if self.conv_bias:
            p["mixer.conv1d.bias"] = (self.conv_dim,)
        return dict(sorted(p.items()))

    def state_shapes(self):
        return {"conv": ("B", self.conv_dim, self.conv - 1), "ssm": ("B", self.heads, self.head_dim, self.state)}

    def check(self):
        out = super().check() + positive(self, "hidden", "heads", "head_dim", "state", "groups", "conv", "chunk")
        if self.groups > 0 and self.heads % self.groups:
            out.append(("groups", f"heads={self.heads} must be divisible by groups={self.groups}"))
        if self.dt_min < 0:
            out.append(("dt_min", f"must be >= 0 (the lower clamp of dt), got {self.dt_min}"))
        if not self.dt_max >= self.dt_min:
            out.append(("dt_max", f"must be >= dt_min={self.dt_min} (the upper clamp of dt), got {self.dt_max}"))
        return out

    def state_bytes(self, kv_bytes: float, ssm_bytes: float, act_bytes: float, context: int) -> float:
        """Per-sequence decode state: conv window in the activation dtype, SSM state in its own dtype."""
        return self.conv_dim * (self.conv - 1) * act_bytes + self.heads * self.head_dim * self.state * ssm_bytes

    def work(self, batch: int, tokens: int, context: int, decode: bool, kv_bytes: float, ssm_bytes: float,
             act_bytes: float, routing=None) -> Work:
        n = batch * tokens
        proj = self.inner + self.conv_dim + self.heads
        hpn = self.heads * self.head_dim * self.state
        if decode:  # state update (decay, outer product, add) and readout
            ssm = 5 * hpn
        else:  # chunked SSD: intra-chunk scores and mixing, chunk states, inter-chunk readout
            q = min(self.chunk, tokens)
            ssm = 2 * q * self.heads * (self.state + self.head_dim) + 6 * hpn
        flops = n * (2 * self.hidden * proj + 2 * self.conv * self.conv_dim + ssm + 2 * self.inner * self.hidden
                     + 6 * self.inner + 4 * self.hidden)
        state = batch * self.state_bytes(kv_bytes, ssm_bytes, act_bytes, context)
        return Work(flops, dense_weights(self), n * (2 * self.hidden + proj + 2 * self.conv_dim + 2 * self.inner),
                    state_read=state, state_write=state, kernels=7)

    def build(self):
        return Block(self, RMSNorm(self.hidden, self.eps), Mamba2Mixer(self))

    def axes(self):
        """heads (equal per group), SSM state (the B and C channels of every group, equal per group), head_dim."""
        return {"head_dim": Axis(self.head_dim), "state": Axis(self.groups * self.state, self.groups),
                "heads": Axis(self.heads, self.groups)}

    def _shrink(self, axis, keep, w):
        P, GN = self.head_dim, self.groups * self.state
        heads, dims, states = torch.arange(self.heads), torch.arange(P), torch.arange(GN)
        heads, dims, states = (keep if axis == a else full for a, full in
                               (("heads", heads), ("head_dim", dims), ("state", states)))
        ch = (heads[:, None] * P + dims[None, :]).reshape(-1)  # kept inner channels, head by head
        inner = self.inner
        bc = torch.cat([inner + states, inner + GN + states])  # kept B and C channels of the conv
        rows = torch.cat([ch, inner + ch, inner + bc, inner + self.conv_dim + heads])  # z | x B C | dt
        conv = torch.cat([ch, bc])
        w["mixer.in_proj.weight"] = w["mixer.in_proj.weight"][rows]
        w["mixer.conv1d.weight"] = w["mixer.conv1d.weight"][conv]
        if "mixer.conv1d.bias" in w:
            w["mixer.conv1d.bias"] = w["mixer.conv1d.bias"][conv]
        for k in ("mixer.A_log", "mixer.D", "mixer.dt_bias"):
            w[k] = w[k][heads]
        w["mixer.norm.weight"] = w["mixer.norm.weight"][ch]
        w["mixer.out_proj.weight"] = w["mixer.out_proj.weight"][:, ch]
        return self.resized(axis, len(keep)), w

    def resized(self, axis, n):
        return self.replace(state=n // self.groups) if axis == "state" else super().resized(axis, n)


def cpu_chunk(state: int) -> int:
    """The scan's chunk on CPU: the same sums, but [chunk, chunk] decay tensors of 32 steps stay in cache where the
    checkpoint's 128 do not (7x faster at 128 heads); a small state (16) makes carrying it between chunks cheap,
    so 16 steps are faster still (the 88-layer miniature's library: 39 -> 32 s; benchmarks/counts.py)."""
    return 16 if state <= 16 else 32


def _segsum(a):
    """a [..., l] -> [..., l, l] with out[i, j] = sum(a[j+1 .. i]) for j <= i, -inf above the diagonal."""
    l = a.shape[-1]
    cs = torch.cumsum(a, dim=-1)
    seg = cs[..., :, None] - cs[..., None, :]
    mask = torch.ones(l, l, dtype=torch.bool, device=a.device).tril()
    return seg.masked_fill(~mask, float("-inf"))


def ssd_chunked(x, dt, A, B, C, chunk: int, init_state):
    """The chunked state-space-duality scan in its export form: a graph without a loop or a branch on the length.

    x [b,t,h,p], dt [b,t,h] (discretisation step, already positive), A [h] (negative),
    B, C [b,t,h,n], init_state [b,h,p,n]. Returns y [b,t,h,p] (without the D skip) and the final state.
    Within a chunk the scan is an attention-like quadratic form; across chunks the state is carried with a
    [chunks+1, chunks+1] decay matrix, after zero-padding to at least two chunks (padded steps have dt = 0: they
    neither decay nor update). `ssd_grouped` runs the same sums chunk after chunk.
    """
    b, t, h, p = x.shape
    n = B.shape[-1]
    c = (t + chunk - 1) // chunk + 1
    pad = c * chunk - t
    x = F.pad(x * dt[..., None], (0, 0, 0, 0, 0, pad)).reshape(b, c, chunk, h, p)
    B = F.pad(B, (0, 0, 0, 0, 0, pad)).reshape(b, c, chunk, h, n)
    C = F.pad(C, (0, 0, 0, 0, 0, pad)).reshape(b, c, chunk, h, n)
    a = F.pad(dt * A, (0, 0, 0, pad)).reshape(b, c, chunk, h).permute(0, 3, 1, 2)  # [b,h,c,l]
    a_cum = torch.cumsum(a, dim=-1)
    # within each chunk: attention-like quadratic form
    scores = torch.einsum("bclhn,bcshn->bclsh", C, B) * torch.exp(_segsum(a)).permute(0, 2, 3, 4, 1)
    y_diag = torch.einsum("bclsh,bcshp->bclhp", scores, x)
    # state contributed by each chunk, then carried across chunks
    to_end = torch.exp(a_cum[..., -1:] - a_cum)  # [b,h,c,l]
    chunk_states = torch.einsum("bclhn,bclhp->bchpn", B * to_end.permute(0, 2, 3, 1)[..., None], x)
    states = torch.cat([init_state.to(chunk_states.dtype)[:, None], chunk_states], dim=1)  # [b,c+1,h,p,n]
    chunk_decay = torch.exp(_segsum(F.pad(a_cum[..., -1], (1, 0))))  # [b,h,c+1,c+1]
    states = torch.einsum("bhzc,bchpn->bzhpn", chunk_decay, states)
    prev_states, final = states[:, :-1], states[:, -1]
    y_off = torch.einsum("bclhn,bchpn->bclhp", C, prev_states) * torch.exp(a_cum).permute(0, 2, 3, 1)[..., None]
    y = (y_diag + y_off).reshape(b, c * chunk, h, p)[:, :t]
    return y, final


def ssd_grouped(x, dt, A, B, C, chunk: int, init_state):
    """`ssd_chunked`'s scan for running (not exporting), with B, C per group [b,t,g,n] for heads [b,t,h,p] in g
    groups: C·B is formed once per group, not once per head (Super: 128 heads in 8 groups), and every product is
    a head-major batched matmul rather than an einsum that permutes a [chunk, chunk] tensor per head. The same
    sums as `ssd_chunked` in another order. Returns y [b,t,h,p] (without the D skip) and the final state."""
    b, t, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    r = h // g
    chunk = max(1, min(chunk, t))
    c = (t + chunk - 1) // chunk
    pad = c * chunk - t

    def chunked(v):  # [b,t,k,d] -> [b,k,c,l,d]
        return F.pad(v, (0, 0, 0, 0, 0, pad)).reshape(b, c, chunk, v.shape[2], v.shape[3]).permute(0, 3, 1, 2, 4)

    xs, Bs, Cs = chunked(x * dt[..., None]), chunked(B), chunked(C)
    a_cum = torch.cumsum(F.pad(dt * A, (0, 0, 0, pad)).reshape(b, c, chunk, h).permute(0, 3, 1, 2), dim=-1)
    seg = a_cum[..., :, None] - a_cum[..., None, :]  # [b,h,c,l,s]: the decay from step s to step l
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    decay = torch.exp(seg.masked_fill(~causal, float("-inf"))).view(b, g, r, c, chunk, chunk)
    scores = decay * (Cs @ Bs.transpose(-1, -2))[:, :, None]  # [b,g,r,c,l,s]
    xs = xs.reshape(b, g, r, c, chunk, p)
    y = scores @ xs  # within each chunk
    to_end = torch.exp(a_cum[..., -1:] - a_cum).view(b, g, r, c, chunk, 1)
    chunk_states = (xs * to_end).transpose(-1, -2) @ Bs[:, :, None]  # [b,g,r,c,p,n]
    carry = torch.exp(a_cum[..., -1]).view(b, g, r, c, 1, 1)
    state, prev = init_state.to(chunk_states.dtype).view(b, g, r, p, n), []
    for z in range(c):  # the state entering each chunk, carried one chunk after the other
        prev.append(state)
        state = state * carry[:, :, :, z] + chunk_states[:, :, :, z]
    prev_states = torch.stack(prev, 3)  # [b,g,r,c,p,n]
    y = y + (Cs[:, :, None] @ prev_states.transpose(-1, -2)) * torch.exp(a_cum).view(b, g, r, c, chunk, 1)
    return y.reshape(b, h, c * chunk, p).transpose(1, 2)[:, :t], state.reshape(b, h, p, n)


class Mamba2Mixer(nn.Module):
    stateful = True

    def __init__(self, spec: Mamba2):
        super().__init__()
        s = self.spec = spec
        self.in_proj = nn.Linear(s.hidden, s.inner + s.conv_dim + s.heads, bias=False)
        self.conv1d = nn.Conv1d(s.conv_dim, s.conv_dim, s.conv, groups=s.conv_dim, bias=s.conv_bias)
        self.A_log = nn.Parameter(torch.zeros(s.heads))
        self.D = nn.Parameter(torch.ones(s.heads))
        self.dt_bias = nn.Parameter(torch.zeros(s.heads))
        self.norm = RMSNorm(s.inner, s.eps)
        self.out_proj = nn.Linear(s.inner, s.hidden, bias=False)
        self.export_form = False  # the scan's export form (see ssd_chunked)

    def gated_norm(self, y, z):
        s = self.spec
        y = y.float() * F.silu(z.float())
        g = y.reshape(*y.shape[:-1], s.groups, s.inner // s.groups)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + s.eps)
        return self.norm.weight * g.reshape(y.shape).to(z.dtype)

    def causal_conv(self, xbc, conv_state):
        """The depthwise causal conv and SiLU over xbc [b, conv_dim, t] following `conv_state` [b, conv_dim,
        conv-1] (zeros for a fresh sequence): (its output [b, conv_dim, t], the conv state after it)."""
        s = self.spec
        window = torch.cat([conv_state, xbc], dim=-1)  # [b, conv_dim, conv-1+t]
        new_conv = window[:, :, -(s.conv - 1):] if s.conv > 1 else conv_state
        return F.silu(F.conv1d(window, self.conv1d.weight, self.conv1d.bias, groups=s.conv_dim)), new_conv

    def forward(self, u, state=None, decode: bool = False):
        """u [b,t,hidden]; state (conv [b,conv_dim,conv-1], ssm [b,h,p,n]) or None for a fresh sequence."""
        s = self.spec
        b, t, _ = u.shape
        z, xbc, dt = self.in_proj(u).split([s.inner, s.conv_dim, s.heads], dim=-1)
        if state is None:
            conv_state = u.new_zeros(b, s.conv_dim, s.conv - 1)
            ssm_state = u.new_zeros(b, s.heads, s.head_dim, s.state, dtype=torch.float32)
        else:
            conv_state, ssm_state = state
        xbc, new_conv = self.causal_conv(xbc.transpose(1, 2), conv_state)
        xbc = xbc.transpose(1, 2)
        x, B, C = xbc.split([s.inner, s.groups * s.state, s.groups * s.state], dim=-1)
        with full_precision(u):  # the scan and its state in float32, whatever the forward's precision
            high = None if s.dt_max == math.inf else s.dt_max
            dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(s.dt_min, high)
            A = -torch.exp(self.A_log.float())
            rep = s.heads // s.groups
            x = x.reshape(b, t, s.heads, s.head_dim).float()
            B = B.reshape(b, t, s.groups, s.state).float()
            C = C.reshape(b, t, s.groups, s.state).float()
            if decode:  # one token: the plain recurrence
                x0, dt0 = x[:, 0], dt[:, 0]
                B0, C0 = B[:, 0].repeat_interleave(rep, dim=1), C[:, 0].repeat_interleave(rep, dim=1)
                decay = torch.exp(dt0 * A)[..., None, None]
                ssm_state = ssm_state.float() * decay + (dt0[..., None] * x0)[..., None] * B0[:, :, None, :]
                y = torch.einsum("bhpn,bhn->bhp", ssm_state, C0)[:, None]
            elif self.export_form:
                B, C = B.repeat_interleave(rep, dim=2), C.repeat_interleave(rep, dim=2)
                y, ssm_state = ssd_chunked(x, dt, A, B, C, s.chunk, ssm_state.float())
            else:
                chunk = s.chunk if x.is_cuda else min(s.chunk, cpu_chunk(s.state))
                y, ssm_state = ssd_grouped(x, dt, A, B, C, chunk, ssm_state.float())
            y = y + x * self.D.float()[:, None]
            y = self.gated_norm(y.reshape(b, t, s.inner), z)
        return self.out_proj(y.to(u.dtype)), (new_conv, ssm_state)
