"""Importance: which units of every block matter, from activation statistics on calibration text.

Minitron-style statistics, one per prunable axis (docs/puzzle.md gives the reasoning):
- MLP / expert / shared-expert d_ff: mean |a_i| at the down-projection input times ||W_down[:, i]||
  (experts: over the tokens routed to each);
- attention query heads: the mean norm of each head's contribution through o_proj, ranked within its KV
  group; KV groups: the sum over their query heads;
- Mamba heads: the mean norm of each head's contribution through out_proj (after the gate and the grouped
  norm), ranked within its group; head_dim: the mean |y| per channel times its out_proj column norm;
  SSM state channels: the mean |B_n * C_n| (after the conv), the same-token part of the state's
  contribution C_t . h_t, ranked within the group;
- experts: the damage of removing one with re-routing (its router score set to -inf, the native top-k
  and renormalisation choose again): the normalised squared change of the routed output; also the
  routing frequencies; latent channels: |input| x up-weights + |output| x ||fc2 column||.
Ranks are stored (most important first), not scores.
"""
from __future__ import annotations

import torch

from ...ir import Program
from ...ir.ops.base import relu2
from ..core import AnalysisManager, analysis


def _ranks(score: torch.Tensor, groups: int = 1) -> list:
    """Unit indices by descending score; with groups, one list of within-group indices per group."""
    if groups == 1:
        return torch.argsort(score.double(), descending=True, stable=True).tolist()
    return [torch.argsort(g.double(), descending=True, stable=True).tolist() for g in score.reshape(groups, -1)]


class _Sums:
    """Running sums of named statistics over calibration batches."""

    def __init__(self):
        self.sums: dict[str, torch.Tensor] = {}

    def add(self, key: str, value: torch.Tensor) -> None:
        value = value.detach().double()
        self.sums[key] = self.sums[key] + value if key in self.sums else value


def _mlp_stats(mixer, h, acc: _Sums, prefix: str = "") -> None:
    a = relu2(mixer.up_proj(h)).reshape(-1, mixer.up_proj.out_features)
    acc.add(prefix + "a", a.abs().sum(0))
    acc.add(prefix + "n", torch.tensor(float(a.shape[0])))


def _moe_stats(mixer, h, acc: _Sums) -> None:
    """Routing frequencies, per-expert d_ff activity over its routed tokens, and each expert's removal damage.

    Removing expert e (its selection score at -inf) changes only the tokens that chose it: their top-k becomes
    the top-(k+1) without e, renormalised. So every token runs through its top-(k+1) experts once (routed, as
    the forward runs them), and each removal is a recombination of those outputs: (k+1)/k of the forward's
    expert work, instead of every expert on every token once per expert."""
    s = mixer.spec
    flat = h.reshape(-1, s.hidden)
    lat = mixer.fc1_latent_proj(flat) if s.latent else flat
    scores, select = mixer.scores(flat)
    spare = min(s.top_k + 1, s.experts)
    ranked = torch.topk(select, spare, dim=-1).indices  # [n, k+1]: the chosen experts, then the next one
    picked = scores.gather(1, ranked)
    order = ranked.reshape(-1).argsort(stable=True)  # expert_outputs' order of the (token, choice) rows
    routed = (torch.arange(spare, device=flat.device) < s.top_k).repeat(flat.shape[0])[order]  # a top-k slot?
    d_ff = torch.zeros(s.experts, s.d_ff, dtype=torch.float64, device=flat.device)

    def observe(ids, x, a):  # every routed row at once, sorted by expert; the spare choice counts for nothing
        d_ff.index_add_(0, ids, (a.abs() * routed[:, None]).double())
    out = mixer.expert_outputs(lat, ranked, observe).float()  # [n, k+1, width]
    k = s.top_k
    y = (out[:, :k] * mixer.combine(picked[:, :k])[..., None]).sum(1)
    chosen = torch.zeros(flat.shape[0], s.experts, device=flat.device).scatter(1, ranked[:, :k], 1.0)
    acc.add("routing", chosen.sum(0))
    acc.add("tokens", torch.tensor(float(flat.shape[0])))
    acc.add("d_ff", d_ff)
    acc.add("y2", y.pow(2).sum())
    damage = torch.zeros(s.experts, dtype=torch.float64, device=flat.device)
    for slot in range(k):  # the slot's expert removed: the others and the next one, renormalised
        rest = [i for i in range(spare) if i != slot]
        y_without = (out[:, rest] * mixer.combine(picked[:, rest])[..., None]).sum(1)
        damage.index_add_(0, ranked[:, slot], (y_without - y).pow(2).sum(-1).double())
    acc.add("damage", damage)
    if s.latent:
        acc.add("lat_in", lat.abs().sum(0))
        acc.add("lat_out", y.abs().sum(0))
    if s.shared_d_ff:
        _mlp_stats(mixer.shared_experts, flat, acc, "shared_")


