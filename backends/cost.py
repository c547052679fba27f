"""The cost model: prices a Program on a target and a deployment scenario.

Each op reports hardware-independent work (ir/ops: `work`, `state_bytes`); a provider turns work
into seconds: the analytic roofline for GPUs, or timings measured on this machine for `cpu`.
Assumptions are listed in docs/cost-model.md.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Protocol

import numpy as np
import tomllib

from ..errors import PuzzlekitError, read_text
from ..ir import Program
from ..ir.quant.recipe import RECIPES, get_recipe
from .layout import Layout, layouts
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
    gpus: int = 0  # devices used; 0: all of the target's
    layout: str = ""  # parallel layout ("tp4.ep4.r2", see backends/layout.py); "": the best one is searched
    workspace_bytes: float = 4 * 2**30  # per device: CUDA context, library workspaces, graphs, comm buffers
    prefill_chunk: int = 8192  # tokens prefilled per step; sets the activation peak kept free
    mtp_resident: bool = False  # the MTP head's weights and state loaded (implied by mtp_draft)
    mtp_draft: int = 0  # tokens the MTP head drafts per step (speculative decoding); 0: plain decoding
    mtp_acceptance: float = 0.0  # mean tokens per step with drafting (accepted drafts + the verified one)

    def to_toml(self) -> str:
        """The scenario as a scenario file (one table, its fields), which `get_scenario` reads back."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "name"}
        return f"[{self.name}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in fields.items())

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
        for k in ("rate_floor", "context", "concurrency", "gpus", "mtp_draft"):
            if getattr(self, k) < 0:
                raise PuzzlekitError(f"scenario {self.name}: {k} must be >= 0, got {getattr(self, k)}")
        if self.layout:
            Layout.parse(self.layout)
        if self.mtp_draft and not 1 <= self.mtp_acceptance <= self.mtp_draft + 1:
            raise PuzzlekitError(f"scenario {self.name}: mtp_acceptance={self.mtp_acceptance:g} tokens per step "
                                 f"with {self.mtp_draft} drafted must lie in [1, {self.mtp_draft + 1}]; measure it "
                                 "with mtp-check, or give --mtp-acceptance")
        if self.mtp_acceptance and not self.mtp_draft:
            raise PuzzlekitError(f"scenario {self.name}: mtp_acceptance without mtp_draft; give the tokens drafted "
                                 "per step too (--mtp)")
        return self


def scenarios(path: Path = SCENARIOS_FILE) -> dict[str, Scenario]:
    """The named scenarios of a TOML file: one table per scenario, or the fields of one at the top level
    (named after the file)."""
    try:
        raw = tomllib.loads(read_text(path, "scenario file"))
    except tomllib.TOMLDecodeError as e:
        raise PuzzlekitError(f"{path}: not valid TOML ({e})") from None
    if raw and not any(isinstance(v, dict) for v in raw.values()):
        raw = {Path(path).stem: raw}
    known = {f.name for f in dataclasses.fields(Scenario)} - {"name"}
    out = {}
    for k, v in raw.items():
        unknown = sorted(set(v) - known) if isinstance(v, dict) else ["(not a table)"]
        if unknown:
            raise PuzzlekitError(f"{path}: scenario {k!r} has unknown field(s) {unknown}; known: {', '.join(sorted(known))}")
        out[k] = Scenario(name=k, **v)
    return out


def get_scenario(name: str, **overrides) -> Scenario:
    """A built-in scenario by name, or a TOML file of one (`FILE.toml`, or `FILE.toml:NAME` for one of several)."""
    path, _, pick = name.partition(".toml")
    if _ or Path(name).is_file():
        named = scenarios(Path(path + ".toml" if _ else name))
        pick = pick.lstrip(":") or (next(iter(named)) if len(named) == 1 else "")
        if pick not in named:
            raise PuzzlekitError(f"{name}: name one of its scenarios ({', '.join(named)}) as FILE.toml:NAME")
        base = named[pick]
    else:
        named = scenarios()
        if name not in named:
            raise PuzzlekitError(f"unknown scenario {name!r}; named: {', '.join(named)}; or a .toml file")
        base = named[name]
    return dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None}).check()


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
class Deployment:
    """What pricing an op needs besides its shapes: the parallel layout and the state and activation widths."""

    layout: Layout = Layout()
    act_bytes: float = 2.0
    kv_bytes: float = 2.0
    ssm_bytes: float = 4.0
    ssm_copies: int = 1  # SSM states kept per request: d + 1 with d drafted tokens (one per verified position)


