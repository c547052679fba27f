"""The measured-tables provider: GPU prices from NVIDIA's measured kernel tables (aiconfigurator-core).

Each block is priced as aiconfigurator-core's own NemotronH model composes one layer of its kind (norm, GEMMs,
router, latent projections, shared and routed experts, attention at the KV dtype, all-reduce and MoE dispatch),
but with this layer's own shapes and on the layout's degrees, from the tables of the engine that serves it.
What the tables do not measure is priced by puzzlekit's own terms (the analytic provider), each named in
`explain`: the Mamba-2 scan, conv and state update (the tables have only a roofline for them, without the
state's traffic), noop and linear blocks, the MTP head's fusion, precisions a GPU's tables lack (NVFP4 on
Hopper, weight-only formats). A routed-expert shape off the tables is priced at the nearest measured shape,
scaled by puzzlekit's grouped-GEMM term (the library's own borrow keeps the time of a measured top-k whatever
the top-k). The tables themselves (loading, measured shapes, evaluation) are tables_db.py's; prices are kept
between runs (price_cache.py).
"""
from __future__ import annotations

import dataclasses

from ...errors import PuzzlekitError
from ..layout import Layout
from ..targets import Target
from .analytic import AnalyticProvider, Efficiency
from .precision import BYTES, MATH
from .price_cache import kept_prices
from .provider import Deployment, PricedAhead
from .tables_db import DATABASES, LIBRARY_VERSION, MODE, SYSTEMS, Tables, missing, own_figures_note, system_of

#: engine profile -> the tables of the engine serving it (`all`: TensorRT-LLM's, the most complete for NemotronH)
BACKENDS = {"tensorrt-llm": "trtllm", "vllm": "vllm", "sglang": "sglang", "all": "trtllm", "none": "trtllm"}
#: puzzlekit's own terms beside the tables: the Mamba-2 state update's efficiency is set on the calibration set
#: (benchmarks/calibration.py --prices tables --fit mamba_memory), the rest are the analytic provider's
TABLE_EFFICIENCY = Efficiency(mamba_memory=0.75)
GEMM_Q = {"bf16": "bfloat16", "fp16": "bfloat16", "fp32": "bfloat16", "fp8": "fp8", "nvfp4": "nvfp4"}

MEASURED, BORROWED, ROOFLINE, EMPIRICAL, ESTIMATED, OURS = (
    "measured", "borrowed from a nearby shape", "roofline", "empirical formula", "estimated from measured parts",
    "puzzlekit's term")
_SOURCE = {"silicon": MEASURED, "mixed": MEASURED, "sol": ROOFLINE, "empirical": EMPIRICAL, "estimated": ESTIMATED}


#: the decode curves' batches (requests per attention group): every one to 8, then 2^(1/4) apart, to 2^20
_GRID = sorted(set(range(1, 9)) | {round(2 ** (3 + i / 4)) for i in range(4 * 17 + 1)})


def _grid_index(b: int) -> int:
    """The last grid batch at or below `b`."""
    from bisect import bisect_right

    return bisect_right(_GRID, b) - 1


def _call(b: int, tokens: int, context: int, decode: bool) -> tuple:
    """The tables' (batch_size, s, prefix) for `b` requests of one attention group: in decode, b x tokens
    queries at the KV length; in prefill, b requests of `tokens` after `context` cached."""
    return (b * tokens, context + tokens, 0) if decode else (b, tokens, context)


#: per op kind, a part's role -> the parameter whose storage format the part's GEMM runs in
_ROLES = {
    "mamba2": {"in_proj": "mixer.in_proj.weight", "out_proj": "mixer.out_proj.weight"},
    "attention": {"qkv": "mixer.q_proj.weight", "proj": "mixer.o_proj.weight"},
    "mlp": {"up": "mixer.up_proj.weight", "down": "mixer.down_proj.weight"},
    "moe": {"experts": "mixer.experts.0.up_proj.weight", "shared_up": "mixer.shared_experts.up_proj.weight",
            "shared_down": "mixer.shared_experts.down_proj.weight", "fc1_latent": "mixer.fc1_latent_proj.weight",
            "fc2_latent": "mixer.fc2_latent_proj.weight"},
    "linear": {"linear": "mixer.linear.weight"},
    "lm_head": {"logits": "weight"},
}


