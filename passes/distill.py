"""Global knowledge distillation: the current program (the student) learns its teacher's outputs.

Every part of a run is looked up by name in a registry that users extend the same way the built-ins
are registered: loss terms (`register_loss`), data sources (`register_data`), optimiser/schedule
factories (`register_optimizer`) and callbacks (`register_callback`). The loop itself is the shared one
(`training.fit`): resumable from atomic checkpoints, and data-parallel under `torchrun` (DDP, gloo on CPU,
NCCL on GPUs), where each process takes its slice of the same global batch. The forward runs in the pass's
compute dtype (bf16 autocast by default on CUDA), the master weights, optimizer state and losses in float32.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..backends.torch.device import CPU, Compute
from ..ir import Program
from ..training import Schedule, distributed, fit
from .core import ComputePass, PassError, Preserved, register

# -- the registries ------------------------------------------------------------------------------------------
LOSSES: dict[str, Callable] = {}  # name -> fn(batch: Batch) -> scalar tensor
DATA: dict[str, Callable] = {}  # name -> fn(settings: Distill) -> Source
OPTIMIZERS: dict[str, Callable] = {}  # name -> fn(settings: Distill) -> a Schedule-like object (see training.fit)
CALLBACKS: dict[str, Callable] = {}  # name -> fn(settings: Distill) -> object with on_step / on_eval


def _registrar(table: dict, what: str):
    def register_as(name: str):
        def wrap(fn):
            if name in table and table[name] is not fn:
                raise PassError(f"a {what} named {name!r} is already registered ({table[name].__module__})")
            table[name] = fn
            return fn
        return wrap
    return register_as


register_loss = _registrar(LOSSES, "loss term")
register_data = _registrar(DATA, "data source")
register_optimizer = _registrar(OPTIMIZERS, "optimizer")
register_callback = _registrar(CALLBACKS, "callback")


@dataclass
class Outputs:
    """One model's outputs on a batch: next-token logits, MTP logits (None without a head), and the output
    of every block (layer i's residual stream after it; a noop block's output is its input)."""

    logits: torch.Tensor
    mtp: torch.Tensor | None
    hidden: list[torch.Tensor]


@dataclass
class Batch:
    """What a loss term sees: token ids [B, T + 1] (inputs are ids[:, :-1], targets ids[:, 1:])."""

    ids: torch.Tensor
    student: Outputs
    teacher: Outputs
    temperature: float = 1.0


@dataclass
class Source:
    """A data source: `sample(generator)` gives a global batch of token ids [batch, seq + 1]; `held_out`
    the evaluation windows [n, seq + 1]."""

    sample: Callable[[torch.Generator], torch.Tensor]
    held_out: torch.Tensor


# -- built-in loss terms ------------------------------------------------------------------------------------------
def soft_kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(teacher || student) of the softened distributions, nats per token, scaled by T^2 (Hinton et al.)."""
    t = F.log_softmax(teacher_logits.float() / temperature, -1)
    s = F.log_softmax(student_logits.float() / temperature, -1)
    return (t.exp() * (t - s)).sum(-1).mean() * temperature ** 2


@register_loss("kl")
def kl_loss(b: Batch) -> torch.Tensor:
    """KL of the student's next-token distribution from the teacher's."""
    return soft_kl(b.teacher.logits, b.student.logits, b.temperature)


@register_loss("cos")
def cosine_loss(b: Batch) -> torch.Tensor:
    """1 - cosine similarity of the hidden states at every block boundary, averaged over layers and tokens."""
    if len(b.student.hidden) != len(b.teacher.hidden):
        raise PassError(f"the cos loss pairs layers one to one, but the student has {len(b.student.hidden)} "
                        f"layers and the teacher {len(b.teacher.hidden)}; set cos=0")
    terms = [1 - F.cosine_similarity(s.float(), t.float(), dim=-1).mean()
             for s, t in zip(b.student.hidden, b.teacher.hidden)]
    return torch.stack(terms).mean()


@register_loss("lm")
def lm_loss(b: Batch) -> torch.Tensor:
    """Next-token cross-entropy on the text itself."""
    logits = b.student.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), b.ids[:, 1:].reshape(-1))


