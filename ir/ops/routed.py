"""A MoE layer's routed experts as one module: two stacked parameters and batched products over routed rows.

The checkpoint stores one matrix per expert (`experts.{j}.up_proj.weight`, as Nemotron-3 ships); the module
holds them stacked, `up_proj` [experts, d_ff, width] and `down_proj` [experts, width, d_ff], as transformers'
and vLLM's NemotronH do. So no stage builds a module per expert, and a few kernels cover every expert in the
forward and the backward alike. `expert_names` / `split_experts` map between the two namings at load and save.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

def expert_names(prefix: str, side: str, experts: int) -> list[str]:
    """The checkpoint's names of one side of a layer's experts: `{prefix}.{j}.{side}.weight`, j = 0..experts-1
    (`prefix` ends in `experts`)."""
    return [f"{prefix}.{j}.{side}.weight" for j in range(experts)]


def is_stacked(name: str) -> bool:
    """Whether a module's tensor name is a stacked side of routed experts (`...experts.up_proj`)."""
    return name.endswith((".experts.up_proj", ".experts.down_proj")) or name in ("experts.up_proj",
                                                                                "experts.down_proj")


def split_experts(state: dict) -> dict:
    """A module's tensors by the checkpoint's names: each stacked side becomes one view per expert."""
    out = {}
    for k, t in state.items():
        if is_stacked(k):
            prefix, side = k.rsplit(".", 1)
            out.update(zip(expert_names(prefix, side, t.shape[0]), t.unbind(0)))
        else:
            out[k] = t
    return out


def _dtype(x: torch.Tensor, w: torch.Tensor) -> torch.dtype:
    """The GEMMs' dtype: autocast's where it is on (as F.linear would run), else the weights'."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else w.dtype


class _DenseGrad(torch.autograd.Function):
    """The identity, whose backward hands on a dense gradient: torch's CPU grouped GEMM refuses an expanded
    (stride-0) one, such as `.sum()`'s."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _grouped(rows, counts, up, down, act, observe):
    """torch._grouped_mm over the rows sorted by expert (differentiable; on CUDA, no host sync)."""
    offs = torch.cumsum(counts, 0).to(torch.int32)
    a = act(F.relu(torch._grouped_mm(rows, up.transpose(-1, -2), offs=offs)).square())
    if observe is not None:
        observe(a)
    out = torch._grouped_mm(a, down.transpose(-1, -2), offs=offs)
    return _DenseGrad.apply(out) if out.requires_grad else out


def _padded(rows, counts, up, down, act, observe):
    """The experts that received rows in batched products (bmm), each expert padded with zero rows (which the
    squared ReLU keeps at zero): differentiable by autograd, a few large kernels whatever the number of experts.
    One batch padded to the busiest expert when the router spreads the rows evenly; when it does not, buckets of
    experts with about as many rows (2^L..2^(L+1)-1 rows: bucket L, padded to its own largest count), so the
    padding at most doubles the work, at the price of gathering the used experts' weights."""
    E, n = counts.shape[0], rows.shape[0]
    ids = torch.repeat_interleave(torch.arange(E, device=rows.device), counts, output_size=n)
    pos = torch.arange(n, device=rows.device) - (torch.cumsum(counts, 0) - counts)[ids]
    used = counts > 0
    level = torch.where(used, torch.log2(counts.clamp(min=1).float()).floor().long(), 0)
    caps = torch.zeros(2, 64, dtype=counts.dtype, device=rows.device)
    caps[0].scatter_reduce_(0, level[used], counts[used], "amax")
    caps[1].scatter_add_(0, level[used], torch.ones_like(counts[used]))
    caps, sizes = caps.tolist()  # one host sync
    buckets = [(L, c, m) for L, (c, m) in enumerate(zip(caps, sizes)) if c]
    n_used, busiest = sum(sizes), max(caps)
    # in rows computed, gathering an expert's weights costs about 16 (measured on CPU at Nano's widths); one batch
    # gathers them only when some experts are unused
    if n_used * busiest + 16 * n_used * (n_used < E) <= sum(c * m for _, c, m in buckets) + 16 * n_used:
        slot = (torch.cumsum(used, 0) - 1)[ids]
        if n_used < E:
            up, down = up[used], down[used]
        x = rows.new_zeros(n_used, busiest, rows.shape[-1]).index_put((slot, pos), rows)
        a = act(F.relu(torch.bmm(x, up.transpose(-1, -2))).square())  # [used, busiest, d_ff]
        if observe is not None:
            observe(a[slot, pos])
        return torch.bmm(a, down.transpose(-1, -2))[slot, pos]
    out = rows.new_zeros(n, down.shape[1])
    hidden = rows.new_empty(n, up.shape[1]) if observe is not None else None
    # the used experts' weights gathered once, bucket after bucket, and split: the backward then adds into one
    # zero gradient per side, not one of all the experts' size per bucket
    order = torch.argsort(torch.where(used, level, 64), stable=True)[:n_used]
    sizes = [m for _, _, m in buckets]
    ups, downs = up.index_select(0, order).split(sizes), down.index_select(0, order).split(sizes)
    for (L, cap, _), w_up, w_down in zip(buckets, ups, downs):
        mine = used & (level == L)
        slot = torch.cumsum(mine, 0) - 1
        sel = torch.nonzero(mine[ids]).squeeze(1)
        at = (slot[ids[sel]], pos[sel])
        x = rows.new_zeros(len(w_up), cap, rows.shape[-1]).index_put(at, rows[sel])
        a = act(F.relu(torch.bmm(x, w_up.transpose(-1, -2))).square())  # [experts, cap, d_ff]
        if hidden is not None:
            hidden = hidden.index_copy(0, sel, a[at])
        out = out.index_copy(0, sel, torch.bmm(a, w_down.transpose(-1, -2))[at])
    if observe is not None:
        observe(hidden)
    return out