def _attention_stats(mixer, y_heads, acc: _Sums) -> None:
    s = mixer.spec
    y = y_heads.reshape(-1, s.q_heads, s.head_dim)
    wo = mixer.o_proj.weight.reshape(s.hidden, s.q_heads, s.head_dim)
    contrib = torch.einsum("nqd,hqd->nqh", y, wo).norm(dim=-1)  # [n, q_heads]
    acc.add("heads", contrib.sum(0))
    acc.add("n", torch.tensor(float(y.shape[0])))


def _mamba_state_stats(mixer, proj, acc: _Sums) -> None:
    s = mixer.spec
    inner, gn = s.inner, s.groups * s.state
    xbc = proj[..., inner:inner + s.conv_dim].transpose(1, 2)  # [b, conv_dim, t]
    conv, _ = mixer.causal_conv(xbc, xbc.new_zeros(xbc.shape[0], s.conv_dim, s.conv - 1))  # a fresh sequence
    b, c = conv[:, inner:inner + gn], conv[:, inner + gn:]
    acc.add("state", (b * c).abs().sum((0, 2)))


def _mamba_head_stats(mixer, y, acc: _Sums) -> None:
    """What each head and channel sends through out_proj (after the gate and the grouped norm)."""
    s = mixer.spec
    yh = y.reshape(-1, s.heads, s.head_dim)
    wo = mixer.out_proj.weight.reshape(s.hidden, s.heads, s.head_dim)
    acc.add("heads", torch.einsum("nhp,ohp->nho", yh, wo).norm(dim=-1).sum(0))
    acc.add("head_dim", (yh.abs() * wo.norm(dim=0)).sum((0, 1)))
    acc.add("n", torch.tensor(float(yh.shape[0])))


def _ranks_of(op, acc: dict[str, torch.Tensor], mixer) -> dict:
    """Axis -> ranks (see Axis for the layout of grouped and per-unit axes)."""
    kind = op.kind
    if kind == "mlp":
        return {"d_ff": _ranks(acc["a"] / acc["n"] * mixer.down_proj.weight.norm(dim=0).double())}
    if kind == "attention":
        heads = acc["heads"] / acc["n"]
        return {"q_heads": _ranks(heads, op.kv_heads), "kv_heads": _ranks(heads.reshape(op.kv_heads, -1).sum(1))}
    if kind == "mamba2":
        return {"heads": _ranks(acc["heads"], op.groups), "head_dim": _ranks(acc["head_dim"]),
                "state": _ranks(acc["state"], op.groups)}
    if kind != "moe":
        return {}
    down_norm = mixer.experts.down_proj.norm(dim=1).double()  # [E, d_ff]
    used = acc["routing"].clamp(min=1)[:, None]
    out = {"experts": _ranks(acc["damage"] / acc["y2"].clamp(min=1e-30)),
           "d_ff": [_ranks(row) for row in acc["d_ff"] / used * down_norm],
           "top_k": list(range(op.top_k))}
    if op.shared_d_ff:
        w = mixer.shared_experts.down_proj.weight.norm(dim=0).double()
        out["shared_d_ff"] = _ranks(acc["shared_a"] / acc["shared_n"] * w)
    if op.latent:
        up_norm = mixer.experts.up_proj.pow(2).sum((0, 1)).sqrt().double()
        fc2 = mixer.fc2_latent_proj.weight.norm(dim=0).double()
        out["latent"] = _ranks((acc["lat_in"] * up_norm + acc["lat_out"] * fc2) / acc["tokens"])
    return out