class Provider(Protocol):
    """Turns an op's work at a shape into seconds. `CostModel` prices through this interface only."""

    max_batch: int
    measures: bool  # times this machine (whole-model checks and re-timing apply)

    def step_overhead(self) -> float: ...

    def check(self, items: list[tuple]) -> None:
        """Raises for (op, batch, tokens, context, decode) shapes it cannot price."""

    def prefetch(self, items: list[tuple]) -> None:
        """Prices the `items` (a step's runs) it has not priced yet together."""

    def prepare(self, items: list[tuple]) -> bool:
        """Prices `items` together (the measured provider times them in one round-robin); True when times
        priced before may have changed."""

    def batch_limit(self, ops, context: int) -> int: ...

    def seconds(self, op, precisions: dict, routing, batch: int, tokens: int, context: int, decode: bool,
                deployment: Deployment) -> float: ...


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
    step_overhead_seconds: float = 30e-6  # scheduling, sampling, host work per step
    collective_latency_seconds: float = 6e-6  # per collective (all-reduce, all-to-all) over NVLink

    def moe(self, tokens_per_expert: float) -> float:
        """Grouped-GEMM compute efficiency at `tokens_per_expert` rows per expert: each expert's tile is
        filled in proportion, so t / (t + t_half) of `compute` (t_half: half a 128-row tile)."""
        t = tokens_per_expert
        return self.compute * t / (t + self.moe_half_tokens) if t > 0 else 0.0


#: op kind -> (compute, memory) attributes of Efficiency for its sequence kernel (what is not a GEMM)
KERNELS = {"attention": ("attention_compute", "attention_memory"), "mamba2": ("mamba_compute", "mamba_memory")}


