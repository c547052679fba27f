"""The cost model: prices a Program on a target and a deployment scenario.

Each op reports hardware-independent work (ir/ops: `work`, `state_bytes`); a provider turns work
into seconds: the analytic roofline for GPUs, or timings measured on this machine for `cpu`.
Assumptions are listed in docs/cost-model.md.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path

import tomllib

from ..errors import PuzzlekitError
from ..ir import Program
from ..ir.quant.recipe import RECIPES, get_recipe
from .measured import MeasuredProvider
from .targets import Target, get_target

BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "nvfp4": 0.5 + 1 / 16,  # NVFP4: E4M3 scale per 16
         "fp8-weight": 1.0, "nvfp4-weight": 0.5 + 1 / 16}
SCENARIOS_FILE = Path(__file__).with_name("scenarios.toml")


# -- scenarios -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Scenario:
    name: str = "custom"
    input_len: int = 2048
    output_len: int = 512
    rate_floor: float = 0.0  # tokens/s each user must see; 0: no floor
    context: int = 0  # tokens of state per request; 0: input_len + output_len
    concurrency: int = 0  # requests to serve at once; 0: as many as fit
    kv_dtype: str = "bf16"
    ssm_dtype: str = "fp32"
    act_dtype: str = "bf16"
    recipe: str = ""  # weight precisions by recipe name; "": the program's own (bf16 unless quantized)
    gpus: int = 0  # devices used (tensor parallel); 0: all of the target's
    workspace_bytes: float = 4 * 2**30  # per device: CUDA context, library workspaces, graphs, comm buffers
    prefill_chunk: int = 8192  # tokens prefilled per step; sets the activation peak kept free
    mtp_resident: bool = False  # the MTP head's weights and state loaded (serving with speculative decoding)

    @property
    def context_len(self) -> int:
        """The state a request holds at its end: what memory must fit."""
        return self.context or self.input_len + self.output_len

    @property
    def decode_context(self) -> int:
        """The mean context of the requests in a decode batch: in steady state they are spread evenly
        over their outputs, so a step costs what the middle of a request costs (attention is linear in
        the context). An explicit `context` holds every request at that context."""
        return self.context or self.input_len + self.output_len // 2

    def check(self):
        for k in ("kv_dtype", "ssm_dtype", "act_dtype"):
            if getattr(self, k) not in BYTES:
                raise PuzzlekitError(f"scenario {self.name}: {k}={getattr(self, k)!r}; one of {sorted(BYTES)}")
        if self.recipe and self.recipe not in RECIPES:
            raise PuzzlekitError(f"scenario {self.name}: unknown recipe {self.recipe!r}; known: {sorted(RECIPES)}")
        if self.input_len < 1 or self.output_len < 0 or self.prefill_chunk < 1:
            raise PuzzlekitError(f"scenario {self.name}: input_len and prefill_chunk must be >= 1, output_len >= 0")
        if not (isinstance(self.workspace_bytes, (int, float)) and math.isfinite(self.workspace_bytes)
                and self.workspace_bytes >= 0):
            raise PuzzlekitError(f"scenario {self.name}: workspace_bytes must be a finite number >= 0, "
                                 f"got {self.workspace_bytes!r}")
        for k in ("rate_floor", "context", "concurrency", "gpus"):
            if getattr(self, k) < 0:
                raise PuzzlekitError(f"scenario {self.name}: {k} must be >= 0, got {getattr(self, k)}")
        return self


def scenarios() -> dict[str, Scenario]:
    raw = tomllib.loads(SCENARIOS_FILE.read_text())
    return {k: Scenario(name=k, **v) for k, v in raw.items()}


def get_scenario(name: str, **overrides) -> Scenario:
    named = scenarios()
    if name not in named:
        raise PuzzlekitError(f"unknown scenario {name!r}; named: {', '.join(named)}")
    return dataclasses.replace(named[name], **{k: v for k, v in overrides.items() if v is not None}).check()


# -- precisions ---------------------------------------------------------------------------------------------------
#: math precision of a weight format: weight-only formats compute in BF16
MATH = {"fp8-weight": "bf16", "nvfp4-weight": "bf16"}


def precision_of(path: str, param: str, op, recipe: str = "") -> str:
    """A parameter's storage precision: a recipe's format when one is named, else the program's own."""
    if param in op.fp32_params():
        return "fp32"
    if recipe:
        fmt = get_recipe(recipe).format_of(path, param)
    else:
        fmt = dict(op.quant).get(param, "none")
    return "bf16" if fmt == "none" else fmt


