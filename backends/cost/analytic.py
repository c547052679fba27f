"""The analytic roofline provider for GPU targets: its efficiencies and the per-kernel roofline.

Apart from the cost model: it prices one op at one shape; the calibration benchmark tunes `Efficiency`.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from ..targets import Target
from .precision import BYTES, MATH
from .provider import Deployment, PricedAhead


@dataclass(frozen=True)
class Efficiency:
    """Fractions of datasheet peaks a serving engine reaches, per kind of kernel, and fixed costs.

    One set for every target; docs/cost-model.md gives each value's source."""

    compute: float = 0.6  # dense GEMMs with many rows
    memory: float = 0.8  # streaming weight reads
    moe_half_tokens: float = 64.0  # tokens per expert at which a grouped GEMM reaches half of `compute`
    attention_compute: float = 0.75  # fused (flash) attention, prefill
    attention_memory: float = 0.5  # decode attention reading the (paged) KV cache
    mamba_compute: float = 0.2  # chunked SSD scan and causal conv, prefill
    mamba_memory: float = 0.25  # decode state update: reads and writes the SSM state (set on the calibration set)
    link: float = 0.41  # fraction of the (bidirectional) NVLink bandwidth a collective's bus bandwidth reaches
    launch_seconds: float = 6e-6  # per kernel in a captured graph: launch, ramp and tail (a floor for tiny ops)
    eager_launch_seconds: float = 12e-6  # per kernel of a decode step run eagerly (no CUDA graphs): host dispatch
    step_overhead_seconds: float = 30e-6  # scheduling, sampling, host work per step
    collective_latency_seconds: float = 6e-6  # per collective (all-reduce, all-to-all) over NVLink

    def moe(self, tokens_per_expert: float) -> float:
        """Grouped-GEMM compute efficiency at `tokens_per_expert` rows per expert: each expert's tile is
        filled in proportion, so t / (t + t_half) of `compute` (t_half: half a 128-row tile)."""
        t = tokens_per_expert
        return self.compute * t / (t + self.moe_half_tokens) if t > 0 else 0.0


#: op kind -> (compute, memory) attributes of Efficiency for its sequence kernel (what is not a GEMM)
KERNELS = {"attention": ("attention_compute", "attention_memory"), "mamba2": ("mamba_compute", "mamba_memory")}


