"""`CostModel`: prices one program on one target, scenario and parallel layout through a provider.

Memory (weights, state, reserve), step times and the largest batch meeting the scenario; the layout search is
in layouts.py.
"""
from __future__ import annotations

import math

from ...errors import PuzzlekitError
from ...ir import Program
from ..layout import Layout, shard_class
from ..measured import MeasuredProvider
from ..targets import Target, get_target
from .precision import BYTES, RecipePrecisions
from .prices import describe, provider_for
from .provider import Deployment, Provider
from .report import CostReport
from .scenario import Scenario


#: (recipe, op, path signature) -> its stored bytes per sharding class (`CostModel._bytes`)
_CLASS_BYTES: dict = {}


class CostModel:
    """Prices one program on one target, scenario and parallel layout (`best_layout` tries them all).

    Batches are per replica: a replica of `layout` serves `batch` requests, `layout.dp` attention groups
    a share each; memory is checked on one device."""

    def __init__(self, prog: Program, target: Target | str, scenario: Scenario, provider: Provider | None = None,
                 routing: dict | None = None, layout: Layout | str | None = None):
        self.prog = prog
        self.target = get_target(target) if isinstance(target, str) else target
        self.scenario = scenario.check()
        self.layout = _layout_for(self.target, self.scenario, layout)
        if self.target.kind == "cpu" and provider is None:
            provider = MeasuredProvider()
        self.provider = provider or provider_for(self.target)
        if self.scenario.mtp_draft and self.provider.measures:
            raise PuzzlekitError("speculative decoding is priced on GPU targets; the measured cpu provider times "
                                 "plain decoding only: drop --mtp, or price a GPU target")
        self.routing = routing if routing is not None else prog.meta.get("routing", {})
        s = self.scenario
        self.act_b, self.kv_b, self.ssm_b = BYTES[s.act_dtype], BYTES[s.kv_dtype], BYTES[s.ssm_dtype]
        self.deployment = Deployment(self.layout, self.act_b, self.kv_b, self.ssm_b, s.mtp_draft + 1, s.cuda_graphs)
        self._node_memo: dict = {}
        self._prec = RecipePrecisions(self.scenario.recipe)
        self._static_memo: dict = {}  # what a node's figures owe nothing to the batch: priced once per layout
        self.precisions = {n.path: self._prec.of(n.path, n.op) for n in prog.nodes}
        self._prec_keys = {n.path: self._prec.token(n.path, n.op) for n in prog.nodes}
        self._memo: dict = {}  # identical layers (same spec, precisions, routing) are priced once per shape
        self._activation = None
        self._device_weight_total = None

    def _resident(self, op) -> bool:
        """Whether a node's weights and state are in memory: the MTP head only when serving drafts with it."""
        return op.kind != "mtp" or self.scenario.mtp_resident or self.scenario.mtp_draft > 0

    # -- what a step runs ---------------------------------------------------------------------------------------
    def decode_parts(self, op, batch: int, context: int) -> list[tuple]:
        """(batch, tokens, context, decode, times) of each run of `op` in one decode step of a replica at
        `batch`. With d drafted tokens: the head runs d times, the trunk verifies d + 1 tokens per request, and
        the LM head scores the d + 1 positions and each draft."""
        d = self.scenario.mtp_draft
        if op.kind == "mtp":
            return [(batch, 1, context, True, d)] if d else []
        if not d:
            return [(batch, 1, context, True, 1)]
        if op.kind == "lm_head":
            return [(batch * (d + 1), 1, context, True, 1), (batch, 1, context, True, d)]
        return [(batch, d + 1, context, True, 1)]

    def prefill_parts(self, op, tokens: int | None = None) -> list[tuple]:
        """The runs of `op` in one prefill round: one request per attention group (with drafting, the head
        reads the prompt too)."""
        if op.kind == "mtp" and not self.scenario.mtp_draft:
            return []
        return [(self.layout.dp, tokens or self.scenario.input_len, 0, False, 1)]

    def check_priceable(self, context: int | None = None) -> None:
        """Raises now what pricing the scenario would raise later (the measured provider refuses a prefill or
        a decode state it cannot time here), so that a long run is refused before it starts."""
        ctx = context or self.scenario.decode_context
        self.provider.check([(n.op, *p[:4]) for n in self.prog.nodes
                             for p in self.prefill_parts(n.op) + self.decode_parts(n.op, 1, ctx)])

    def prepare(self, ops, batch: int, context: int | None = None) -> None:
        """Prices `ops` (a search's variants and the parent's ops) together before `node_costs` asks for them
        one by one, so the measured provider's times compare like with like."""
        if not self.provider.measures:  # an analytic price needs no round together
            return
        ctx = context or self.scenario.decode_context
        ops = list(dict.fromkeys(ops))
        items = [(op, *p[:4]) for op in ops for p in self.decode_parts(op, batch, ctx) + self.prefill_parts(op)]
        if self.provider.prepare(list(dict.fromkeys(items))):
            self._memo.clear()
            self._node_memo.clear()
            self._static_memo.clear()

    def node_costs(self, path: str, op, batch: int, context: int | None = None, routing=None) -> dict:
        """What a node with spec `op` at `path` adds to the program's figures: decode step at `batch` (at the
        scenario's mean decode context, or at `context` when given), prefill of the scenario's input, the
        serving step (decode plus its share of prefills: `serve_seconds`), one device's weight and per-request
        state bytes (state at the full context, or `context`), parameters. The program's figures are the sum
        of its nodes' plus a per-step overhead, which is how the search prices variants."""
        key = (op, batch, context, None if routing is None else tuple(routing), self._prec.signature(path))
        if key not in self._node_memo:  # the same variant in many layers is priced once
            self._node_memo[key] = self._node_costs(path, op, batch, context, routing)
        return self._node_memo[key]

    def _node_costs(self, path: str, op, batch: int, context, routing) -> dict:
        prec, key, static = self._static(path, op, context, routing)
        decode = self._runs(op, prec, routing, self.decode_parts(op, batch, context or self.scenario.decode_context),
                            key)
        return {"decode_seconds": decode, "prefill_seconds": static["prefill_seconds"],
                "serve_seconds": decode + self.prefill_share(batch) * static["prefill_seconds"],
                **{k: v for k, v in static.items() if k != "prefill_seconds"}}

    def _static(self, path: str, op, context, routing) -> tuple[dict, tuple, dict]:
        """A node's precisions and the figures that do not depend on the batch (prefill, bytes, parameters),
        once per layout: the search prices every batch it tries."""
        mkey = (op, context, None if routing is None else tuple(routing), self._prec.signature(path))
        if mkey not in self._static_memo:
            prec = self._prec.of(path, op)
            key = self._prec.token(path, op)
            resident = self._resident(op)
            self._static_memo[mkey] = (prec, key, {
                "prefill_seconds": self._runs(op, prec, routing, self.prefill_parts(op), key),
                "weight_bytes": self._bytes(path, op, shard=True) if resident else 0.0,
                "state_bytes": self.layout.state_bytes(op, self.kv_b, self.ssm_b, self.act_b,
                                                       context or self.scenario.context_len,
                                                       self.deployment.ssm_copies) if resident else 0.0,
                "params": op.param_count(), "active_params": op.active_params()})
        return self._static_memo[mkey]

    def prefill_share(self, batch: int) -> float:
        """Prefill rounds per decode step in steady state: each user of an attention group finishes a request
        (and a new one is prefilled) every `output_len / tokens_per_step` steps."""
        s = self.scenario
        return batch / self.layout.dp * self.tokens_per_step / s.output_len if s.output_len else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens each user gets per decode step: the MTP head's acceptance length when drafting, else 1."""
        return self.scenario.mtp_acceptance if self.scenario.mtp_draft else 1.0

    def step_overhead(self) -> float:
        return self.provider.step_overhead()

    # memory
    def _bytes(self, path: str, op, shard: bool = False) -> float:
        """A node's stored weight bytes (one device's share with `shard`): summed per sharding class once per
        spec and recipe, for every layout (a 512-expert MoE has a thousand tensors), then split as this
        layout splits each class."""
        key = (self.scenario.recipe, op, self._prec.signature(path))
        per = _CLASS_BYTES.get(key)
        if per is None:
            prec, per = self._prec.of(path, op), {}
            for k, shape in op.params().items():
                c = shard_class(op, k)
                per[c] = per.get(c, 0.0) + math.prod(shape) * BYTES[prec[k]]
            _CLASS_BYTES[key] = per
        return sum(b / self.layout.class_shards(c) if shard else b for c, b in per.items())

    def weight_bytes(self) -> float:
        """The whole model's weights (one copy)."""
        return sum(self._bytes(n.path, n.op) for n in self.prog.nodes if self._resident(n.op))

    def device_weight_bytes(self) -> float:
        """The weights one device holds (summed once: a report asks at every batch it tries)."""
        if self._device_weight_total is None:
            self._device_weight_total = sum(self._bytes(n.path, n.op, shard=True)
                                            for n in self.prog.nodes if self._resident(n.op))
        return self._device_weight_total

    def _state(self, op, context: int) -> float:
        """One request's state of `op` (all of it; a Mamba layer's SSM copies when drafting)."""
        return op.state_bytes(self.kv_b, self.ssm_b, self.act_b, context) * \
            (self.deployment.ssm_copies if op.kind == "mamba2" else 1)

    def state_bytes_per_request(self, context: int | None = None) -> float:
        c = self.scenario.context_len if context is None else context
        return sum(self._state(n.op, c) for n in self.prog.nodes if self._resident(n.op))

    def device_state_bytes(self, context: int | None = None) -> float:
        """One request's state on one device of its attention group (KV heads replicated past tp > KV heads)."""
        c = self.scenario.context_len if context is None else context
        return sum(self.layout.state_bytes(n.op, self.kv_b, self.ssm_b, self.act_b, c, self.deployment.ssm_copies)
                   for n in self.prog.nodes if self._resident(n.op))

    def activation_bytes(self) -> float:
        """The activation peak of one prefill chunk: the largest op's inputs, outputs and intermediates
        (`Work.act`) at `prefill_chunk` tokens, held on every device."""
        if self._activation is None:
            tokens = min(self.scenario.prefill_chunk, self.scenario.input_len)
            ops = {n.op for n in self.prog.nodes if n.op.kind != "mtp"}  # identical layers once
            self._activation = max((op.work(1, tokens, 0, False, self.kv_b, self.ssm_b, self.act_b).act * self.act_b
                                    for op in ops), default=0.0)
        return self._activation

    def reserve_bytes(self) -> float:
        """Memory one device keeps from weights and state: the runtime's workspace plus the activation peak."""
        return self.scenario.workspace_bytes + self.activation_bytes()

    def usable_memory(self) -> float:
        """One device's memory for weights and state."""
        return self.target.memory_bytes - self.reserve_bytes()

    def memory_available(self) -> float:
        """One device's memory for state, after its weights."""
        return self.usable_memory() - self.device_weight_bytes()

    def max_requests(self) -> int:
        """Requests one replica holds: every attention group fills its devices with state."""
        avail, state = self.memory_available(), self.device_state_bytes()
        per_group = int(max(0, avail) // state) if state > 0 else (10**9 if avail > 0 else 0)
        return per_group * self.layout.dp

    # time
    def _runs(self, op, precisions, routing, parts, prec_key=None) -> float:
        return sum(times * self._priced(op, precisions, routing, *shape, prec_key) for *shape, times in parts)

    def _step(self, decode: bool, batch: int, context: int, tokens: int | None = None) -> tuple[float, dict]:
        runs = [(n, self.decode_parts(n.op, batch, context) if decode else self.prefill_parts(n.op, tokens))
                for n in self.prog.nodes]
        self.provider.prefetch(list(dict.fromkeys((n.op, *p[:4]) for n, parts in runs for p in parts)))
        per_kind: dict[str, float] = {}
        total = self.provider.step_overhead()
        for n, parts in runs:
            sec = self._runs(n.op, self.precisions[n.path], self.routing.get(n.path), parts, self._prec_keys[n.path])
            if parts:
                per_kind[n.op.kind] = per_kind.get(n.op.kind, 0.0) + sec
            total += sec
        return total, per_kind

    def _priced(self, op, precisions, routing, batch, tokens, context, decode, prec_key=None) -> float:
        key = (op, prec_key or tuple(precisions.items()), None if routing is None else tuple(routing), batch, tokens,
               context, decode)
        if key not in self._memo:
            self._memo[key] = self.provider.seconds(op, precisions, routing, batch, tokens, context, decode,
                                                    self.deployment)
        return self._memo[key]

    def decode_step_seconds(self, batch: int, context: int | None = None) -> float:
        return self._step(True, batch, self.scenario.decode_context if context is None else context)[0]

    def prefill_seconds(self, tokens: int | None = None) -> float:
        """One prefill round: a request of `tokens` (the scenario's input) on each attention group."""
        return self._step(False, 1, 0, tokens)[0]

    def serve_seconds(self, batch: int) -> float:
        """One serving step of a replica at `batch`: a decode step plus its share of the prefills that replace
        finished requests (chunked prefill interleaved with decoding). Users see tokens_per_step / this
        tokens/s; the server replicas x batch x tokens_per_step / this."""
        return self.decode_step_seconds(batch) + self.prefill_share(batch) * self.prefill_seconds()

    def throughput(self, batch: int, serve: float) -> float:
        return self.layout.replicas * batch * self.tokens_per_step / serve

    def check_whole_model(self, batch: int = 1, tolerance: float = 0.15) -> dict:
        """Measured provider: the whole model (a decode step at `batch` and the mean decode context, a prefill
        of the input) timed in the same turns as its ops, against their sum. When the times the model was
        priced with (cached or earlier) differ from these fresh ones by more than `tolerance`, the cache is
        dropped and the fresh times replace it. Returns the fresh predicted and measured figures, their ratio,
        and whether the earlier times were replaced."""
        if not self.provider.measures:
            raise PuzzlekitError(f"a whole-model check measures this machine; {self.target.name} is priced "
                                 "analytically (use the cpu target)")
        s = self.scenario
        before = (self.decode_step_seconds(batch), self.prefill_seconds())
        ops = list(dict.fromkeys(n.op for n in self.prog.nodes if n.op.kind != "mtp"))
        shapes = ((batch, 1, s.decode_context, True), (1, s.input_len, 0, False))
        items = [(op, *sh) for sh in shapes for op in ops]
        runs = self.provider.model_runs(self.prog, batch, s.decode_context, s.input_len)
        fresh, measured = self.provider.measure_together(items, runs)
        by_op = dict(zip(items, fresh))
        pred = [self.provider.step_overhead() + sum(by_op[(n.op, *sh)] for n in self.prog.nodes if n.op.kind != "mtp")
                for sh in shapes]
        drift = [b / p for b, p in zip(before, pred)]
        retimed = any(abs(d - 1) > tolerance for d in drift) and not self.provider.pinned  # a pinned table stays
        if retimed:
            self.provider.invalidate(f"the times priced earlier were {drift[0]:.2f}x (decode) and {drift[1]:.2f}x "
                                     f"(prefill) the whole-model check's, beyond {tolerance:.0%}")
            self.provider.store(items, fresh)  # the check's own times, taken with the whole model
        self._memo.clear()
        self._node_memo.clear()
        self._static_memo.clear()
        return {"decode": {"predicted": pred[0], "measured": measured[0], "ratio": pred[0] / measured[0]},
                "prefill": {"predicted": pred[1], "measured": measured[1], "ratio": pred[1] / measured[1]},
                "retimed": retimed}

    def best_batch(self, prefill: float | None = None) -> tuple[int, str, str]:
        """The largest batch per replica meeting the rate floor within memory, the concurrency and the
        provider's bound: (batch, binding, why infeasible)."""
        s, L = self.scenario, self.layout
        prefill = self.prefill_seconds() if prefill is None else prefill
        max_req = self.max_requests()
        limit = min(max_req, math.ceil(s.concurrency / L.replicas)) if s.concurrency else max_req
        serving = lambda b: self.decode_step_seconds(b) + self.prefill_share(b) * prefill  # noqa: E731
        ok = (lambda b: True) if s.rate_floor <= 0 else \
            (lambda b: self.tokens_per_step / serving(b) >= s.rate_floor)
        cap = min(self.provider.max_batch,
                  self.provider.batch_limit([n.op for n in self.prog.nodes if n.op.kind != "mtp"], s.context_len))
        if limit < 1:
            return 0, "memory", (f"memory: {self.device_weight_bytes() / 1e9:.1f} GB of weights and one request's "
                                 f"{self.device_state_bytes() / 1e9:.2f} GB of state per device; "
                                 f"{self.usable_memory() / 1e9:.1f} GB usable on each {self.target.name.split('x')[-1]}"
                                 f" of layout {L} after a {self.reserve_bytes() / 1e9:.1f} GB reserve")
        if not ok(1):
            return 0, "rate floor", (f"rate floor: {s.rate_floor:g} tokens/s per user wanted, batch 1 reaches "
                                     f"{self.tokens_per_step / serving(1):.1f} in layout {L}")
        lo, hi = 1, min(limit, cap)
        while lo < hi:  # serving time grows with the batch: the largest batch meeting the floor
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
        binding = ("rate floor" if lo < min(limit, cap) else "memory" if lo == max_req
                   else "concurrency" if s.concurrency and lo == limit else "compute")
        return lo, binding, ""

    def report(self) -> CostReport:
        s, L = self.scenario, self.layout
        prefill, per_kind_prefill = self._step(False, 1, 0)  # first: it may be refused (cpu)
        counts = self.prog.param_counts()
        best, binding, infeasible = self.best_batch(prefill)
        b = max(best, 1)
        step, per_kind_decode = self._step(True, b, s.decode_context)
        serve = step + self.prefill_share(b) * prefill
        if not all(math.isfinite(x) and x >= 0 for x in (step, prefill, *per_kind_decode.values())):
            raise PuzzlekitError(f"the cost model priced a step at {step} s and a prefill at {prefill} s on "
                                 f"{self.target.name}: not finite; check the target's numbers")
        max_req, state = self.max_requests(), self.device_state_bytes()
        rate = self.tokens_per_step / serve
        headroom = {"memory_bytes": self.memory_available() - L.requests_per_group(best) * state,
                    "requests": (max_req - best) * L.replicas,
                    "rate_tokens_per_second": rate - s.rate_floor if best else 0.0}
        by_kind = {}
        for n in self.prog.nodes:
            k = by_kind.setdefault(n.op.kind, {"count": 0, "weight_bytes": 0.0, "state_bytes_per_request": 0.0})
            k["count"] += 1
            if self._resident(n.op):
                k["weight_bytes"] += self._bytes(n.path, n.op)
                k["state_bytes_per_request"] += self._state(n.op, s.context_len)
        for kind, v in by_kind.items():
            v["decode_seconds"] = per_kind_decode.get(kind, 0.0)
            v["prefill_seconds"] = per_kind_prefill.get(kind, 0.0)
        return CostReport(self.target.name, s, counts["total"], counts["active"], self.weight_bytes(),
                          self.state_bytes_per_request(), self.reserve_bytes(), self.memory_available(),
                          max_req * L.replicas, best * L.replicas, step, self.decode_step_seconds(1), prefill, serve,
                          self.throughput(best, serve) if best else 0.0, binding, headroom, by_kind, infeasible,
                          str(L), self.tokens_per_step, rate if best else 0.0, self.device_weight_bytes(), state,
                          prices=describe(self.provider))


def shared_provider(target: Target, provider: Provider | None = None, prices: str | None = None,
                    engine: str = "all") -> Provider | None:
    """`provider`, else one provider for every layout of a GPU target, as `prices` chooses (prices.py; its memos
    are per op and precision, not per layout: a 512-expert MoE's tables are then built once, not once per
    layout); None for the cpu target, whose measured provider each cost model makes."""
    return provider or provider_for(target, prices, engine)


def _layout_for(target: Target, s: Scenario, layout) -> Layout:
    """The layout asked for (argument, then the scenario's), else tensor parallel over the devices used."""
    gpus = s.gpus or target.devices
    if gpus > target.devices:
        raise PuzzlekitError(f"scenario asks for {gpus} GPUs; target {target.name} has {target.devices}")
    layout = layout or s.layout
    if not layout:
        return Layout(tp=gpus)
    layout = Layout.parse(layout) if isinstance(layout, str) else layout.check()
    if layout.gpus != gpus and (s.gpus or layout.gpus > target.devices):
        raise PuzzlekitError(f"layout {layout} uses {layout.gpus} GPUs; the scenario uses {gpus} of {target.name}: "
                             f"give a layout of {gpus} GPUs, or --gpus {layout.gpus}")
    return layout
