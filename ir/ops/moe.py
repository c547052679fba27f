"""Mixture-of-experts block: sigmoid router with selection bias, top-k, squared-ReLU experts, one shared expert."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .base import Axis, Block, OpSpec, RMSNorm, Work, dense_weights, full_precision, positive, relu2
from .routed import RoutedExperts


@dataclass(frozen=True)
class MoE(OpSpec):
    kind = "moe"
    letter = "E"
    is_block = True
    hidden: int
    experts: int
    top_k: int
    d_ff: int
    shared_d_ff: int
    latent: int = 0  # 0: experts work in the hidden width
    scaling: float = 1.0
    norm_topk: bool = True
    eps: float = 1e-5

    @property
    def expert_width(self) -> int:
        return self.latent or self.hidden

    def params(self):
        w = self.expert_width
        p = {
            "norm.weight": (self.hidden,),
            "mixer.gate.weight": (self.experts, self.hidden),
            "mixer.gate.e_score_correction_bias": (self.experts,),
        }
        for j in range(self.experts):
            p[f"mixer.experts.{j}.up_proj.weight"] = (self.d_ff, w)
            p[f"mixer.experts.{j}.down_proj.weight"] = (w, self.d_ff)
        if self.shared_d_ff:
            p["mixer.shared_experts.up_proj.weight"] = (self.shared_d_ff, self.hidden)
            p["mixer.shared_experts.down_proj.weight"] = (self.hidden, self.shared_d_ff)
        if self.latent:
            p["mixer.fc1_latent_proj.weight"] = (self.latent, self.hidden)
            p["mixer.fc2_latent_proj.weight"] = (self.hidden, self.latent)
        return p

    def active_params(self):
        return super().active_params() - (self.experts - self.top_k) * 2 * self.d_ff * self.expert_width

    def fp32_params(self):
        return frozenset({"mixer.gate.weight", "mixer.gate.e_score_correction_bias"})

    def check(self):
        out = super().check() + positive(self, "hidden", "experts", "top_k", "d_ff")
        if self.top_k > self.experts:
            out.append(("top_k", f"top_k={self.top_k} exceeds experts={self.experts}"))
        if self.shared_d_ff < 0:
            out.append(("shared_d_ff", f"must be >= 0, got {self.shared_d_ff}"))
        return out

    def touched(self, routed_tokens: int, routing=None) -> list[float]:
        """Probability that each expert is used by at least one of `routed_tokens` tokens.

        routing: per-expert selection frequencies (summing to top_k), measured on calibration data;
        None assumes uniform routing (each expert chosen by a token with probability top_k / experts).
        """
        f = routing if routing is not None else [self.top_k / self.experts] * self.experts
        return [1.0 - (1.0 - min(1.0, p)) ** routed_tokens for p in f]

    def work(self, batch: int, tokens: int, context: int, decode: bool, kv_bytes: float, ssm_bytes: float,
             act_bytes: float, routing=None) -> Work:
        n = batch * tokens
        w = self.expert_width
        weights = {}
        touched = self.touched(n, routing)
        for k, elems in dense_weights(self).items():
            j = int(k.split(".")[2]) if k.startswith("mixer.experts.") else None
            weights[k] = elems if j is None else elems * touched[j]
        flops = n * (2 * self.hidden * self.experts + self.top_k * 4 * w * self.d_ff + 4 * self.hidden * self.shared_d_ff
                     + 4 * self.hidden * self.latent + 4 * self.hidden)
        act = n * (2 * self.hidden + self.top_k * (2 * w + self.d_ff) + self.shared_d_ff + 2 * self.latent)
        return Work(flops, weights, act, kernels=6 if self.latent else 4)

    def build(self):
        return Block(self, RMSNorm(self.hidden, self.eps), MoEMixer(self))

    def axes(self):
        """Routed experts (router rows and bias follow), expert d_ff (one list, or one per expert),
        shared-expert d_ff, top-k (no weights change) and the latent width."""
        out = {"d_ff": Axis(self.d_ff, per_unit="experts"), "top_k": Axis(self.top_k, ranked=False)}
        if self.shared_d_ff:
            out["shared_d_ff"] = Axis(self.shared_d_ff)
        if self.latent:
            out["latent"] = Axis(self.latent)
        return out | {"experts": Axis(self.experts)}

    def _shrink(self, axis, keep, w):
        n, E = keep.shape[-1], self.experts
        ex = lambda j, side: f"mixer.experts.{j}.{side}_proj.weight"
        if axis == "top_k":
            return self.resized(axis, n), w
        if axis == "experts":
            if self.top_k > n:
                raise ValueError(f"experts: keeping {n} experts is below top_k={self.top_k}; lower top_k first")
            old = {j: (w.pop(ex(j, "up")), w.pop(ex(j, "down"))) for j in range(E)}
            for new, j in enumerate(keep.tolist()):
                w[ex(new, "up")], w[ex(new, "down")] = old[j]
            for k in ("mixer.gate.weight", "mixer.gate.e_score_correction_bias"):
                w[k] = w[k][keep]
            return self.resized(axis, n), w
        if axis == "d_ff":
            rows = keep if keep.dim() == 2 else keep.expand(E, n)
            if rows.shape[0] != E:
                raise ValueError(f"d_ff: one row of indices per expert ({E}), got {rows.shape[0]}")
            for j in range(E):
                w[ex(j, "up")], w[ex(j, "down")] = w[ex(j, "up")][rows[j]], w[ex(j, "down")][:, rows[j]]
            return self.resized(axis, n), w
        if axis == "shared_d_ff":
            up, down = "mixer.shared_experts.up_proj.weight", "mixer.shared_experts.down_proj.weight"
            w[up], w[down] = w[up][keep], w[down][:, keep]
            return self.resized(axis, n), w
        for j in range(E):  # latent: the experts' input columns and output rows
            w[ex(j, "up")], w[ex(j, "down")] = w[ex(j, "up")][:, keep], w[ex(j, "down")][keep]
        w["mixer.fc1_latent_proj.weight"] = w["mixer.fc1_latent_proj.weight"][keep]
        w["mixer.fc2_latent_proj.weight"] = w["mixer.fc2_latent_proj.weight"][:, keep]
        return self.resized(axis, n), w


class _Router(nn.Module):
    def __init__(self, experts: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(experts, hidden))
        self.register_buffer("e_score_correction_bias", torch.zeros(experts))


class _MLP(nn.Module):
    def __init__(self, width: int, d_ff: int):
        super().__init__()
        self.up_proj = nn.Linear(width, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, width, bias=False)

    def forward(self, x):
        return self.down_proj(relu2(self.up_proj(x)))


class MoEMixer(nn.Module):
    """Routes with the op's own top-k; each expert runs only over the tokens routed to it.

    The routed experts are one module (`RoutedExperts`: stacked weights). Eager runs sort the (token, choice)
    pairs by expert and run them through batched products over the stacked weights (`expert_outputs`; a grouped
    GEMM where it wins, `routed.expert_mlps`): the work is what routing chose, top-k of every token, whatever the
    number of experts, and no Python loop per expert. The ONNX export asks for `export_form` instead
    (`RoutedExperts.mixture`). Both give the same result.
    """

    mode_aware = True

    def __init__(self, spec: MoE):
        super().__init__()
        s = self.spec = spec
        self.gate = _Router(s.experts, s.hidden)
        self.experts = RoutedExperts(s.experts, s.expert_width, s.d_ff)
        if s.shared_d_ff:
            self.shared_experts = _MLP(s.hidden, s.shared_d_ff)
        if s.latent:
            self.fc1_latent_proj = nn.Linear(s.hidden, s.latent, bias=False)
            self.fc2_latent_proj = nn.Linear(s.latent, s.hidden, bias=False)
        self.export_form = False

    def scores(self, x):
        """x [n, hidden] -> (router scores, selection scores) [n, experts] in float32."""
        with full_precision(x):
            scores = torch.sigmoid(F.linear(x.float(), self.gate.weight.float()))
        return scores, scores + self.gate.e_score_correction_bias.float()

    def combine(self, picked):
        """The chosen experts' router scores [n, k] -> their mixing weights (renormalised, scaled)."""
        s = self.spec
        w = picked / (picked.sum(-1, keepdim=True) + 1e-20) if s.norm_topk else picked
        return w * s.scaling

    def route(self, x, bias=None):
        """x [n, hidden] -> (chosen expert ids [n, k], their weights [n, k]) in float32. `bias` [experts] is
        added to the selection scores only."""
        scores, select = self.scores(x)
        chosen = torch.topk(select if bias is None else select + bias, self.spec.top_k, dim=-1).indices
        return chosen, self.combine(scores.gather(1, chosen))

    def _act(self, side: str, x):
        """Fake-quantises the routed experts' inputs when the program quantises their activations."""
        acts = self.__dict__.get("expert_act")
        if not acts or side not in acts:
            return x
        from ..quant.formats import fake_quantize

        return fake_quantize(x, acts[side], getattr(self, f"input_scale_{side}"))

    def expert_outputs(self, h, chosen, observe=None):
        """h [n, width] through each token's chosen experts (ids [n, k]) -> [n, k, width].

        The (token, choice) pairs are sorted by expert and every expert runs over its rows in the routed experts'
        batched products (`routed.expert_mlps`), with and without gradients. `observe(expert_ids, x, a)` sees
        every routed row at once, sorted by expert: its expert, its input [rows, width] and its hidden activation
        [rows, d_ff] (activation calibration, importance statistics)."""
        n, k = chosen.shape
        ids = chosen.reshape(-1)
        order = ids.argsort(stable=True)
        counts = torch.bincount(ids, minlength=self.spec.experts)
        rows = h[order // k]
        seen = None if observe is None else (lambda a: observe(ids[order], rows, a))
        done = self.experts(rows, counts, lambda a: self._act("down", a), seen)
        return done.new_empty(done.shape).index_copy(0, order, done).reshape(n, k, -1)

    def _record(self, ids, x, a):
        """Folds one call's per-expert amax of the inputs and hidden activations into the calibration."""
        stats, E = self.__dict__["calib"], self.spec.experts
        for side, v in (("up", x), ("down", a)):
            got = torch.zeros(E, device=v.device).scatter_reduce(0, ids, v.detach().abs().amax(-1).float(), "amax")
            stats[side] = torch.maximum(stats[side], got) if side in stats else got

    def forward(self, x, decode: bool = False):
        s = self.spec
        flat = x.reshape(-1, s.hidden)
        chosen, w = self.route(flat)
        h = self._act("up", self.fc1_latent_proj(flat) if s.latent else flat)
        if self.export_form:
            y = self.experts.mixture(h, chosen, w, lambda a: self._act("down", a), decode)
        else:
            calibrating = "calib" in self.__dict__  # activation calibration: per expert, over its tokens
            out = self.expert_outputs(h, chosen, self._record if calibrating else None)
            y = (out.float() * w[..., None]).sum(1).to(h.dtype)  # mixed in float32 (no autocast on mul, sum)
        if s.latent:
            y = self.fc2_latent_proj(y)
        y = y.reshape(x.shape)
        if s.shared_d_ff:
            y = y + self.shared_experts(x)
        return y