class AnalyticProvider(PricedAhead):
    """A roofline per kernel on one device of a layout: GEMMs at the dense (or grouped-GEMM) efficiency,
    sequence kernels (attention, the SSM) at their own; plus launch floors and the layout's collectives."""

    def __init__(self, target: Target, efficiency: Efficiency | None = None):
        self.target, self.eff = target, efficiency or Efficiency()
        self._moe_memo: dict = {}
        self._expert_memo: dict = {}

    def describe(self) -> dict:
        """What the prices came from: recorded in plan.json and printed by `cost` and the report."""
        from .tables_db import own_figures_note

        note = own_figures_note(self.target, tables=False)
        return {"provider": "analytic", "efficiency": "backends/cost/analytic.py: Efficiency"} | (
            {"note": note} if note else {})

    def step_overhead(self) -> float:
        return self.eff.step_overhead_seconds

    def _roof(self, flops: float, nbytes: float, prec: str, compute: float, memory: float) -> float:
        t = self.target
        c = flops / (t.peak_flops[prec] * compute) if flops else 0.0
        return max(c, nbytes / (t.bandwidth * memory))

    def seconds(self, op, precisions, routing, batch, tokens, context, decode, d: Deployment) -> float:
        """One device's time for `op` when a replica runs `batch` sequences of `tokens` new tokens: each
        attention group runs its share of the sequences, the routed experts see every token of the replica."""
        if op.kind == "mtp":
            return self._mtp(op, precisions, routing, batch, tokens, context, decode, d)
        t, e, L = self.target, self.eff, d.layout
        b = L.requests_per_group(batch)
        if op.kind == "moe":
            w, dense = self._moe_work(op, b * tokens, routing)
        else:
            w = op.work(b, tokens, context, decode, d.kv_bytes, d.ssm_bytes, d.act_bytes, routing)
            dense = [k for k in w.weights if not k.startswith("mixer.experts.")]  # routed experts: `_routed`
        wbytes = {k: w.weights[k] * BYTES[precisions.get(k, "bf16")] for k in dense}
        flops, seconds = w.flops, 0.0
        if op.kind == "moe":
            flops -= b * tokens * op.top_k * 4 * op.expert_width * op.d_ff
            seconds += self._routed(op, precisions, routing, batch * tokens, d)
        elif op.kind in KERNELS:  # the sequence kernel apart from the projections
            gemm = _gemm_flops(op, b * tokens)
            seconds += self.sequence_seconds(op, w, b * tokens, decode, tokens, d)
            flops = min(flops, gemm)
        nbytes = sum(wbytes[k] / L.shards(op, k) for k in dense) + w.act * d.act_bytes / L.tp
        seconds += self._roof(flops / L.tp, nbytes, _math_precision(precisions, {k: w.weights[k] for k in dense}, t),
                              e.compute, e.memory)
        seconds += w.kernels * self.launch(decode, d)
        if op.is_block and op.kind != "noop":
            seconds += self.collective_seconds(op, b * tokens, d)
        return seconds

    def sequence_seconds(self, op, w, n: int, decode: bool, tokens: int, d: Deployment) -> float:
        """The sequence kernel of an attention or Mamba block (what is not a projection) over `n` tokens of one
        attention group, from its work `w`: FLOPs beyond the projections' and the state it reads and writes (a
        Mamba layer writes d + 1 states when verifying d drafts), at the kernel's own efficiencies."""
        L = d.layout
        kc, km = (getattr(self.eff, a) for a in KERNELS[op.kind])
        split = L.kv_shards(op) if op.kind == "attention" else L.tp
        written = w.state_write * (d.ssm_copies if op.kind == "mamba2" and decode and tokens > 1 else 1)
        return self._roof(max(w.flops - _gemm_flops(op, n), 0.0) / L.tp, (w.state_read + written) / split,
                          _sequence_precision(self.target), kc, km)

    def launch(self, decode: bool, d: Deployment) -> float:
        """The floor per kernel: in a captured graph, or (a decode step without CUDA graphs) a host launch each.
        Prefill keeps the graph floor: its kernels run far longer than a launch, so the floor does not bind."""
        return self.eff.launch_seconds if d.graphs or not decode else self.eff.eager_launch_seconds

    def _moe_work(self, op, tokens: int, routing):
        """A MoE's work at `tokens` tokens from its work at one (FLOPs and activations are linear in the tokens;
        the experts' touched reads are priced apart, in `_routed`): the same numbers, without rebuilding a
        thousand-entry weight table for every batch a search tries."""
        key = (op, None if routing is None else tuple(routing))
        if key not in self._moe_memo:
            one = op.work(1, 1, 0, True, 0.0, 0.0, 0.0, routing)
            self._moe_memo[key] = one, [k for k in one.weights if not k.startswith("mixer.experts.")]
        one, dense = self._moe_memo[key]
        return dataclasses.replace(one, flops=tokens * one.flops, act=tokens * one.act), dense

    def _expert_bytes(self, op, precisions) -> tuple[list, np.ndarray]:
        """Each routed expert's parameter names and stored bytes, once per spec and precision table (the cost
        model shares one table per recipe and layer spec; the entry holds it, so its id is not reused)."""
        key = (op, id(precisions))
        hit = self._expert_memo.get(key)
        if hit is None or hit[0] is not precisions:
            names = [[f"mixer.experts.{j}.up_proj.weight", f"mixer.experts.{j}.down_proj.weight"]
                     for j in range(op.experts)]
            hit = self._expert_memo[key] = (precisions, names, np.array([
                op.d_ff * op.expert_width * sum(BYTES[precisions.get(k, "bf16")] for k in pair) for pair in names]))
        return hit[1:]

    def _routed(self, op, precisions, routing, tokens: int, d: Deployment) -> float:
        """The routed experts as one grouped GEMM on each device of the replica: the FLOPs split evenly, the
        reads those of the experts the device holds that some token chose (with ep > 1, the busiest device's)."""
        if not tokens:
            return 0.0
        t, e, L = self.target, self.eff, d.layout
        names, sizes = self._expert_bytes(op, precisions)
        p = self._touched(op, tokens, routing)
        if L.ep == 1:
            reads = float(p @ sizes) / L.group
        else:  # whole experts per device: the step waits for the device whose experts were chosen most
            parts = np.array_split(np.arange(op.experts), L.ep)
            mean = max(float(p[i] @ sizes[i]) for i in parts)
            spread = max(float((p[i] * (1 - p[i])) @ sizes[i] ** 2) for i in parts) ** 0.5
            reads = min(mean + spread * math.sqrt(2 * math.log(L.ep)), max(float(sizes[i].sum()) for i in parts))
            reads /= L.group // L.ep
        flops = tokens * op.top_k * 4 * op.expert_width * op.d_ff / L.group
        prec = _math_precision(precisions, {k: 1.0 for k in names[0]}, t)
        return max(flops / (t.peak_flops[prec] * e.moe(tokens * op.top_k / op.experts)) if flops else 0.0,
                   reads / (t.bandwidth * e.memory))

    @staticmethod
    def _touched(op, tokens: int, routing) -> np.ndarray:
        """`op.touched` as an array, computed on the array (512 experts at every batch a search tries)."""
        f = np.full(op.experts, op.top_k / op.experts) if routing is None else np.asarray(routing, dtype=np.float64)
        return 1.0 - (1.0 - np.minimum(f, 1.0)) ** tokens

    def _mtp(self, op, precisions, routing, batch, tokens, context, decode, d: Deployment) -> float:
        """One pass of the MTP head: the fusion (eh_proj and norms) as a GEMM, then each of its blocks."""
        e, L = self.eff, d.layout
        b = L.requests_per_group(batch)
        n, h = b * tokens, op.hidden
        fusion = 2 * h * h * BYTES[precisions.get("layers.0.eh_proj.weight", "bf16")] / L.tp + n * 5 * h * d.act_bytes
        out = self._roof(n * (4 * h * h + 12 * h) / L.tp, fusion, _sequence_precision(self.target), e.compute,
                         e.memory) + 3 * self.launch(decode, d)
        for i, blk in enumerate(op.blocks):
            sub = {k.split(".", 2)[2]: v for k, v in precisions.items() if k.startswith(f"layers.{i}.")}
            out += self.seconds(blk, sub, None if routing is None else routing.get(i), batch, tokens, context,
                                decode, d)
        return out

    def collective_seconds(self, op, tokens: int, d: Deployment) -> float:
        """The block's collectives on one device of an attention group handling `tokens` tokens: an all-reduce
        of the output over the tensor-parallel devices (for a MoE without attention data parallel, one that
        sums routed and shared experts over the replica); with attention data parallel a MoE also sends its
        tokens' k routed copies at the expert width to the experts' devices and back (two all-to-alls)."""
        e, L = self.eff, d.layout
        link = self.target.interconnect_bandwidth * e.link
        out = 0.0
        if L.tp > 1:
            out += 2 * (L.tp - 1) / L.tp * tokens * op.hidden * d.act_bytes / link + e.collective_latency_seconds
        if op.kind == "moe" and L.dp > 1:
            sent = (L.group - 1) / L.group * tokens / L.tp * op.top_k * op.expert_width * d.act_bytes
            out += 2 * (sent / link + e.collective_latency_seconds)
        return out


def _gemm_flops(op, n: int) -> float:
    """The projections' FLOPs of a block over `n` tokens: every matrix parameter once per token."""
    return 2 * n * sum(math.prod(s) for s in op.params().values() if len(s) == 2)


def _sequence_precision(target: Target) -> str:
    """Attention and SSM kernels run in BF16 (FP8 KV is dequantised in the kernel)."""
    return "bf16" if target.supports("bf16") else target.precisions[0]


def _math_precision(precisions: dict, weights: dict, target: Target) -> str:
    """Matmuls run at the precision of the largest weights when the target has it, else bf16."""
    if not weights:
        return _sequence_precision(target)
    biggest = max(weights, key=lambda k: weights[k])
    p = precisions.get(biggest, "bf16")
    p = MATH.get(p, p)
    if target.supports(p):
        return p
    return _sequence_precision(target)