def _hooks(node, mixer, acc: _Sums) -> list:
    """Registers the hooks that feed `acc` for this block kind; returns their handles."""
    kind = node.op.kind
    if kind == "mamba2":
        return [mixer.in_proj.register_forward_hook(lambda m, a, out: _mamba_state_stats(mixer, out, acc)),
                mixer.out_proj.register_forward_pre_hook(lambda m, a: _mamba_head_stats(mixer, a[0], acc))]
    if kind == "attention":
        return [mixer.o_proj.register_forward_pre_hook(lambda m, a: _attention_stats(mixer, a[0], acc))]
    fn = _moe_stats if kind == "moe" else _mlp_stats
    return [mixer.register_forward_pre_hook(lambda m, a: fn(mixer, a[0], acc))]


class ImportanceStats:
    """Importance measured during a sweep (backends.torch.stream): `attach` hooks each block's mixer while the
    block runs over the calibration windows and turns the sums into ranks when it is done, so the statistics
    of a model larger than memory are gathered one layer at a time."""

    def __init__(self):
        self.layers: dict[str, dict] = {}
        self.routing: dict[str, list] = {}

    def attach(self, node, module):
        if not (node.op.is_block and node.op.axes()):
            return None
        acc, mixer = _Sums(), module.mixer
        handles = _hooks(node, mixer, acc)

        def finish():
            for h in handles:
                h.remove()
            self.layers[node.path] = _ranks_of(node.op, acc.sums, mixer)
            if node.op.kind == "moe":
                self.routing[node.path] = (acc.sums["routing"] / acc.sums["tokens"]).tolist()
        return finish

    def result(self, windows: torch.Tensor) -> dict:
        return {"layers": self.layers, "routing": self.routing, "tokens": int(windows.numel())}


def compute_importance(prog: Program, windows: torch.Tensor, batch: int = 4, compute=None,
                       progress: bool | str = False) -> dict:
    """{"layers": {path: {axis: ranks}}, "routing": {path: per-expert frequency}, "tokens": n}. On
    `compute`'s device and within its memory budget, always in float32: statistics summed over many tokens
    decide close ranks. `progress`: lines on stderr as layers finish (eta.Remaining)."""
    from ...backends.torch.device import CPU, Compute
    from ...backends.torch.stream import StreamedProgram
    from ...eta import Remaining

    compute = compute or CPU
    stats = ImportanceStats()
    stream = StreamedProgram(prog, Compute(compute.device, memory=compute.memory))
    left = Remaining("importance", len(prog.blocks()), progress=progress)
    for node, _, _ in stream.sweep(windows, batch, attach=stats.attach):
        left.done(node.op.is_block)
    return stats.result(windows)


@analysis("importance")
def importance(prog: Program, am: AnalysisManager, samples: int = 32, seq: int = 256, data: tuple = (),
               device: str = "cpu") -> dict:
    """Ranks of every prunable unit (see passes.puzzle.importance) on `samples` calibration windows."""
    from ...backends.torch.device import resolve
    from ...text.data import calibration_windows
    from ..manager import reporting

    return compute_importance(prog, calibration_windows(list(data), samples, seq, prog), compute=resolve(device),
                              progress=reporting(am))