@register_loss("mtp")
def mtp_loss(b: Batch) -> torch.Tensor:
    """KL of the student's MTP-head distribution from the teacher's (from position 1: position 0 of the
    head sees no trunk state)."""
    if b.student.mtp is None or b.teacher.mtp is None:
        who = "student" if b.student.mtp is None else "teacher"
        raise PassError(f"the mtp loss needs an MTP head on both models, and the {who} has none; set mtp=0")
    return soft_kl(b.teacher.mtp[:, 1:], b.student.mtp[:, 1:], b.temperature)


# -- built-in data, optimiser ---------------------------------------------------------------------------------------
@register_data("text")
def text_source(d: Distill) -> Source:
    """Random windows of byte-level text (the `data` files, or the Python standard library)."""
    from ..data import load_corpus, random_windows, sequential_windows

    corpus = load_corpus(list(d.data) or None)
    return Source(lambda g: random_windows(corpus.train, d.batch, d.seq + 1, g),
                  sequential_windows(corpus.valid, d.seq + 1, limit=d.eval_windows))


@register_optimizer("adamw-cosine")
def adamw_cosine(d: Distill) -> Schedule:
    """AdamW with linear warmup and cosine decay to a tenth of the learning rate."""
    return Schedule(d.steps, d.lr, warmup=min(d.warmup, d.steps), weight_decay=0.0)


# -- the run ---------------------------------------------------------------------------------------------------------
def _capture(model) -> tuple[list, Callable]:
    """Hooks that record every block's output on each forward; returns (the list, the undo function)."""
    seen: list[torch.Tensor] = []
    hooks = [model.get_submodule(n.path).register_forward_hook(lambda m, a, out: seen.append(out[0]))
             for n in model.program.blocks()]
    return seen, lambda: [h.remove() for h in hooks]


def _outputs(net, seen: list, x: torch.Tensor) -> Outputs:
    seen.clear()
    out = net(x)
    logits, mtp = out if isinstance(out, tuple) else (out, None)
    return Outputs(logits, mtp, list(seen))


def parse_terms(d: Distill) -> dict[str, float]:
    """The loss weights: the built-in options, then `loss=[name:weight,...]`; unknown names are refused."""
    weights = {"mtp": d.mtp} if d.head_only else {"kl": d.kl, "cos": d.cos, "lm": d.lm, "mtp": d.mtp}
    for item in d.loss:
        name, _, w = item.partition(":")
        try:
            weights[name] = float(w) if w else 1.0
        except ValueError:
            raise PassError(f"distill: loss={item!r}: the weight after ':' must be a number") from None
    unknown = [n for n in weights if n not in LOSSES]
    if unknown:
        raise PassError(f"distill: unknown loss term(s) {unknown}; registered: {', '.join(sorted(LOSSES))} "
                        "(register one with puzzlekit.passes.distill.register_loss)")
    return {n: w for n, w in weights.items() if w}


def _lookup(table: dict, name: str, what: str, option: str):
    if name not in table:
        raise PassError(f"distill: unknown {what} {name!r} ({option}=); registered: {', '.join(sorted(table))}")
    return table[name]