class AnalyticProvider:
    """A roofline per kernel on one device of a layout: GEMMs at the dense (or grouped-GEMM) efficiency,
    sequence kernels (attention, the SSM) at their own; plus launch floors and the layout's collectives."""

    max_batch = 1 << 20
    measures = False

    def __init__(self, target: Target, efficiency: Efficiency | None = None):
        self.target, self.eff = target, efficiency or Efficiency()

    def step_overhead(self) -> float:
        return self.eff.step_overhead_seconds

    def check(self, items) -> None:
        return None

    def prefetch(self, items) -> None:
        return None

    def prepare(self, items) -> bool:
        return False

    def batch_limit(self, ops, context: int) -> int:
        return self.max_batch

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
        w = op.work(b, tokens, context, decode, d.kv_bytes, d.ssm_bytes, d.act_bytes, routing)
        wbytes = {k: n * BYTES[precisions.get(k, "bf16")] for k, n in w.weights.items()}
        flops, seconds = w.flops, 0.0
        dense = [k for k in wbytes if not k.startswith("mixer.experts.")]
        if op.kind == "moe":
            flops -= b * tokens * op.top_k * 4 * op.expert_width * op.d_ff
            seconds += self._routed(op, precisions, routing, batch * tokens, d)
        elif op.kind in KERNELS:  # the sequence kernel apart from the projections
            gemm = 2 * b * tokens * sum(math.prod(s) for s in op.params().values() if len(s) == 2)
            kc, km = (getattr(e, a) for a in KERNELS[op.kind])
            split = L.kv_shards(op) if op.kind == "attention" else L.tp
            written = w.state_write * (d.ssm_copies if op.kind == "mamba2" and decode and tokens > 1 else 1)
            seconds += self._roof(max(flops - gemm, 0.0) / L.tp, (w.state_read + written) / split,
                                  _sequence_precision(t), kc, km)
            flops = min(flops, gemm)
        nbytes = sum(wbytes[k] / L.shards(op, k) for k in dense) + w.act * d.act_bytes / L.tp
        seconds += self._roof(flops / L.tp, nbytes, _math_precision(precisions, {k: w.weights[k] for k in dense}, t),
                              e.compute, e.memory)
        seconds += w.kernels * e.launch_seconds
        if op.is_block and op.kind != "noop":
            seconds += self.collective_seconds(op, b * tokens, d)
        return seconds

    def _routed(self, op, precisions, routing, tokens: int, d: Deployment) -> float:
        """The routed experts as one grouped GEMM on each device of the replica: the FLOPs split evenly, the
        reads those of the experts the device holds that some token chose (with ep > 1, the busiest device's)."""
        if not tokens:
            return 0.0
        t, e, L = self.target, self.eff, d.layout
        names = [[f"mixer.experts.{j}.up_proj.weight", f"mixer.experts.{j}.down_proj.weight"] for j in range(op.experts)]
        sizes = np.array([op.d_ff * op.expert_width * sum(BYTES[precisions.get(k, "bf16")] for k in pair)
                          for pair in names])
        p = np.array(op.touched(tokens, routing))
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

    def _mtp(self, op, precisions, routing, batch, tokens, context, decode, d: Deployment) -> float:
        """One pass of the MTP head: the fusion (eh_proj and norms) as a GEMM, then each of its blocks."""
        e, L = self.eff, d.layout
        b = L.requests_per_group(batch)
        n, h = b * tokens, op.hidden
        fusion = 2 * h * h * BYTES[precisions.get("layers.0.eh_proj.weight", "bf16")] / L.tp + n * 5 * h * d.act_bytes
        out = self._roof(n * (4 * h * h + 12 * h) / L.tp, fusion, _sequence_precision(self.target), e.compute,
                         e.memory) + 3 * e.launch_seconds
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
    layout: str = "tp1"
    tokens_per_step: float = 1.0  # per user: 1, or the MTP head's acceptance length
    user_tokens_per_second: float = 0.0
    device_weight_bytes: float = 0.0
    device_state_bytes_per_request: float = 0.0
    layouts: list = field(default_factory=list)  # every layout tried: {"layout", "max_batch", "throughput", ...}

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["scenario"] = dataclasses.asdict(self.scenario)
        return d

    def summary(self) -> dict:
        return {"layout": self.layout, "max_batch": self.max_batch, "max_concurrency": self.max_concurrency,
                "throughput": self.throughput_tokens_per_second, "user_rate": self.user_tokens_per_second,
                "serve_step_ms": self.serve_step_seconds * 1e3, "binding": self.binding, "infeasible": self.infeasible}


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
        self.provider = provider or AnalyticProvider(self.target)
        if self.scenario.mtp_draft and self.provider.measures:
            raise PuzzlekitError("speculative decoding is priced on GPU targets; the measured cpu provider times "
                                 "plain decoding only: drop --mtp, or price a GPU target")
        self.routing = routing if routing is not None else prog.meta.get("routing", {})
        s = self.scenario
        self.act_b, self.kv_b, self.ssm_b = BYTES[s.act_dtype], BYTES[s.kv_dtype], BYTES[s.ssm_dtype]
        self.deployment = Deployment(self.layout, self.act_b, self.kv_b, self.ssm_b, s.mtp_draft + 1)
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
        ctx = context or self.scenario.decode_context
        ops = list(dict.fromkeys(ops))
        items = [(op, *p[:4]) for op in ops for p in self.decode_parts(op, batch, ctx) + self.prefill_parts(op)]
        if self.provider.prepare(list(dict.fromkeys(items))):
            self._memo.clear()
            self._node_memo.clear()

    def node_costs(self, path: str, op, batch: int, context: int | None = None, routing=None) -> dict:
        """What a node with spec `op` at `path` adds to the program's figures: decode step at `batch` (at the
        scenario's mean decode context, or at `context` when given), prefill of the scenario's input, the
        serving step (decode plus its share of prefills: `serve_seconds`), one device's weight and per-request
        state bytes (state at the full context, or `context`), parameters. The program's figures are the sum
        of its nodes' plus a per-step overhead, which is how the search prices variants."""
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
        key = tuple(prec.items())
        decode = self._runs(op, prec, routing, self.decode_parts(op, batch, context or s.decode_context), key)
        prefill = self._runs(op, prec, routing, self.prefill_parts(op), key)
        resident = self._resident(op)
        shapes = op.params()
        return {"decode_seconds": decode, "prefill_seconds": prefill,
                "serve_seconds": decode + self.prefill_share(batch) * prefill,
                "weight_bytes": self._device_weights(op, prec) if resident else 0.0,
                "state_bytes": self.layout.state_bytes(op, self.kv_b, self.ssm_b, self.act_b, context or s.context_len,
                                                      self.deployment.ssm_copies)
                if resident else 0.0,
                "params": sum(math.prod(sh) for sh in shapes.values()), "active_params": op.active_params()}

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
    def _device_weights(self, op, precisions: dict) -> float:
        return sum(math.prod(shape) * BYTES[precisions[k]] / self.layout.shards(op, k) for k, shape in op.params().items())

    def weight_bytes(self) -> float:
        """The whole model's weights (one copy)."""
        return sum(math.prod(shape) * BYTES[self.precisions[n.path][k]]
                   for n in self.prog.nodes if self._resident(n.op) for k, shape in n.op.params().items())

    def device_weight_bytes(self) -> float:
        """The weights one device holds."""
        return sum(self._device_weights(n.op, self.precisions[n.path]) for n in self.prog.nodes if self._resident(n.op))

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
                k["weight_bytes"] += sum(math.prod(sh) * BYTES[self.precisions[n.path][p]]
                                         for p, sh in n.op.params().items())
                k["state_bytes_per_request"] += self._state(n.op, s.context_len)
        for kind, v in by_kind.items():
            v["decode_seconds"] = per_kind_decode.get(kind, 0.0)
            v["prefill_seconds"] = per_kind_prefill.get(kind, 0.0)
        return CostReport(self.target.name, s, counts["total"], counts["active"], self.weight_bytes(),
                          self.state_bytes_per_request(), self.reserve_bytes(), self.memory_available(),
                          max_req * L.replicas, best * L.replicas, step, self.decode_step_seconds(1), prefill, serve,
                          self.throughput(best, serve) if best else 0.0, binding, headroom, by_kind, infeasible,
                          str(L), self.tokens_per_step, rate if best else 0.0, self.device_weight_bytes(), state)


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