def _formats(op, precisions: dict) -> tuple:
    """The storage formats a block's parts compute in (a handful of lookups, not its thousand parameters); for
    the MTP head, its fusion's and each of its blocks'."""
    if op.kind == "mtp":
        return (("eh_proj", precisions.get("layers.0.eh_proj.weight", "bf16")),) + tuple(
            (f"{i}.{role}", precisions.get(f"layers.{i}.{name}", "bf16")) for i, blk in enumerate(op.blocks)
            for role, name in _ROLES.get(blk.kind, {}).items())
    return tuple((role, precisions.get(name, "bf16")) for role, name in _ROLES.get(op.kind, {}).items())


class TablesProvider(PricedAhead):
    """Prices ops from the measured tables of one GPU and one engine (see the module docstring)."""

    def __init__(self, target: Target, engine: str = "tensorrt-llm", efficiency: Efficiency | None = None):
        why = missing()
        if why:
            raise PuzzlekitError(f"measured tables: {why}; or price with --prices analytic")
        self.system = system_of(target)
        if not self.system:
            raise PuzzlekitError(f"measured tables cover {', '.join(SYSTEMS)} and their nodes, not {target.name}; "
                                 "price it with --prices analytic")
        if engine not in BACKENDS:
            raise PuzzlekitError(f"engine {engine!r}: the tables know {', '.join(BACKENDS)}")
        from aiconfigurator_core.sdk import common, errors, operations

        self.C, self.O = common, operations
        self.errors = (errors.PerfDataNotAvailableError, errors.EmpiricalNotImplementedError,
                       errors.MissingSystemFlopsError, errors.InterpolationDataNotAvailableError,
                       errors.SolNotImplementedError)
        self.target, self.engine, self.backend = target, engine, BACKENDS[engine]
        self.tables = Tables(self.system, self.backend)
        self.own = AnalyticProvider(target, efficiency or TABLE_EFFICIENCY)
        self._parts: dict = {}  # (op, formats, decode, deployment) -> its parts
        self._priced: dict = {}  # (parts key, batch, s, prefix) -> [(part, seconds, source)], or why not
        self._anchor_term: dict = {}  # (anchor spec, tokens, deployment) -> puzzlekit's term there
        self._expert_prec: dict = {}
        self._curves: dict = {}  # (op, formats, routing, tokens, context, deployment) -> running maxima on _GRID
        self._steps: dict = {}  # (op, formats, routing, batch, tokens, context, deployment) -> a prefill's seconds
        self._alike: dict = {}  # (deployment, expert parallel) -> the deployment an op's time depends on
        self.kept = kept_prices(f"tables-{self.system}-{self.backend}", repr((
            LIBRARY_VERSION, DATABASES[self.backend], MODE, self.target, self.own.eff)))

    @property
    def handle(self):
        return self.tables.handle

    def describe(self) -> dict:
        """What the prices came from: recorded in plan.json and printed by `cost` and the report."""
        note = own_figures_note(self.target, tables=True)
        return {"provider": "tables", "library": f"aiconfigurator-core {LIBRARY_VERSION}", "system": self.system,
                "engine": self.engine, "database": f"{self.backend} {DATABASES[self.backend]}", "mode": MODE,
                "own_terms": {"mamba_memory": self.own.eff.mamba_memory, "mamba_compute": self.own.eff.mamba_compute},
                **({"note": note} if note else {})}

    # -- the Provider interface ---------------------------------------------------------------------------------
    def step_overhead(self) -> float:
        return self.own.step_overhead()

    def seconds(self, op, precisions, routing, batch, tokens, context, decode, d: Deployment) -> float:
        """The op's time; a decode step's on a curve in the requests per attention group, monotone by
        construction: the tables' running maximum at grid batches (every one to 8, then 2^(1/4) apart),
        linear between them. The tables interpolate their own grids, which dips by ~1% past some knots, and
        the search's batch bisection needs time that does not fall as the batch grows."""
        d = self._priced_on(op, d)
        if not decode:
            key = (op, _formats(op, precisions), None if routing is None else tuple(routing), batch, tokens,
                   context, d)
            if key not in self._steps:
                self._steps[key] = self.kept.get(key)
                if self._steps[key] is None:  # not kept from an earlier run: priced, and kept
                    self._steps[key] = self._sum(op, precisions, routing, batch, tokens, context, decode, d)
                    self.kept.put(key, self._steps[key])
            return self._steps[key]
        L = d.layout
        b = L.requests_per_group(batch)
        i = _grid_index(b)
        lo, hi = _GRID[i], _GRID[min(i + 1, len(_GRID) - 1)]
        key = (op, _formats(op, precisions), None if routing is None else tuple(routing), tokens, context, d)
        curve = self._curves.get(key)
        if curve is None:
            curve = self._curves[key] = list(self.kept.get(key) or [])
        if len(curve) <= min(i + 1, len(_GRID) - 1):
            while len(curve) <= min(i + 1, len(_GRID) - 1):  # the running maximum, grid point by grid point
                g = _GRID[len(curve)]
                curve.append(max(curve[-1] if curve else 0.0,
                                 self._sum(op, precisions, routing, g * L.dp, tokens, context, True, d)))
            self.kept.put(key, curve)
        if b == lo or hi == lo:
            return curve[i] * b / lo if b > lo else curve[i]  # past the grid: in proportion
        return curve[i] + (curve[i + 1] - curve[i]) * (b - lo) / (hi - lo)

    def _priced_on(self, op, d: Deployment) -> Deployment:
        """The deployment as far as one device's time for `op` goes: the replicas never matter and expert
        parallelism only to a MoE (or the MTP head holding one), so layouts alike there share every memo and kept
        price (the 13 layouts of 8 GPUs price a Mamba layer on 5)."""
        L = d.layout
        ep = L.ep if op.kind in ("moe", "mtp") else 1
        if L.replicas == 1 and L.ep == ep:
            return d
        key = (d, ep)
        if key not in self._alike:
            self._alike[key] = dataclasses.replace(d, layout=Layout(tp=L.tp, dp=L.dp, ep=ep))
        return self._alike[key]

    def _sum(self, op, precisions, routing, batch, tokens, context, decode, d: Deployment) -> float:
        return sum(s for _, s, _ in self.explain(op, precisions, routing, batch, tokens, context, decode, d))

    def explain(self, op, precisions, routing, batch, tokens, context, decode, d: Deployment) -> list[tuple]:
        """(part, seconds, source) of one device's time for `op`, as `seconds` sums them."""
        d = self._priced_on(op, d)
        if op.kind == "mtp":
            return self._mtp(op, precisions, routing, batch, tokens, context, decode, d)
        if op.kind == "noop":
            return []
        L = d.layout
        b = L.requests_per_group(batch)
        if op.kind == "lm_head" and not decode:  # a prefill scores its last position only (as the library)
            batch, tokens, context, decode = b * L.dp, 1, context + tokens - 1, True
            b = L.requests_per_group(batch)
        key = (op, _formats(op, precisions), decode, d)
        parts = self._parts.get(key)
        if parts is None:
            parts = self._parts[key] = self._build(op, dict(key[1]), L, decode, d)
        priced = (key, *_call(b, tokens, context, decode))
        if priced not in self._priced:
            try:
                self._priced[priced] = self._evaluate(parts, decode, *priced[1:], d)
            except self.errors as e:  # a table without the shape and nothing to transfer from: why, once
                self._priced[priced] = str(e).split(":", 1)[0]
        out = self._priced[priced]
        if isinstance(out, str):  # the whole block is puzzlekit's term
            return [("whole block", self.own.seconds(op, precisions, routing, batch, tokens, context, decode, d),
                     f"{OURS} (the tables: {out})")]
        if op.kind == "mamba2":  # the scan / state update and the conv: puzzlekit's terms
            w = op.work(b, tokens, context, decode, d.kv_bytes, d.ssm_bytes, d.act_bytes)
            out = out + [("mamba_conv_ssm", self.own.sequence_seconds(op, w, b * tokens, decode, tokens, d)
                          + 2 * self.own.launch(decode, d), OURS)]
        return out

    # -- building a block's parts --------------------------------------------------------------------------------
    def _build(self, op, fmts: dict, L: Layout, decode: bool, d: Deployment) -> list[tuple]:
        """(name, what prices it) as the library's NemotronH model composes one layer of this kind, with this
        layer's shapes, on this layout: a table op, ("own", seconds per tokens) or ("scaled", ...)."""
        O, C, h, tp = self.O, self.C, op.hidden, L.tp
        norm = ("norm", O.ElementWise("norm", 1, 2 * h, 2 * h, 0.8))
        ar = ("all_reduce", O.CustomAllReduce("all_reduce", 1, h, tp))
        gemm = lambda role, n, k, **kw: (role, self._gemm(role, n, k, fmts.get(role, "bf16"), d, **kw))  # noqa
        if op.kind == "mamba2":
            heads = op.heads // tp
            return [norm, gemm("in_proj", 2 * heads * op.head_dim + 2 * max(op.groups // tp, 1) * op.state + heads, h),
                    gemm("out_proj", h, heads * op.head_dim), ar]
        if op.kind == "attention":
            kv = -(-op.kv_heads // tp)
            kvq = C.KVCacheQuantMode.fp8 if d.kv_bytes == 1 else C.KVCacheQuantMode.bfloat16
            fmha = C.FMHAQuantMode.fp8 if d.kv_bytes == 1 else C.FMHAQuantMode.bfloat16
            q = op.q_heads // tp
            attn = O.GenerationAttention("attention", 1, q, kv, kvq, head_size=op.head_dim) if decode else \
                O.ContextAttention("attention", 1, q, kv, kvq, fmha, head_size=op.head_dim)
            return [norm, gemm("qkv", (q + 2 * kv) * op.head_dim, h), ("attention", attn),
                    gemm("proj", h, q * op.head_dim, low_precision_input=True), ar]
        if op.kind == "mlp":
            f = op.d_ff // tp
            return [norm, gemm("up", f, h), ("relu2", O.ElementWise("relu2", 1, f, f, 0.8)), gemm("down", h, f), ar]
        if op.kind == "moe":
            return self._moe(op, fmts, L, decode, d, norm, ar, gemm)
        if op.kind == "linear":
            return [norm, gemm("linear", h // tp, h), ar]
        if op.kind == "embed":
            return [("embedding", O.Embedding("embedding", 1, op.vocab, h, 0.3))]
        if op.kind == "norm":
            return [norm]
        if op.kind == "lm_head":
            return [gemm("logits", op.vocab // tp, h)]
        raise PuzzlekitError(f"the measured tables price no {op.kind} op; price with --prices analytic")

    def _moe(self, op, fmts: dict, L: Layout, decode: bool, d: Deployment, norm, ar, gemm) -> list[tuple]:
        O, h, tp, w = self.O, op.hidden, L.tp, op.expert_width
        parts = [norm]
        if op.shared_d_ff:
            sd = op.shared_d_ff // tp
            parts += [gemm("shared_up", sd, h), ("shared_relu2", O.ElementWise("shared_relu2", 1, sd, sd, 0.8)),
                      gemm("shared_down", h, sd, low_precision_input=True)]
        parts.append(("router", O.GEMM("router", 1, op.experts, h, self.C.GEMMQuantMode.bfloat16)))
        if op.latent:
            parts.append(gemm("fc1_latent", op.latent // tp, h))
        fmt = fmts.get("experts", "bf16")
        mq, moe_tp, moe_ep = self._quant("MoEQuantMode", fmt), L.group // L.ep, L.ep
        if mq is None:  # no table for the format: puzzlekit's grouped-GEMM term
            parts.append(("experts", ("own", lambda m: self.own._routed(op, self._experts_at(op.experts, fmt), None,
                                                                         m * L.dp, d))))
        else:
            dispatch = lambda name, pre: (name, O.MoEDispatch(  # noqa: E731
                name, 1, w, op.top_k, op.experts, moe_tp, moe_ep, L.dp, pre, quant_mode=mq, backend=self.backend))
            make = lambda k, e, w_, f, t, p: O.MoE(  # noqa: E731
                "experts", 1, w_, f, k, e, t, p, mq, "power_law_1.01", L.dp, is_context=not decode, is_gated=False)
            shape = (op.top_k, op.experts, w, op.d_ff, moe_tp, moe_ep)
            anchor = self.tables.anchor(mq, shape)
            if anchor in (None, shape):
                experts = make(*shape)
            else:  # the nearest measured shape, times puzzlekit's term at this shape over at that one
                k, e, w_, f, t, p = anchor
                spec = dataclasses.replace(op, top_k=k, experts=e, d_ff=f, **({"latent": w_} if op.latent else
                                                                                {"hidden": w_}))
                at = dataclasses.replace(d, layout=Layout(tp=t * p, ep=p))  # moe tp t, ep p
                here = self._experts_at(op.experts, fmt)
                there = self._experts_at(e, fmt)
                experts = ("scaled", anchor, make(*anchor),
                           lambda m: self.own._routed(op, here, None, m * L.dp, d)
                           / max(self._term_at(spec, there, m * L.dp, at), 1e-30))
            parts += [dispatch("moe_pre_dispatch", True), ("experts", experts), dispatch("moe_post_dispatch", False)]
        if op.latent:
            parts.append(gemm("fc2_latent", h, op.latent // tp, low_precision_input=True))
        return parts + [ar]

    def _term_at(self, spec, precisions: dict, tokens: int, at: Deployment) -> float:
        """puzzlekit's grouped-GEMM term at an anchor: shared by every cut priced from it."""
        key = (spec, id(precisions), tokens, at)
        if key not in self._anchor_term:
            self._anchor_term[key] = self.own._routed(spec, precisions, None, tokens, at)
        return self._anchor_term[key]

    def _experts_at(self, experts: int, fmt: str) -> dict:
        """Every routed expert's parameters in one format (puzzlekit's term reads them by name)."""
        key = (experts, fmt)
        if key not in self._expert_prec:
            self._expert_prec[key] = {f"mixer.experts.{j}.{m}_proj.weight": fmt
                                      for j in range(experts) for m in ("up", "down")}
        return self._expert_prec[key]

    def _quant(self, enum: str, fmt: str):
        """The tables' mode for a storage format, or None where they have none (weight-only formats; NVFP4
        on a GPU without FP4 math)."""
        q = GEMM_Q.get(fmt)
        if q is None or (q == "nvfp4" and not self.target.supports("nvfp4")):
            return None
        return getattr(getattr(self.C, enum), q)

    def _gemm(self, role: str, n: int, k: int, fmt: str, d: Deployment, **kw):
        q = self._quant("GEMMQuantMode", fmt)
        if q is not None:
            return self.O.GEMM(role, 1, n, k, q, **kw)
        own, e, bytes_ = self.own, self.own.eff, BYTES[fmt]
        prec = MATH.get(fmt, fmt) if self.target.supports(MATH.get(fmt, fmt)) else "bf16"
        return ("own", lambda m: own._roof(2 * m * n * k, n * k * bytes_ + m * (n + k) * d.act_bytes, prec,
                                           e.compute, e.memory) + e.launch_seconds)

    # -- pricing ------------------------------------------------------------------------------------------------
    def _evaluate(self, parts, decode: bool, batch_size: int, s: int, prefix: int, d: Deployment) -> list:
        """Each part's seconds and source: the table ops in one call, the experts in their own (their
        provenance says whether the table had the shape; an anchor's price is shared by every cut of it)."""
        m = batch_size if decode else batch_size * s  # tokens of one attention group
        shape = (not decode, batch_size, s, prefix)
        table, singles = self.tables.ops_json(parts)
        out = [None] * len(parts)
        for i, (_, ms, _, src) in zip(table[0], self.tables.run(table[1], shape) if table[0] else []):
            out[i] = (parts[i][0], ms / 1e3, _SOURCE.get(src, src))
        for i, (name, o) in enumerate(parts):
            if out[i] is not None:
                continue
            if not isinstance(o, tuple):  # the experts at their own shape
                (_, ms, _, src), borrowed = self.tables.run_one(singles[i], shape)
                out[i] = (name, ms / 1e3, BORROWED if borrowed else _SOURCE.get(src, src))
            elif o[0] == "own":
                out[i] = (name, o[1](m), OURS)
            else:  # ("scaled", anchor, its op, ratio)
                (_, ms, _, src), _ = self.tables.run_one(singles[i], shape)
                k, e, w, f, t, p = o[1]
                out[i] = (name, ms / 1e3 * o[3](m), f"measured at top-{k} of {e} experts, width {w}, d_ff {f}, "
                          f"moe tp{t}.ep{p}; scaled by puzzlekit's term")
        return out

    def _mtp(self, op, precisions, routing, batch, tokens, context, decode, d: Deployment) -> list[tuple]:
        """The MTP head: its fusion (eh_proj) as a GEMM, then each of its blocks."""
        L = d.layout
        b = L.requests_per_group(batch)
        fmt = precisions.get("layers.0.eh_proj.weight", "bf16")
        key = ("mtp.eh_proj", op.hidden, fmt, d)
        if key not in self._parts:
            self._parts[key] = [("mtp.eh_proj", self._gemm("eh_proj", op.hidden // L.tp, 2 * op.hidden, fmt, d))]
        out = self._evaluate(self._parts[key], decode, *_call(b, tokens, context, decode), d)
        for i, blk in enumerate(op.blocks):
            sub = {k.split(".", 2)[2]: v for k, v in precisions.items() if k.startswith(f"layers.{i}.")}
            out += [(f"mtp.{name}", s, src) for name, s, src in
                    self.explain(blk, sub, None if routing is None else routing.get(i), batch, tokens, context,
                                 decode, d)]
        return out