# -- providers ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Efficiency:
    """Fractions of datasheet peaks a serving engine reaches, per kind of kernel, and fixed costs.

    One set for every target; docs/cost-model.md gives each value's source."""

    compute: float = 0.6  # dense GEMMs with many rows
    memory: float = 0.8  # streaming weight reads
    moe_half_tokens: float = 64.0  # tokens per expert at which a grouped GEMM reaches half of `compute`
    attention_compute: float = 0.6  # fused (flash) attention, prefill
    attention_memory: float = 0.7  # decode attention reading the KV cache
    mamba_compute: float = 0.2  # chunked SSD scan and causal conv, prefill
    mamba_memory: float = 0.5  # decode state update: reads and writes the SSM state
    link: float = 0.5  # fraction of the (bidirectional) NVLink bandwidth a collective's bus bandwidth reaches
    launch_seconds: float = 6e-6  # per kernel in a captured graph: launch, ramp and tail (a floor for tiny ops)
    step_overhead_seconds: float = 30e-6  # scheduling, sampling, host work per step
    allreduce_latency_seconds: float = 15e-6  # per collective across the devices

    def moe(self, tokens_per_expert: float) -> float:
        """Grouped-GEMM compute efficiency at `tokens_per_expert` rows per expert: each expert's tile is
        filled in proportion, so t / (t + t_half) of `compute` (t_half: half a 128-row tile)."""
        t = tokens_per_expert
        return self.compute * t / (t + self.moe_half_tokens) if t > 0 else 0.0


#: op kind -> (compute, memory) attributes of Efficiency for its sequence kernel (what is not a GEMM)
KERNELS = {"attention": ("attention_compute", "attention_memory"), "mamba2": ("mamba_compute", "mamba_memory")}


class AnalyticProvider:
    """A roofline per kernel: GEMMs at the dense (or grouped-GEMM) efficiency, sequence kernels (attention,
    the SSM) at their own; plus launch floors and tensor/expert-parallel collectives."""

    max_batch = 1 << 20

    def __init__(self, target: Target, efficiency: Efficiency | None = None):
        self.target, self.eff = target, efficiency or Efficiency()

    def _roof(self, flops: float, nbytes: float, prec: str, compute: float, memory: float) -> float:
        t = self.target
        c = flops / (t.peak_flops[prec] * compute) if flops else 0.0
        return max(c, nbytes / (t.bandwidth * memory))

    def op_seconds(self, op, precisions: dict, work, devices: int, act_bytes: float, tokens_out: int) -> float:
        t, e = self.target, self.eff
        wbytes = {k: elems * BYTES[precisions.get(k, "bf16")] for k, elems in work.weights.items()}
        flops, nbytes = work.flops, sum(wbytes.values()) + work.act * act_bytes
        rest, seconds = work.weights, 0.0
        if op.kind == "moe" and tokens_out:  # routed experts: one grouped GEMM
            routed = {k: v for k, v in work.weights.items() if k.startswith("mixer.experts.")}
            r_flops = tokens_out * op.top_k * 4 * op.expert_width * op.d_ff
            r_bytes = sum(wbytes[k] for k in routed)
            prec = _math_precision(precisions, routed, t)
            eff = e.moe(tokens_out * op.top_k / op.experts)
            seconds += max(r_flops / (t.peak_flops[prec] * eff), r_bytes / (t.bandwidth * e.memory))
            flops, nbytes = flops - r_flops, nbytes - r_bytes
            rest = {k: v for k, v in work.weights.items() if k not in routed}
        elif op.kind in KERNELS:  # the sequence kernel apart from the projections
            gemm = 2 * tokens_out * sum(math.prod(s) for s in op.params().values() if len(s) == 2)
            kc, km = (getattr(e, a) for a in KERNELS[op.kind])
            seconds += self._roof(max(flops - gemm, 0.0), work.state_read + work.state_write, _sequence_precision(t),
                                  kc, km)
            flops = min(flops, gemm)
        seconds += self._roof(flops, nbytes, _math_precision(precisions, rest, t), e.compute, e.memory)
        seconds = seconds / devices + work.kernels * e.launch_seconds
        if devices > 1 and op.is_block and op.kind != "noop":
            seconds += self.collective_seconds(op, tokens_out, devices, act_bytes)
        return seconds

    def collective_seconds(self, op, tokens: int, devices: int, act_bytes: float) -> float:
        """One ring all-reduce of the block output (tensor parallel). A MoE's routed experts are spread over
        the devices (expert parallel): each device sends its share of the tokens' k routed copies, at the
        expert width, out and back (all-to-all); the all-reduce then carries the shared expert's output."""
        g, e = devices, self.eff
        link = self.target.interconnect_bandwidth * e.link
        out = 2 * (g - 1) / g * tokens * op.hidden * act_bytes / link + e.allreduce_latency_seconds
        if op.kind == "moe":
            out += 2 * (g - 1) / g * (tokens / g) * op.top_k * op.expert_width * act_bytes / link \
                + 2 * e.allreduce_latency_seconds
        return out

    def step_overhead(self) -> float:
        return self.eff.step_overhead_seconds


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