class Evaluator:
    """Every `every` steps: held-out KL and top-1 agreement with the teacher (and the MTP head's KL); keeps
    the best weights (least `metric`) and calls the user's `on_eval` callbacks. Its state is checkpointed
    with the run, so a resumed run keeps the same best."""

    def __init__(self, model, teacher, windows: torch.Tensor, every: int, metric: str, users: list):
        self.model, self.teacher, self.windows, self.every, self.metric, self.users = \
            model, teacher, windows, every, metric, users
        self.evals: list[dict] = []
        self.best: dict | None = None
        self.best_weights: dict | None = None

    @torch.no_grad()
    def measure(self) -> dict:
        from ..evaluate import teacher_agreement

        was = self.model.training
        self.model.eval()
        m = teacher_agreement(self.teacher, self.model, self.windows)
        if self.model.program.find("mtp") and self.teacher.program.find("mtp"):
            kl = [soft_kl(self.teacher(ids)[1][:, 1:], self.model(ids)[1][:, 1:], 1.0).item()
                  for ids in self.windows.split(8)]
            m["mtp_kl"] = sum(kl) / len(kl)
        self.model.train(was)
        return m

    def on_step(self, step: int, parts: dict) -> bool:
        stop = False
        for cb in self.users:
            if hasattr(cb, "on_step"):
                stop |= bool(cb.on_step(step, parts))
        if step % self.every:
            return stop
        m = {"step": step, **self.measure()}
        self.evals.append(m)
        self.keep(m)
        for cb in self.users:
            if hasattr(cb, "on_eval"):
                stop |= bool(cb.on_eval(step, m))
        return stop

    def keep(self, m: dict) -> None:
        """Remembers the current weights when `m` is the best evaluation so far."""
        if self.best is None or m[self.metric] < self.best[self.metric]:
            self.best = m
            self.best_weights = {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def state_dict(self) -> dict:
        return {"evals": self.evals, "best": self.best, "best_weights": self.best_weights,
                "users": [cb.state_dict() if hasattr(cb, "state_dict") else None for cb in self.users]}

    def load_state_dict(self, st: dict) -> None:
        self.evals, self.best, self.best_weights = st["evals"], st["best"], st["best_weights"]
        for cb, s in zip(self.users, st["users"]):
            if s is not None:
                cb.load_state_dict(s)


def teacher_program(name: str, am) -> Program:
    """A snapshot taken earlier in the pipeline, or a checkpoint path."""
    if name in am.snapshots:
        return am.snapshots[name]
    if Path(name).exists():
        from ..ir import load

        return load(name)
    raise PassError(f"distill: teacher {name!r} is neither a snapshot ({', '.join(am.snapshots) or 'none taken'}) "
                    "nor a checkpoint path; add snapshot{name=" + name + "} before the passes that change the model")


def distill(prog: Program, teacher_prog: Program, d: Distill, state_dir: Path | None = None,
            progress: bool = False, compute: Compute = CPU) -> dict:
    """Trains `prog`'s weights in place against `teacher_prog` on `compute`'s device and precision; returns
    the run's report."""
    from ..backends.torch import materialize
    from ..evaluate import bits_per_byte
    from .puzzle.library import parent_hash

    if prog.is_meta or teacher_prog.is_meta:
        raise PassError("distill needs weights: the student or the teacher was loaded from a bare config")
    quantized = [n.path for n in prog.nodes if n.op.quant]
    if quantized:
        raise PassError(f"distill trains full-precision weights, but {quantized[0]} is quantized; "
                        "distill before the quantize pass")
    terms = parse_terms(d)
    rank, world = distributed()
    if d.batch % world:
        raise PassError(f"distill: batch={d.batch} must divide evenly over the {world} processes")
    source = _lookup(DATA, d.source, "data source", "source")(d)
    schedule = _lookup(OPTIMIZERS, d.optimizer, "optimizer", "optimizer")(d)
    users = [_lookup(CALLBACKS, c, "callback", "callbacks")(d) for c in d.callbacks]

    torch.manual_seed(d.seed)
    student = materialize(prog, dtype=torch.float32, compute=compute)
    teacher = materialize(teacher_prog, dtype=torch.float32, compute=compute)
    teacher.requires_grad_(False)
    for param in student.parameters():  # the store's tensors are shared with the teacher and snapshots:
        param.data = param.data.clone()  # training must update copies
    head = [n.path for n in prog.nodes if n.op.kind == "mtp"]
    if d.head_only:
        if not head:
            raise PassError("distill: head_only=true trains the MTP head, and this model has none")
        for name, p in student.named_parameters():  # the head's own tensors; embedding and LM head stay
            p.requires_grad_(name.startswith(head[0] + "."))
    net = student
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        ids = [compute.device.index] if compute.device.type == "cuda" else None
        net = DistributedDataParallel(student, device_ids=ids, find_unused_parameters=True)  # unrouted experts
    s_seen, s_undo = _capture(student)
    t_seen, t_undo = _capture(teacher)
    gen = torch.Generator().manual_seed(d.seed)
    rows = slice(rank * d.batch // world, (rank + 1) * d.batch // world)

    def step_loss(step: int):
        ids = source.sample(gen)[rows].to(compute.device)  # every process draws the same global batch, keeps its slice
        x = ids[:, :-1]
        with torch.no_grad():
            t_out = _outputs(teacher, t_seen, x)
        b = Batch(ids, _outputs(net, s_seen, x), t_out, d.temperature)
        parts = {name: LOSSES[name](b) for name in terms}
        loss = sum(w * parts[n] for n, w in terms.items())
        return loss, {n: v.item() for n, v in parts.items()}

    metric = "mtp_kl" if d.head_only else "kl"
    ev = Evaluator(student, teacher, source.held_out, d.eval_every, metric, users)
    before = {**ev.measure(), "bits_per_byte": bits_per_byte(student, source.held_out)}
    ev.keep({"step": 0, **before})  # the starting point competes too: distillation must earn its keep
    identity = {**d.options(), "callbacks": list(d.callbacks), "student": parent_hash(prog),
                "teacher": parent_hash(teacher_prog)}  # not the process count: the global batch is the same
    for option in ("eval_windows", "device"):  # neither changes what is trained: a run may resume elsewhere
        identity.pop(option, None)
    try:
        run = fit(student, step_loss, schedule, rng=gen, every=d.checkpoint_every, identity=identity,
                  state_file=None if state_dir is None else state_dir / "distill_state.pt", write=rank == 0,
                  desc="distill", progress=progress, callbacks=[ev])
    finally:
        s_undo(), t_undo()
    after = ev.measure()
    if d.keep_best and ev.best is not None and ev.best[metric] < after[metric]:
        student.load_state_dict(ev.best_weights)
        after = ev.measure()
    for name, t in student.state_dict().items():
        prog.weights.set(name, t.detach().clone().to("cpu", prog.weights.get(name).dtype))
    after["bits_per_byte"] = bits_per_byte(student, source.held_out)
    return {"steps": run.step, "resumed_from": run.resumed_from, "stopped": run.stopped, "terms": terms,
            "before": before, "after": after, "teacher_bits_per_byte": bits_per_byte(teacher, source.held_out),
            "evals": ev.evals, "best": ev.best, "log": run.log, "seconds": round(run.seconds, 2)}


@register("distill")
class Distill(ComputePass):
    """Recover quality by knowledge distillation from a teacher (a snapshot or a checkpoint path)."""

    teacher: str = "teacher"
    steps: int = 200
    lr: float = 3e-4
    warmup: int = 10
    batch: int = 8
    seq: int = 128
    kl: float = 1.0
    cos: float = 1.0
    lm: float = 0.0
    mtp: float = 1.0
    temperature: float = 1.0
    loss: list[str] = field(default_factory=list)  # more registered terms: name or name:weight
    source: str = "text"
    data: list[str] = field(default_factory=list)
    optimizer: str = "adamw-cosine"
    callbacks: list[str] = field(default_factory=list)
    eval_every: int = 50
    eval_windows: int = 16
    keep_best: bool = True
    state: str = ""  # a directory for resumable checkpoints ("" : none)
    checkpoint_every: int = 50
    seed: int = 0
    head_only: bool = False  # train only the MTP head's own weights (after the trunk is final)
    minimum: ClassVar[dict] = {"steps": 1, "batch": 1, "seq": 2, "eval_every": 1, "eval_windows": 1,
                               "checkpoint_every": 1, "warmup": 0, "lr": 1e-12, "temperature": 1e-6}

    def run(self, prog, am):
        state_dir = None
        if self.state:
            state_dir = Path(self.state)
            rounds = getattr(am, "round", (1, 1))
            if rounds[1] > 1:  # each round of repeat{...} resumes its own run
                state_dir = state_dir / f"round{rounds[0]}"
            state_dir.mkdir(parents=True, exist_ok=True)
        ins = getattr(am, "instrument", None)
        report = distill(prog, teacher_program(self.teacher, am), self, state_dir, bool(ins and ins.progress),
                         self.compute(am))
        am.reports.setdefault("distill", []).append(report)
        return Preserved.structure_only()