_NO_GROUPED: set = set()  # (device type, dtype) where torch._grouped_mm was refused: the padded form from then on


def _grouped_here(rows, counts, up) -> bool:
    """Where torch._grouped_mm runs the experts: on CUDA; on CPU for 16-byte aligned rows (its kernel refuses
    others) where it beats the padded form. Its CPU kernel pays a fixed cost per expert of the layer, used or not
    (about 1.7 us a side at one thread); the padded form pays for its padding and for copying the used experts'
    weights. So: when the experts average 8 rows or more, or the used experts hold 1,024 weights or more per
    expert of the layer (a training step's expert products at Nano's widths: 33 vs 100 ms at one thread, 27 vs
    68 ms at two; a decode step over 512 experts of 32 x 32 stays padded, 5x faster there)."""
    if rows.device.type == "cuda":
        return True
    if rows.device.type != "cpu" or any(n * rows.element_size() % 16 for n in (rows.shape[-1], up.shape[1])):
        return False
    experts = counts.shape[0]
    return rows.shape[0] >= 8 * experts or int((counts > 0).sum()) * up.shape[1] * up.shape[2] >= 1024 * experts


def expert_mlps(rows, counts, up, down, act=None, observe=None) -> torch.Tensor:
    """Every expert's squared-ReLU MLP over its rows (`rows` sorted by expert, `counts` [experts] per expert;
    `up` [experts, d_ff, width], `down` [experts, width, d_ff]) -> [rows, width], in autocast's dtype when it
    is on. One grouped GEMM per side (torch._grouped_mm) where `_grouped_here`; elsewhere, or where it is refused
    (dtype, GPU generation), the padded batched form. `act` transforms the hidden rows between the two
    (activation fake-quantization); `observe` sees them [rows, d_ff]."""
    act = act or (lambda a: a)
    dt = _dtype(rows, up)
    rows, up, down = rows.to(dt), up.to(dt), down.to(dt)
    key = (rows.device.type, dt)
    if key not in _NO_GROUPED and _grouped_here(rows, counts, up):
        try:
            return _grouped(rows, counts, up, down, act, observe)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError:
            _NO_GROUPED.add(key)
    return _padded(rows, counts, up, down, act, observe)


class RoutedExperts(nn.Module):
    """`up_proj` [experts, d_ff, width] and `down_proj` [experts, width, d_ff]; `forward(rows, counts)` runs
    each expert over its rows (sorted by expert, `counts` per expert) -> [rows, width]."""

    def __init__(self, experts: int, width: int, d_ff: int):
        super().__init__()
        self.up_proj = nn.Parameter(torch.empty(experts, d_ff, width))
        self.down_proj = nn.Parameter(torch.empty(experts, width, d_ff))

    def forward(self, rows: torch.Tensor, counts: torch.Tensor,
                act: Callable[[torch.Tensor], torch.Tensor] | None = None,
                observe: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """See `expert_mlps`."""
        return expert_mlps(rows, counts, self.up_proj, self.down_proj, act, observe)

    def mixture(self, h: torch.Tensor, chosen: torch.Tensor, w: torch.Tensor,
                    act: Callable[[torch.Tensor], torch.Tensor], decode: bool) -> torch.Tensor:
        """The mixture of the chosen experts (ids and weights [n, k]) in plain tensor ops without
        data-dependent shapes, for torch.export and ONNX: in a prefill every expert on every token (two batched
        MatMuls over the stacked weights, mixed by one [tokens, experts] product), in a decode step a gather of
        the chosen experts' weights. Each weight keeps the DequantizeLinear -> MatMul pattern TensorRT builds."""
        up, down, w = self.up_proj.to(h.dtype), self.down_proj.to(h.dtype), w.to(h.dtype)
        if decode:
            a = act(F.relu(torch.einsum("nw,nkfw->nkf", h, up[chosen])).square())
            return torch.einsum("nkf,nkwf,nk->nw", a, down[chosen], w)
        mix = torch.zeros(h.shape[0], up.shape[0], dtype=h.dtype, device=h.device).scatter(1, chosen, w)
        a = act(F.relu(torch.matmul(h, up.transpose(-1, -2))).square())  # [experts, n, d_ff]
        y = torch.matmul(a, down.transpose(-1, -2))  # [experts, n, width]
        return torch.bmm(mix[:, None], y.transpose(0, 1))[:, 0]