# -- the report ------------------------------------------------------------------------------------------------------
@dataclass
class CostReport:
    target: str
    scenario: Scenario
    params_total: int
    params_active: int
    weight_bytes: float
    state_bytes_per_request: float
    reserve_bytes: float
    memory_available_bytes: float
    max_concurrency: int
    max_batch: int
    decode_step_seconds: float
    decode_step_seconds_batch1: float
    prefill_seconds: float
    serve_step_seconds: float
    throughput_tokens_per_second: float
    binding: str = ""
    headroom: dict = field(default_factory=dict)
    by_kind: dict = field(default_factory=dict)
    infeasible: str = ""

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["scenario"] = dataclasses.asdict(self.scenario)
        return d


class CostModel:
    """Prices one program on one target and scenario."""

    def __init__(self, prog: Program, target: Target | str, scenario: Scenario, provider=None,
                 routing: dict | None = None):
        self.prog = prog
        self.target = get_target(target) if isinstance(target, str) else target
        self.scenario = scenario.check()
        self.devices = scenario.gpus or self.target.devices
        if self.devices > self.target.devices:
            raise PuzzlekitError(f"scenario asks for {self.devices} GPUs; target {self.target.name} has "
                                 f"{self.target.devices}")
        if self.target.kind == "cpu" and provider is None:
            provider = MeasuredProvider()
        self.provider = provider or AnalyticProvider(self.target)
        self.routing = routing if routing is not None else prog.meta.get("routing", {})
        s = self.scenario
        self.act_b, self.kv_b, self.ssm_b = BYTES[s.act_dtype], BYTES[s.kv_dtype], BYTES[s.ssm_dtype]
        self._formats: dict = {}
        self._node_memo: dict = {}
        self._recipe_paths = [r.path for r in get_recipe(scenario.recipe).rules] if scenario.recipe else []
        self.precisions = {n.path: self._precisions(n.path, n.op) for n in prog.nodes}
        self._prec_keys = {path: tuple(p.items()) for path, p in self.precisions.items()}  # hashed once
        self._memo: dict = {}  # identical layers (same spec, precisions, routing) are priced once per shape
        self._activation = None

    def _precisions(self, path: str, op) -> dict:
        if op.kind == "lm_head" and op.tied:
            return {"weight": "bf16"}
        fp32 = op.fp32_params()
        return {k: "fp32" if k in fp32 else self._format(path, k, op) for k in op.params()}

    def _format(self, path: str, param: str, op) -> str:
        """A parameter's storage precision by the scenario's recipe, looked up once per (path, parameter): the
        search prices many variants of each layer, and a 512-expert MoE has a thousand parameters."""
        if not self.scenario.recipe:
            return precision_of(path, param, op)
        key = (path, param)
        if key not in self._formats:
            self._formats[key] = precision_of(path, param, op, self.scenario.recipe)
        return self._formats[key]

    def _resident(self, op) -> bool:
        """Whether a node's weights and state are in memory: the MTP head only when serving drafts with it."""
        return op.kind != "mtp" or self.scenario.mtp_resident

    def node_costs(self, path: str, op, batch: int, context: int | None = None, routing=None) -> dict:
        """What a node with spec `op` at `path` adds to the program's figures: decode step at `batch` (at the
        scenario's mean decode context, or at `context` when given), prefill of the scenario's input, the
        serving step (decode plus its share of prefills: `serve_seconds`), weight and state bytes (state at
        the full context, or `context`), parameters. The program's figures are the sum of its nodes' plus a
        per-step overhead, which is how the search prices variants."""
        key = (op, batch, context, None if routing is None else tuple(routing), self._path_signature(path))
        if key not in self._node_memo:  # the same variant in many layers is priced once
            self._node_memo[key] = self._node_costs(path, op, batch, context, routing)
        return self._node_memo[key]

    def _path_signature(self, path: str) -> tuple:
        """Which of the recipe's path patterns `path` matches: paths that match the same ones get the same
        precisions for every parameter."""
        return tuple(fnmatch(path, glob) for glob in self._recipe_paths)

    def _node_costs(self, path: str, op, batch: int, context, routing) -> dict:
        prec = self._precisions(path, op)
        s = self.scenario
        run = op.kind != "mtp"  # the head drafts only with speculative decoding, which is not priced
        resident = self._resident(op)
        shapes = op.params()
        decode = self._priced(op, prec, routing, batch, 1, context or s.decode_context, True) if run else 0.0
        prefill = self._priced(op, prec, routing, 1, s.input_len, 0, False) if run else 0.0
        return {"decode_seconds": decode, "prefill_seconds": prefill,
                "serve_seconds": decode + self.prefill_share(batch) * prefill,
                "weight_bytes": sum(math.prod(sh) * BYTES[prec[k]] for k, sh in shapes.items()) if resident else 0.0,
                "state_bytes": op.state_bytes(self.kv_b, self.ssm_b, self.act_b, context or s.context_len)
                if resident else 0.0,
                "params": sum(math.prod(sh) for sh in shapes.values()), "active_params": op.active_params()}

    def check_priceable(self, context: int | None = None) -> None:
        """Raises now what pricing the scenario would raise later (the measured provider refuses a prefill or
        a decode state it cannot time here), so that a long run is refused before it starts."""
        if isinstance(self.provider, MeasuredProvider):
            s = self.scenario
            for op in (n.op for n in self.prog.nodes if n.op.kind != "mtp"):
                self.provider.check(op, 1, s.input_len, 0, False)
                self.provider.check(op, 1, 1, context or s.decode_context, True)

    def prepare(self, ops, batch: int, context: int | None = None) -> None:
        """Times `ops` (a search's variants and the parent's ops) together before `node_costs` asks for them
        one by one, so the measured provider's times compare like with like; a no-op for analytic targets."""
        if isinstance(self.provider, MeasuredProvider):
            ops = list(dict.fromkeys(op for op in ops if op.kind != "mtp"))
            s = self.scenario
            items = ([(op, batch, 1, context or s.decode_context, True) for op in ops]
                     + [(op, 1, s.input_len, 0, False) for op in ops])
            if self.provider.pinned or all(self.provider.has(it) for it in items):
                self.provider.times(items)  # all cached: spot-checked; a pinned table: only the missing timed
            else:  # the ones timed before (the parent's, by its report) again, with the new ones
                self.provider.measure_together(items, [])
                self._memo.clear()
                self._node_memo.clear()

    def prefill_share(self, batch: int) -> float:
        """Prefills per decode step in steady state: each of `batch` users finishes a request (and a new
        one is prefilled) every `output_len` steps."""
        return batch / self.scenario.output_len if self.scenario.output_len else 0.0

    def step_overhead(self) -> float:
        return self.provider.step_overhead()

    # memory
    def weight_bytes(self) -> float:
        return sum(math.prod(shape) * BYTES[self.precisions[n.path][k]]
                   for n in self.prog.nodes if self._resident(n.op) for k, shape in n.op.params().items())

    def state_bytes_per_request(self, context: int | None = None) -> float:
        c = self.scenario.context_len if context is None else context
        return sum(n.op.state_bytes(self.kv_b, self.ssm_b, self.act_b, c) for n in self.prog.nodes
                   if self._resident(n.op))

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
        """Memory kept from weights and state: the runtime's workspace plus the activation peak, per device."""
        return self.devices * (self.scenario.workspace_bytes + self.activation_bytes())

    def usable_memory(self) -> float:
        return self.target.memory_bytes * self.devices - self.reserve_bytes()

    def memory_available(self) -> float:
        return self.usable_memory() - self.weight_bytes()

    # time
    def _seconds(self, batch: int, tokens: int, context: int, decode: bool) -> tuple[float, dict]:
        per_kind: dict[str, float] = {}
        total = self.provider.step_overhead()
        if isinstance(self.provider, MeasuredProvider):  # every op of the step timed together, in turns
            nodes = [n for n in self.prog.nodes if n.op.kind != "mtp"]
            todo = list(dict.fromkeys(n.op for n in nodes))
            secs = dict(zip(todo, self.provider.times([(op, batch, tokens, context, decode) for op in todo])))
            for n in nodes:
                self._memo[self._memo_key(n.op, self._prec_keys[n.path], self.routing.get(n.path), batch, tokens,
                                          context, decode)] = secs[n.op]
        for n in self.prog.nodes:
            if n.op.kind == "mtp":
                continue  # the head drafts only with speculative decoding, which is not priced
            sec = self._priced(n.op, self.precisions[n.path], self.routing.get(n.path), batch, tokens, context, decode,
                               self._prec_keys[n.path])
            per_kind[n.op.kind] = per_kind.get(n.op.kind, 0.0) + sec
            total += sec
        return total, per_kind

    @staticmethod
    def _memo_key(op, prec_key: tuple, routing, batch, tokens, context, decode) -> tuple:
        return (op, prec_key, None if routing is None else tuple(routing), batch, tokens, context, decode)

    def _priced(self, op, precisions, routing, batch, tokens, context, decode, prec_key=None) -> float:
        key = self._memo_key(op, prec_key or tuple(precisions.items()), routing, batch, tokens, context, decode)
        if key not in self._memo:
            self._memo[key] = self._op_seconds(op, precisions, routing, batch, tokens, context, decode)
        return self._memo[key]

    def _op_seconds(self, op, precisions, routing, batch, tokens, context, decode) -> float:
        if isinstance(self.provider, MeasuredProvider):
            return self.provider.op_seconds_at(op, batch, tokens, context, decode)
        w = op.work(batch, tokens, context, decode, self.kv_b, self.ssm_b, self.act_b, routing)
        out_tokens = batch * tokens if op.is_block else batch
        return self.provider.op_seconds(op, precisions, w, self.devices, self.act_b, out_tokens)

    def decode_step_seconds(self, batch: int, context: int | None = None) -> float:
        return self._seconds(batch, 1, self.scenario.decode_context if context is None else context, True)[0]

    def prefill_seconds(self, tokens: int | None = None, batch: int = 1) -> float:
        return self._seconds(batch, tokens or self.scenario.input_len, 0, False)[0]

    def serve_seconds(self, batch: int) -> float:
        """One serving step at `batch`: a decode step plus its share of the prefills that replace finished
        requests (chunked prefill interleaved with decoding). Users see 1 / this tokens/s; the server
        `batch` / this."""
        return self.decode_step_seconds(batch) + self.prefill_share(batch) * self.prefill_seconds()

    def check_whole_model(self, batch: int = 1, tolerance: float = 0.15) -> dict:
        """Measured provider: the whole model (a decode step at `batch` and the mean decode context, a prefill
        of the input) timed in the same turns as its ops, against their sum. When the times the model was
        priced with (cached or earlier) differ from these fresh ones by more than `tolerance`, the cache is
        dropped and the fresh times replace it. Returns the fresh predicted and measured figures, their ratio,
        and whether the earlier times were replaced."""
        if not isinstance(self.provider, MeasuredProvider):
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
        return {"decode": {"predicted": pred[0], "measured": measured[0], "ratio": pred[0] / measured[0]},
                "prefill": {"predicted": pred[1], "measured": measured[1], "ratio": pred[1] / measured[1]},
                "retimed": retimed}

    def report(self) -> CostReport:
        s = self.scenario
        prefill, per_kind_prefill = self._seconds(1, s.input_len, 0, False)  # first: it may be refused (cpu)
        counts = self.prog.param_counts()
        wbytes, state = self.weight_bytes(), self.state_bytes_per_request()
        usable, avail = self.usable_memory(), self.memory_available()
        max_conc = int(max(0, avail) // state) if state > 0 else (10**9 if avail > 0 else 0)
        limit = min(max_conc, s.concurrency) if s.concurrency else max_conc
        serving = lambda b: self.decode_step_seconds(b) + self.prefill_share(b) * prefill  # noqa: E731
        ok = (lambda b: True) if s.rate_floor <= 0 else (lambda b: 1.0 / serving(b) >= s.rate_floor)
        best, infeasible, binding = 0, "", ""
        cap = self.provider.max_batch
        if isinstance(self.provider, MeasuredProvider):
            cap = min(cap, self.provider.batch_limit([n.op for n in self.prog.nodes if n.op.kind != "mtp"],
                                                     s.context_len))
        if limit < 1:
            binding = "memory"
            infeasible = (f"memory: weights need {wbytes / 1e9:.1f} GB and one request's state "
                          f"{state / 1e9:.2f} GB; {usable / 1e9:.1f} GB usable on "
                          f"{self.devices}x{self.target.name.split('x')[-1]} after a {self.reserve_bytes() / 1e9:.1f}"
                          f" GB reserve")
        elif not ok(1):
            binding = "rate floor"
            infeasible = (f"rate floor: {s.rate_floor:g} tokens/s per user wanted, batch 1 reaches "
                          f"{1 / serving(1):.1f}")
        else:
            lo, hi = 1, min(limit, cap)
            while lo < hi:  # serving time grows with the batch: the largest batch meeting the floor
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
            best = lo
            binding = ("rate floor" if best < min(limit, cap) else "memory" if best == max_conc
                       else "concurrency" if best == s.concurrency else "compute")
        b = max(best, 1)
        step, per_kind_decode = self._seconds(b, 1, s.decode_context, True)
        serve = step + self.prefill_share(b) * prefill
        if not all(math.isfinite(x) and x >= 0 for x in (step, prefill, *per_kind_decode.values())):
            raise PuzzlekitError(f"the cost model priced a step at {step} s and a prefill at {prefill} s on "
                                 f"{self.target.name}: not finite; check the target's numbers")
        headroom = {"memory_bytes": avail - best * state, "requests": max_conc - best,
                    "rate_tokens_per_second": 1 / serve - s.rate_floor if best else 0.0}
        by_kind = {}
        for n in self.prog.nodes:
            k = by_kind.setdefault(n.op.kind, {"count": 0, "weight_bytes": 0.0, "state_bytes_per_request": 0.0})
            k["count"] += 1
            if self._resident(n.op):
                k["weight_bytes"] += sum(math.prod(sh) * BYTES[self.precisions[n.path][p]]
                                         for p, sh in n.op.params().items())
                k["state_bytes_per_request"] += n.op.state_bytes(self.kv_b, self.ssm_b, self.act_b, s.context_len)
        for kind, v in by_kind.items():
            v["decode_seconds"] = per_kind_decode.get(kind, 0.0)
            v["prefill_seconds"] = per_kind_prefill.get(kind, 0.0)
        return CostReport(self.target.name, s, counts["total"], counts["active"], wbytes, state, self.reserve_bytes(),
                          avail, max_conc, best, step, self.decode_step_seconds(1), prefill, serve,
                          best / serve if best else 0.0, binding, headroom, by_kind, infeasible)


def cost(prog: Program, target: str | Target, scenario: str | Scenario, provider=None, **overrides) -> CostReport:
    """One call: `cost(prog, "h100", "long-1m", recipe="fp8").max_concurrency`."""
    sc = get_scenario(scenario, **overrides) if isinstance(scenario, str) else dataclasses.replace(scenario, **overrides)
    return CostModel(prog, target, sc, provider).report()