def layouts_of(target: Target, scenario: Scenario) -> list[Layout]:
    """The scenario's pinned layout, or every layout of the GPUs it uses."""
    return [Layout.parse(scenario.layout)] if scenario.layout else layouts(scenario.gpus or target.devices)


def best_layout(prog: Program, target: Target | str, scenario: Scenario, provider: Provider | None = None,
                routing: dict | None = None, fits=None) -> tuple[CostModel, CostReport]:
    """The scenario's pinned layout, or every layout of its GPUs tried (those `fits(layout)` admits, when
    given): the one with the highest throughput meeting the rate floor (ties: the fewest devices per replica),
    its report listing every layout tried."""
    target = get_target(target) if isinstance(target, str) else target
    scenario = scenario.check()
    tried = []
    for layout in layouts_of(target, scenario):
        if fits is None or fits(layout):
            cm = CostModel(prog, target, scenario, provider, routing, layout)
            tried.append((cm, cm.report()))
    if not tried:
        raise PuzzlekitError(f"no layout of {target.name} admitted for {scenario.name}")
    cm, best = max(tried, key=lambda t: (t[1].throughput_tokens_per_second, t[1].max_concurrency,
                                         -t[0].layout.group))
    best.layouts = [r.summary() for _, r in tried]
    return cm, best


def cost(prog: Program, target: str | Target, scenario: str | Scenario, provider=None, **overrides) -> CostReport:
    """One call: `cost(prog, "h100", "long-1m", recipe="fp8").max_concurrency` (the best layout's figures)."""
    sc = get_scenario(scenario, **overrides) if isinstance(scenario, str) else \
        dataclasses.replace(scenario, **{k: v for k, v in overrides.items() if v is not None})
    return best_layout(prog, target, sc, provider)[1]
