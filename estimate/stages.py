"""What each pass of a pipeline needs on each process: peak memory by part, seconds, and whether it fits.

Counted from the IR and the passes' own options, as the stages run them: the library's sweep, variants, BLD and
replace-one-block scoring (`passes/puzzle/build.py`), distillation's student, teacher, optimizer state and
activations (`passes/distill`), the MTP check's speculative decoding, quantize's calibration and copies, all
within the memory budget's rules (`backends/torch/stream.py`: kept layers take half the budget, tapes and new
weights a quarter each). Stages after the search are priced at the parent's size: the child is at most that.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .activations import logits_bytes, saved_bytes, saved_floats
from .hardware import GPU_RESERVED, Hardware, Rates

#: a process's own resident memory on the host: the interpreter, torch, puzzlekit, tokenizers (measured: 0.26 GB)
HOST_BASE = int(0.26e9)
#: a weight's entry in the loaded program, and a new tensor's Python object with its scale (measured: reading the
#: Super-counts miniature's index of 42,000 tensors adds 0.05 GB)
ENTRY_BYTES, NEW_TENSOR_BYTES = 1200, 2048
#: the search: seconds per trunk layer (Super's plan on 8xB200: 10.7 s for 88 layers) and a start
SEARCH_SECONDS = (2.0, 0.1)
#: writing a checkpoint: per tensor (its config, its shard entry, its check on reading back: 11.7 s for the
#: Super-counts miniature's 42,000 tensors) and per byte (a local disk)
WRITE_PER_TENSOR, WRITE_RATE = 2.5e-4, 500e6
STORED_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: verification steps of the MTP check: new tokens / this acceptance (tokens per step) when the parent records none
ACCEPTANCE_GUESS = 1.5


@dataclass
class Stage:
    """One stage on one process: `memory` by part (bytes), `seconds` (wall, the slowest process), and the ways
    to make it fit when it does not."""

    name: str
    memory: dict
    seconds: float
    capacity: int
    fixes: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    host: dict = field(default_factory=dict)  # on GPUs, what the process holds in host memory instead

    @property
    def peak_memory_bytes(self) -> int:
        return int(sum(self.memory.values()))

    host_capacity: int = 2**62  # host memory per process (on GPUs: its share of the node's)
    alone: bool = False  # run by rank 0 alone (the output): the node's host memory is its own

    @property
    def host_bytes(self) -> int:
        return int(sum(self.host.values()))

    @property
    def fits(self) -> bool:
        return self.peak_memory_bytes <= self.capacity and self.host_bytes <= self.host_capacity

    def as_json(self) -> dict:
        return {"stage": self.name, "peak_memory_bytes": self.peak_memory_bytes, "seconds": self.seconds,
                "fits": self.fits, "capacity_bytes": self.capacity,
                "memory": {k: int(v) for k, v in self.memory.items() if v}, "notes": self.notes,
                "host_memory": {k: int(v) for k, v in self.host.items() if v}, "host_bytes": self.host_bytes,
                "host_capacity_bytes": self.host_capacity, "rank0_alone": self.alone,
                "fixes": [] if self.fits else self.fixes}


@dataclass
class Context:
    """The model, the hardware and the budget every stage is estimated under."""

    prog: object  # the parent Program (weights or a config's meta program)
    hw: Hardware
    budget: int  # host bytes for weights and activations (--max-memory, or half of what is available)
    rates: Rates = None
    teacher: object = None  # the Program distillation's teacher is (the parent, after a search); default `prog`

    def __post_init__(self):
        self.rates = self.rates or Rates(self.hw)

    @property
    def device(self) -> str:
        return self.hw.kind

    @property
    def base(self) -> int:
        return GPU_RESERVED if self.hw.kind == "gpu" else HOST_BASE + ENTRY_BYTES * self.tensors()

    def tensors(self) -> int:
        return sum(len(n.op.params()) for n in self.prog.nodes)

    def params(self) -> int:
        return _params(self.prog)

    def blocks(self) -> list:
        return [n.op for n in self.prog.blocks()]

    def head(self):
        return next(n.op for n in self.prog.nodes if n.op.kind == "lm_head")

    def mtp(self):
        return next((n.op for n in self.prog.nodes if n.op.kind == "mtp"), None)

    def kept(self, weights: float, work: float = 0.0) -> float:
        """Weights a stream keeps beside `work`: half the budget, less the work (on a GPU at most half of what
        the work leaves free)."""
        room = self.budget / 2 - work
        if self.hw.kind == "gpu":
            room = min(room, (self.hw.memory_bytes - self.base - work) / 2)
        return min(weights, max(0.0, room))

    def streamed(self, weights: float, work: float = 0.0) -> dict:
        """A stream's memory: the layers it keeps, and the layer being read (its bytes as read and its module;
        when not every layer is kept, also the one running)."""
        kept, layer = self.kept(weights, work), 4.0 * max(op.param_count() for op in self.blocks())
        return {"weights (kept layers)": kept, "layer being read": layer * (1 if kept >= weights else 2)}

    def reads(self, weights: float, work: float = 0.0) -> float:
        """Seconds to read the layers a stream does not keep once more."""
        return max(0.0, weights - self.kept(weights, work)) / self.rates.read_rate(self.prog)

    def forward(self, rows: int, seq: int, ops=None) -> float:
        ops = self.blocks() if ops is None else ops
        return sum(self.rates.forward(op, rows, seq) for op in ops)

    def stage(self, name: str, memory: dict, seconds: float, fixes=(), notes=(), host: dict | None = None,
              alone: bool = False) -> Stage:
        """`host`: parts held in host memory (tapes, copies being written): on the CPU they are the same memory.
        `alone`: rank 0's work while the others wait (the output), with the node's host memory to itself."""
        host = host or {}
        if self.hw.kind == "cpu":
            memory, host = memory | host, {}
        share = min(self.hw.processes, 8) if alone and self.hw.kind == "gpu" else 1
        return Stage(name, {"process": self.base} | memory, seconds, self.hw.memory_bytes, list(fixes), list(notes),
                     host, self.hw.host_bytes * share, alone)


def _params(prog) -> int:
    c = prog.param_counts()
    return c["total"] + c["mtp_total"]


def saved_floats_max(ops, seq: int, device: str) -> float:
    """The most floats per token one of `ops` keeps for its backward."""
    return max(saved_floats(op, seq, device) for op in ops)


def _batches(n: int, batch: int) -> int:
    return max(1, math.ceil(n / batch))


# -- the library ---------------------------------------------------------------------------------------------------
def library(ctx: Context, p) -> Stage:
    """`library{...}` / `puzzlekit library`: rank 0 sweeps the parent over both splits, then each process trains and
    scores its share of the layers' variants, one variant at a time (passes/puzzle/build.py): a layer holds the
    parent block (on the host on a GPU), one variant's training, the layer's inputs and the variants' outputs
    scored together (a quarter of the budget, a sixteenth of a GPU); the scorer's layers in the compute dtype."""
    from ..passes.puzzle.grid import load_grid, variants
    from ..passes.puzzle.library import variant_spec

    grid = load_grid(p.grid or None)
    seq, hidden, gpu = p.seq, ctx.blocks()[0].hidden, ctx.hw.kind == "gpu"
    calib, score = p.calib_windows * seq, p.score_windows * seq
    largest = max(op.param_count() for op in ctx.blocks())
    weights = 4.0 * sum(op.param_count() for op in ctx.blocks())  # the sweep's float32 calibration pass
    held = ctx.hw.compute_bytes / 4 * weights  # the scorer's layers, in the compute dtype
    # the sweep: every layer over the calibration (batch 4, float32) and held-out (batch 8) windows, tapes kept
    c4, s8 = min(4, p.calib_windows), min(8, p.score_windows)  # rows per batch, as the build batches them
    sweep_s = ctx.forward(c4, seq) * _batches(p.calib_windows, 4) + ctx.forward(s8, seq) * _batches(p.score_windows, 8)
    tapes = min(2 * 4.0 * (calib + score) * hidden, ctx.budget / 4)
    room = min(ctx.budget / 4, ctx.hw.memory_bytes / 16) if gpu else ctx.budget / 4
    output = 2 * 4.0 * score * hidden  # a variant's output in place of the layer, and its successor
    layers, work_peak, parent_peak, rows_s = ctx.prog.blocks(), 0.0, 0.0, [0.0] * ctx.hw.processes
    tail = [ctx.rates.forward(op, s8, seq) for op in ctx.blocks()]
    head = ctx.rates.forward(ctx.head(), s8, seq)
    bld_steps = max(1, math.ceil(p.bld_tokens / (4 * seq)))
    groups = []
    for i, node in enumerate(layers):
        vs = variants(node.op, grid, node.path)
        specs = [variant_spec(node.op, v) for v in vs]
        sizes = [4.0 * s.param_count() for s in specs]
        one = max((5 if v.steps else 1) * n for v, n in zip(vs, sizes))  # block; trained: start, gradient, moments
        run = [s for v, s in zip(vs, specs) if v.steps or v.replacement]
        per_group = max(1, int(room // output))
        groups.append(math.ceil(len(run) / per_group))
        # x, d and the next layer's input it is made from; the held-out input and target; the trunk's output
        inputs = 4.0 * (3 * calib + 3 * score) * hidden
        work = one + inputs + output * min(len(run), per_group)
        work += max((saved_bytes(s, 4, seq, ctx.device) for v, s in zip(vs, specs) if v.steps), default=0.0)
        work_peak, parent_peak = max(work_peak, work), max(parent_peak, 4.0 * node.op.param_count())
        t = sum(2 * ctx.rates.forward(s, s8, seq) * _batches(p.score_windows, 8) for s in specs)
        t += sum(ctx.rates.train(s, 4, seq) * bld_steps for v, s in zip(vs, specs) if v.steps)
        t += len(run) * (sum(tail[i + 1:]) + head) * _batches(p.score_windows, 8)
        rows_s[i % ctx.hw.processes] += t
    if not gpu:  # the parent block is in the one memory; on a GPU it stays on the host
        work_peak += parent_peak

    def streamed(w: float, nbytes: float, work: float = 0.0) -> dict:  # as Context.streamed, in `nbytes` a weight
        kept = ctx.kept(w, work)
        return {"weights (kept layers)": kept, "layer being read": nbytes * largest * (1 if kept >= w else 2)}

    sweep = streamed(weights, 4.0)
    rows = streamed(held, ctx.hw.compute_bytes, work_peak) | {"layer work and activations": work_peak}
    rows_phase = sum(rows.values()) > sum(sweep.values()) + (0 if gpu else tapes)
    # scoring layer i reads layers i+1.. again, once per group of its variants, where the stream cannot keep them
    after = [ctx.hw.compute_bytes * sum(op.param_count() for op in ctx.blocks()[i + 1:]) for i in range(len(layers))]
    rereads = sum(n * ctx.reads(w, work_peak) for n, w in zip(groups, after)) / ctx.hw.processes + \
        ctx.reads(weights) + weights / ctx.rates.read_rate(ctx.prog)
    fixes = ["fewer --calib-windows / --score-windows or a shorter --seq"]
    if work_peak + ctx.base > ctx.hw.memory_bytes:
        fixes.insert(0, "a grid without the largest trained variants (--grid): a layer holds one variant's "
                        "training (float32 weights, gradient and AdamW's moments) beside its inputs")
    else:
        fixes.insert(0, "a smaller --max-memory (layers are then read again as they are needed)")
    return ctx.stage("library", rows if rows_phase else sweep, sweep_s + max(rows_s) + rereads, fixes,
                     notes=[f"{len(layers)} layers; the sweep on rank 0, the layers' variants shared over "
                            f"{ctx.hw.processes} process(es), one variant at a time"],
                     host={"the sweep's tapes": 0 if rows_phase else tapes,
                           "the parent block": parent_peak if gpu and rows_phase else 0})


# -- the search ------------------------------------------------------------------------------------------------------
def puzzle(ctx: Context, p) -> Stage:
    """The search and the child's realisation from the library (weights read lazily from its files)."""
    start, per_layer = SEARCH_SECONDS
    return ctx.stage("puzzle", {}, start + per_layer * len(ctx.blocks()),
                     notes=["the search runs on the host; the child's weights are read from the library when used"])


# -- distillation ----------------------------------------------------------------------------------------------------
def distill(ctx: Context, p) -> Stage:
    """Student (master weights, gradients, AdamW's moments), teacher (or its stored top-k), the activations of one
    micro-batch and its logits, per process."""
    from ..training.optimizers import MOMENT_BYTES, PARAM_BYTES, state_bytes

    n, world = ctx.params(), ctx.hw.processes
    fsdp = p.shard == "fsdp" and world > 1
    share = world if fsdp else 1
    rows = max(1, math.ceil(p.batch / world / p.accumulate))
    blocks = ctx.blocks() + ([ctx.mtp()] if ctx.mtp() else [])
    largest = max(op.param_count() for op in blocks)
    gathered = 2 * largest * ctx.hw.compute_bytes if fsdp else 0  # a block gathered, the next prefetched
    trainable = ctx.mtp().param_count() if p.head_only and ctx.mtp() else n
    # the trained parameters with their gradients and moments (training.state_bytes); a registered optimizer of
    # its own is counted as AdamW
    algorithm = p.optimizer if p.optimizer in (*MOMENT_BYTES, "adamw-cosine") else "adamw"
    state = state_bytes(p.params, algorithm, p.offload and fsdp, "disk", share)  # its host part: offloaded state
    frozen = PARAM_BYTES[p.params] * (n - trainable) / share
    # offload moves every shard of the student to the host, the frozen trunk's (the MTP head's stage) too
    frozen_host = frozen if p.offload and fsdp else 0.0
    student = frozen - frozen_host + state["device"] * trainable
    kept_best = PARAM_BYTES[p.params] * trainable / share if p.keep_best and p.best == "host" else 0.0
    offloaded = state["host"] * trainable + frozen_host
    teacher_bytes = 1 if p.teacher_dtype == "fp8" else 2 if ctx.hw.kind == "gpu" else 4  # matmul weights: fp8, or
    # the compute dtype on a GPU
    tprog = ctx.teacher or ctx.prog
    t_n, t_blocks = _params(tprog), [n.op for n in tprog.blocks()] + [n.op for n in tprog.find("mtp")]
    teacher = 0.0 if p.teacher_logits else teacher_bytes * t_n / share + gathered
    saved = [saved_bytes(op, rows, p.seq, ctx.device) for op in blocks]
    if p.checkpointing:  # block inputs, and one block's activations recomputed at a time
        acts = 4.0 * rows * p.seq * blocks[0].hidden * len(blocks) + max(saved)
    else:
        acts = sum(saved)
    # between steps the held-out evaluation runs 8 windows at a time without grad: a block's work over them, their
    # residual stream in and out (the training's activations are freed by then)
    e8 = min(8, p.eval_windows)
    evaluation = max(saved_bytes(op, e8, p.seq, ctx.device) for op in blocks) + 2 * 4.0 * e8 * p.seq * blocks[0].hidden
    vocab = ctx.head().vocab
    memory = {"student (weights, gradients, optimizer)": student + gathered, "teacher": teacher,
              "activations (training, or the evaluation between steps)": max(acts, evaluation),
              # every process draws the step's global batch of token ids (int64) and keeps its rows
              "the step's token ids": 8.0 * p.batch * (p.seq + 1),
              "logits (a chunk of tokens)": logits_bytes(vocab, rows, p.seq),
              # the cos term's teacher side: every block's output, float32 residual stream
              "teacher's block outputs": 4.0 * rows * p.seq * blocks[0].hidden * len(ctx.blocks())
              if p.cos and not p.teacher_logits and not p.head_only else 0.0}
    # time: every step trains the student on each micro-batch and runs the teacher over it
    step = sum(ctx.rates.train(op, rows, p.seq) for op in blocks) + ctx.rates.train(ctx.head(), rows, p.seq)
    if not p.teacher_logits:
        step += ctx.forward(rows, p.seq, t_blocks) + ctx.rates.forward(ctx.head(), rows, p.seq)
    if p.checkpointing:
        step += ctx.forward(rows, p.seq, blocks)
    step *= p.accumulate
    if ctx.hw.kind == "gpu" and world > 1:  # gradients reduced (ddp: all-reduce; fsdp: reduce-scatter + gather)
        step += 2 * 4.0 * n * (world - 1) / world / (ctx.hw.target.interconnect_bandwidth or 1e11)
    # held-out evaluations: before, every eval_every steps and after (student and teacher), and the student's bits
    # per byte before and after
    forwards = 2 * (p.steps // p.eval_every + 2) + 2
    eval_s = forwards * _batches(p.eval_windows, 8) * (ctx.forward(e8, p.seq, blocks)
                                                       + ctx.rates.forward(ctx.head(), e8, p.seq))
    fixes = []
    if not fsdp:
        fixes.append("shard=fsdp under torchrun: parameters, gradients and optimizer state divided by the processes")
    # with shard=fsdp and checkpointing: the weights, optimizer state, teacher and best weights divided, the rest not
    unsharded = state_bytes(p.params, algorithm, p.offload, p.best)
    sharded = frozen * share + unsharded["device"] * trainable + (0.0 if p.teacher_logits else teacher_bytes * t_n)
    single = 4.0 * p.seq * (blocks[0].hidden * len(blocks) + saved_floats_max(blocks, p.seq, ctx.device))
    room = ctx.hw.memory_bytes - ctx.base - 4 * largest * ctx.hw.compute_bytes - logits_bytes(vocab, 1, p.seq) - single
    need = math.ceil(sharded / room) if room > 0 else 0
    fixes.append(f"more {'GPUs' if ctx.hw.kind == 'gpu' else 'machines (processes of one share its memory)'} under "
                 "torchrun: with shard=fsdp, "
                 f"checkpointing=true and one row per micro-batch, at least {need} processes"
                 if need else "GPUs with more memory: one row's activations and logits alone do not fit")
    if not p.checkpointing:
        fixes.append("checkpointing=true: block activations recomputed in the backward")
    if p.params == "fp32" or p.optimizer not in ("adamw-bf16", "adamw-8bit"):
        lean = state_bytes("bf16", "adamw-8bit")["device"]
        fixes.append(f"params=bf16,optimizer=adamw-8bit (or adamw-bf16): {lean:.1f} bytes a trained parameter "
                     f"instead of {unsharded['device']:.1f}")
    if fsdp and not p.offload:
        fixes.append("offload=true: the shards, gradients and optimizer state in host memory")
    if not p.teacher_logits and p.teacher_dtype != "fp8":
        fixes.append("teacher_dtype=fp8: the live teacher's weights in a byte each")
    if p.keep_best and p.best == "host" and kept_best + offloaded > ctx.hw.host_bytes / 2:
        fixes.append("best=disk: the kept best weights in the state directory")
    if not p.teacher_logits:
        fixes.append("teacher_logits=DIR (stored top-k logits: no teacher in memory; cos=0, mtp=0)")
    fixes.append(f"a smaller batch per process (accumulate=N, or batch below {p.batch}) or a shorter seq "
                 f"(now {p.seq})")
    name = "distill (MTP head)" if p.head_only else "distill"
    # at the end the trained weights are copied whole into the program (host memory, spilled past a quarter of
    # the budget) while the student and its optimizer are still held
    stored = STORED_BYTES.get(str(ctx.prog.meta.get("dtype", "")), 4)  # handed back in the store's dtype
    handed_back = {"trained weights handed back": min(stored * trainable, ctx.budget / 4),
                   "kept best weights": kept_best, "offloaded state": offloaded}
    return ctx.stage(name, memory, p.steps * step + eval_s, fixes,
                     [f"{rows} row(s) of {p.seq} tokens per micro-batch per process; "
                      f"{'fsdp' if fsdp else 'replicated (ddp)'} over {world} process(es)"], host=handed_back)


# -- the MTP check ---------------------------------------------------------------------------------------------------
def mtp_check(ctx: Context, p) -> Stage:
    """Speculative decoding of the model and its teacher: each prompt read once, then verification steps of
    drafts + 1 tokens (and a re-read of the kept ones after a rejection)."""
    if not ctx.mtp():
        return ctx.stage("mtp-check", {}, 0.0, notes=["no MTP head: nothing to check"])
    weights = 4.0 * ctx.params()
    acceptance = (ctx.prog.meta.get("provenance", {}).get("mtp_acceptance", {}) or {}).get("length") \
        or ACCEPTANCE_GUESS
    steps = p.new_tokens / acceptance
    one = speculative(ctx, p.prompt_len, p.new_tokens, p.drafts, acceptance, verifiers=2)
    return ctx.stage("mtp-check", ctx.streamed(2 * weights), 2 * p.prompts * one + 2 * ctx.reads(2 * weights),
                     notes=[f"{steps:.0f} verification steps per prompt (acceptance {acceptance:g} tokens per step)"])


def speculative(ctx: Context, prompt_len: int, new_tokens: int, drafts: int, acceptance: float,
                verifiers: int = 1) -> float:
    """One prompt of speculative decoding: read once, then `new_tokens / acceptance` steps, each drafting with the
    head and verifying drafts + 1 tokens (`verifiers` models: the MTP check verifies with the teacher too)."""
    steps = new_tokens / acceptance
    return ctx.forward(1, prompt_len) + steps * (verifiers * ctx.forward(1, drafts + 1)
                                                 + drafts * ctx.rates.forward(ctx.mtp(), 1, 1))


# -- quantisation ----------------------------------------------------------------------------------------------------
def quantize(ctx: Context, p) -> Stage:
    """Calibration over `samples` windows (streamed), the quantised copy (spilled past a quarter of the budget)
    and the checkpoint's shards (at most a quarter of the budget each)."""
    n = ctx.params()
    fp4 = "nvfp4" in p.recipe or "fp4" in p.recipe
    quantized = n * (0.5 + 1 / 16 if fp4 else 1.0)
    weights = 4.0 * n
    host = {"quantised copy": min(quantized, ctx.budget / 4) + NEW_TENSOR_BYTES * ctx.tensors(),
            "shard being written": min(quantized, ctx.budget / 4)}
    # one run of the original (calibration) and one of the quantised model (the report's KL), 4 windows a batch
    seconds = 2 * ctx.forward(min(4, p.samples), p.seq) * _batches(p.samples, 4) + ctx.rates.elements(n)
    seconds += 2 * ctx.reads(weights) + weights / ctx.rates.read_rate(ctx.prog)
    return ctx.stage("quantize", ctx.streamed(weights), seconds, ["a smaller --max-memory"],
                     host=host)


# -- writing the result ----------------------------------------------------------------------------------------------
def output(ctx: Context) -> Stage:
    """`run -o`: the checkpoint written in shards of at most a quarter of the budget, each tensor checked as it is
    read back."""
    tensors = ctx.tensors()
    stored = ctx.params() * STORED_BYTES.get(str(ctx.prog.meta.get("dtype", "")), 4)
    seconds = tensors * WRITE_PER_TENSOR + stored / WRITE_RATE
    return ctx.stage("write", {}, seconds, host={"shard being written": min(stored, ctx.budget / 4)}, alone=True)


ESTIMATORS = {"library": library, "puzzle": puzzle, "distill": distill, "mtp-check": mtp_check, "quantize": quantize}
