"""Global knowledge distillation: the current program (the student) learns its teacher's outputs.

Every part of a run is looked up by name in a registry that users extend the same way the built-ins
are registered: loss terms (`register_loss`), data sources (`register_data`), optimiser/schedule
factories (`register_optimizer`) and callbacks (`register_callback`). The loop itself is the shared one
(`training.fit`): resumable from atomic checkpoints, and data-parallel under `torchrun` (gloo on CPU, NCCL
on GPUs), where each process takes its slice of the same global batch. The forward runs in the pass's
compute dtype (bf16 autocast by default on CUDA), the master weights, optimizer state and losses in float32.

Scaling up (see `Distill`):

- `shard=ddp` (and `auto`, today) replicates the student on every process (DDP); `shard=fsdp` shards it with
  PyTorch FSDP2 (`shard_model`), the teacher the same way; its checkpoints are `torch.distributed.checkpoint`
  directories that resume on any number of processes.
- `accumulate=n` runs each process's slice of the global batch as n micro-batches (the same step).
- `checkpointing=true` recomputes each block's activations in the backward (the same numbers, less memory).
- `teacher_logits=DIR` stores the teacher's top-`topk` log-probabilities of every step's batch once
  (`TeacherStore`), so training needs no teacher in memory.
"""
from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F

from .. import evaluate as metrics
from ..backends.torch.device import CPU, Compute
from ..ir import Program
from ..training import FileCheckpoint, Schedule, ShardedCheckpoint, barrier, distributed, fit
from ..tokenizer import check_shared, tokenizer_of
from .core import ComputePass, PassError, Preserved, pipeline_data, register

# -- the registries ------------------------------------------------------------------------------------------
LOSSES: dict[str, Callable] = {}  # name -> fn(batch: Batch) -> scalar tensor
DATA: dict[str, Callable] = {}  # name -> fn(settings: Distill, tokenizer) -> Source
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
    """What a loss term sees: token ids [B, T + 1] (inputs are ids[:, :-1], targets ids[:, 1:]).

    With stored teacher logits (`teacher_logits=`) the teacher's outputs are not there (`teacher.logits` is
    None, no hidden states, no MTP logits); `teacher_topk` holds its top-k log-probabilities and their
    vocabulary indices instead, each [B, T, k]."""

    ids: torch.Tensor
    student: Outputs
    teacher: Outputs
    temperature: float = 1.0
    teacher_topk: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class Source:
    """A data source: `sample(generator)` gives a global batch of token ids [batch, seq + 1]; `held_out`
    the evaluation windows [n, seq + 1]; `token_bytes` the UTF-8 bytes per token id, for bits per byte (None:
    one byte per token)."""

    sample: Callable[[torch.Generator], torch.Tensor]
    held_out: torch.Tensor
    token_bytes: object = None


# -- built-in loss terms ------------------------------------------------------------------------------------------
def soft_kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """`evaluate.kl` of the softened distributions, averaged over positions and scaled by T^2 (Hinton et al.:
    the gradient keeps its size whatever the temperature)."""
    return metrics.kl(teacher_logits, student_logits, temperature).mean() * temperature ** 2


def topk_kl(values: torch.Tensor, indices: torch.Tensor, student_logits: torch.Tensor,
            temperature: float) -> torch.Tensor:
    """`soft_kl` from the teacher's stored top-k (`evaluate.topk_kl`: its mass outside them is dropped; with
    k = the vocabulary it is the full KL)."""
    return metrics.topk_kl(values, indices, student_logits, temperature).mean() * temperature ** 2


@register_loss("kl")
def kl_loss(b: Batch) -> torch.Tensor:
    """KL of the student's next-token distribution from the teacher's (from its stored top-k with
    `teacher_logits=`: see `topk_kl`)."""
    if b.teacher.logits is None and b.teacher_topk is not None:
        return topk_kl(*b.teacher_topk, b.student.logits, b.temperature)
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
    return metrics.nll(b.student.logits, b.ids[:, 1:]).mean()


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
def text_source(d: Distill, tokenizer) -> Source:
    """Random windows of the `data` (or the Python standard library) in the model's tokenization; evaluated on
    the held-out `selection` set, which no reported figure uses (the best weights are chosen there)."""
    from ..data import held_out_windows, load_corpus, random_windows

    corpus = load_corpus(list(d.data) or None, tokenizer=tokenizer)
    return Source(lambda g: random_windows(corpus.train, d.batch, d.seq + 1, g),
                  held_out_windows(corpus, "selection", d.seq + 1, limit=d.eval_windows), corpus.token_bytes)


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


def _reshard(*models) -> None:
    """Frees the unsharded parameters FSDP keeps after a forward without a backward (an evaluation)."""
    for m in models:
        if m is not None and hasattr(m, "reshard"):
            m.reshard()


@torch.no_grad()
def stored_agreement(student, windows: torch.Tensor, values: torch.Tensor, indices: torch.Tensor,
                     batch: int = 8) -> dict:
    """`evaluate.teacher_agreement` from the teacher's stored top-k on `windows` [n, T] (values, indices
    [n, T, k]): the KL as `topk_kl` approximates it, top-1 agreement exactly (the top-k's first index is the
    teacher's argmax)."""
    kl, agree, count = 0.0, 0, 0
    for i in range(0, len(windows), batch):
        ids = windows[i:i + batch]
        out = student(ids)
        logits = out[0] if isinstance(out, tuple) else out
        v, ix = values[i:i + batch].to(logits.device), indices[i:i + batch].to(logits.device)
        kl += metrics.topk_kl(v, ix, logits).sum().item()
        agree += metrics.agrees(ix[..., 0], logits).sum().item()
        count += ids.numel()
    return {"kl": kl / count, "top1_agreement": agree / count}


class Evaluator:
    """Every `every` steps: held-out KL and top-1 agreement with the teacher (and the MTP head's KL); keeps
    the best weights (least `metric`) and calls the user's `on_eval` callbacks. Its state is checkpointed
    with the run, so a resumed run keeps the same best.

    `teacher` None: the teacher's stored top-k on the windows (`stored`: values, indices) stand in for it.
    Under FSDP the best weights are the sharded state dict's clones (each process keeps its shards) and go
    into the sharded checkpoint as such."""

    def __init__(self, model, teacher, windows: torch.Tensor, every: int, metric: str, users: list,
                 stored: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.model, self.teacher, self.windows, self.every, self.metric, self.users = \
            model, teacher, windows, every, metric, users
        self.stored = stored
        self.evals: list[dict] = []
        self.best: dict | None = None
        self.best_weights: dict | None = None

    @torch.no_grad()
    def measure(self) -> dict:
        was = self.model.training
        self.model.eval()
        if self.teacher is None:
            m = stored_agreement(self.model, self.windows, *self.stored)
        else:
            m = metrics.teacher_agreement(self.teacher, self.model, self.windows)
            if self.model.program.find("mtp") and self.teacher.program.find("mtp"):  # from position 1, as the loss
                kl = sum(metrics.kl(self.teacher(ids)[1][:, 1:], self.model(ids)[1][:, 1:]).sum().item()
                         for ids in self.windows.split(8))
                m["mtp_kl"] = kl / self.windows[:, 1:].numel()
        self.model.train(was)
        _reshard(self.model, self.teacher)
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
        """Remembers the current weights when `m` is the best evaluation so far (sharded: this process's
        shards)."""
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


# -- sharding, activation checkpointing ------------------------------------------------------------------------
SHARDS = ("auto", "ddp", "fsdp")


def _mtp_layers(model) -> list:
    return [layer for n in model.program.nodes if n.op.kind == "mtp" for layer in model.get_submodule(n.path).layers]


def checkpoint_blocks(model) -> None:
    """Activation checkpointing: each residual block (the trunk's and the MTP head's) keeps only its input
    in the forward and recomputes the rest in the backward (`torch.utils.checkpoint`, non-reentrant: the
    same numbers, the RNG and autocast state replayed). Forward hooks (`_capture`) see each output once."""
    from torch.utils.checkpoint import checkpoint

    for m in [model.get_submodule(n.path) for n in model.program.blocks()] + _mtp_layers(model):
        def run(*args, _forward=m.forward, **kw):
            if not torch.is_grad_enabled():  # evaluation, the teacher: nothing to save for
                return _forward(*args, **kw)
            return checkpoint(_forward, *args, use_reentrant=False, **kw)
        m.forward = run


def shard_model(model, mesh) -> None:
    """FSDP2 over `mesh`: one group per trunk block and per MTP-head block's mixer, then the root group
    with everything else. Shared parameters stay whole in the root group: the embedding (which a tied LM
    head and the MTP head use by reference), the LM head (the MTP head's too), the final norm, and the MTP
    head's own fusion norms, projection and final norm, which its forward calls outside its blocks.
    Parameters become this process's float32 shards (copies: the weight store is never written). A model
    built on the meta device is loaded one group at a time, each group sharded before the next is read, so
    a process never holds more than its shards and one block in full."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    has = lambda m: any(True for _ in m.parameters())
    for n in model.program.blocks():
        m = _loaded(model, n)
        if has(m):
            fully_shard(m, mesh=mesh)
    for n in model.program.find("mtp"):
        _loaded(model, n)
    for layer in _mtp_layers(model):
        if hasattr(layer, "mixer") and has(layer.mixer):
            fully_shard(layer.mixer, mesh=mesh)
    for n in model.program.nodes:
        _loaded(model, n)
    fully_shard(model, mesh=mesh)
    # routed experts no token chose on some rank get no gradient there: every rank reduce-scatters a zero
    # gradient for them instead, so the collectives match (as DDP's find_unused_parameters)
    model.set_reduce_scatter_unused_params(True)
    for name in ("values", "prefill", "decode"):  # called without forward(): FSDP must still gather the root
        register_fsdp_forward_method(model, name)


def _loaded(model, node):
    """The node's module, its weights read from the program's store (in float32) if it is still on meta."""
    from ..backends.torch import load_into

    m = model.get_submodule(node.path)
    if any(p.is_meta for p in m.parameters()):
        train = any(p.requires_grad for p in m.parameters())
        load_into(m, model.program.weights, "cpu", [node], node.path)
        m.float().requires_grad_(train)
    return m


def _fsdp_available() -> None:
    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard  # noqa: F401
    except ImportError:
        raise PassError(f"distill: shard=fsdp needs PyTorch's FSDP2 (torch.distributed.fsdp.fully_shard), which "
                        f"torch {torch.__version__} lacks; use shard=ddp or a newer torch") from None
    if not hasattr(FSDPModule, "set_reduce_scatter_unused_params"):
        raise PassError(f"distill: shard=fsdp needs FSDPModule.set_reduce_scatter_unused_params (routed experts "
                        f"without tokens) and torch {torch.__version__} lacks it; use shard=ddp or a newer torch")


def _build(prog: Program, compute: Compute, mesh, train: bool, checkpointing: bool):
    """The student (`train`: its own float32 copies of the weights) or the teacher (frozen), sharded over
    `mesh` when there is one."""
    from ..backends.torch import materialize

    if mesh is None:
        m = materialize(prog, dtype=torch.float32, compute=compute)
        if train:
            for param in m.parameters():  # the store's tensors are shared with the teacher and snapshots:
                param.data = param.data.clone()  # training must update copies
    else:  # on meta: shard_model reads one block at a time, shards it and moves the shards to the device
        from ..backends.torch import ProgramModule

        m = ProgramModule(prog, device="meta")
        m.compute = compute
    m.requires_grad_(train)
    if train and checkpointing:
        checkpoint_blocks(m)
    if mesh is not None:
        shard_model(m, mesh)
    return m


def full_state(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, the whole tensor) for the model's state dict, one tensor gathered at a time (sharded ones on
    every process: a collective, so every process must iterate)."""
    for name, t in model.state_dict().items():
        yield name, (t.full_tensor() if hasattr(t, "full_tensor") else t)


# -- stored teacher logits ---------------------------------------------------------------------------------------
CHUNK_BYTES = 256 << 20  # about this much per file of stored top-k (values float32 + indices int32)


def _teacher_outputs(teacher_prog: Program, windows: torch.Tensor, compute: Compute,
                     batch: int = 8) -> Iterator[tuple[slice, dict[str, torch.Tensor]]]:
    """The teacher's next-token logits on `windows` [n, T], per batch of rows: (rows, {"logits": [b, T, V]}).
    The one place the stored logits are computed: streamed layer by layer (`backends.torch.stream`), so the
    teacher need not fit in memory; float32 weights like the live teacher's."""
    from ..backends.torch.stream import StreamedProgram

    net = StreamedProgram(teacher_prog, compute=compute, dtype=torch.float32)
    name = teacher_prog.outputs[0]
    for rows, got in net.outputs(windows, batch=batch, names=(name,)):
        yield rows, {"logits": got[name]}


def _topk_of(teacher_prog, windows, compute, k, token_bytes=None) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    """(top-k log-probabilities [n, T, k] float32, their indices int32, next-token cross-entropy sum in
    nats, UTF-8 bytes of the scored tokens) of the teacher on `windows`."""
    values, indices, ce, count = [], [], 0.0, 0
    for rows, got in _teacher_outputs(teacher_prog, windows, compute):
        v, ix = F.log_softmax(got["logits"].float(), -1).topk(k, dim=-1, sorted=True)
        values.append(v.cpu())
        indices.append(ix.to(torch.int32).cpu())
        ids = windows[rows]
        ce += metrics.nll(got["logits"][:, :-1], ids[:, 1:]).sum().item()
        count += metrics.count_bytes(ids[:, 1:], token_bytes)
    return torch.cat(values), torch.cat(indices), ce, count


def _save_atomic(tensors: dict, path: Path, metadata: dict | None = None) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    os.replace(tmp, path)


class TeacherStore:
    """A directory of the teacher's top-k next-token log-probabilities (of its full-vocabulary log_softmax)
    for every step's global batch, computed once and reused by later runs (and by every process).

    The sampler is deterministic from the seed, so the windows of step s are known ahead: files
    `steps-<first>-<end>.safetensors` hold, for a chunk of steps, `ids` [n, batch, seq + 1] (checked against
    what the sampler draws), `values` [n, batch, seq, k] float32 and `indices` int32; `eval.safetensors` the
    same for the held-out windows (every position), with the teacher's bits per byte there. Each file is
    written atomically (temp file, os.replace), so a directory a kill left half-written is completed, and
    `meta.json` records what the logits are of (the teacher's parent_hash, seed, steps, batch, seq, topk,
    data source): a directory of other settings is refused. Only the next-token logits are stored: the `cos`
    (hidden states) and `mtp` (MTP logits) terms need the live teacher."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.meta = json.loads((self.path / "meta.json").read_text())
        self._chunk: tuple[int, dict] | None = None

    @staticmethod
    def expected(d: Distill, teacher_hash: str, vocab: int) -> dict:
        return {"format": 1, "teacher": teacher_hash, "seed": d.seed, "steps": d.steps,
                "batch": d.batch, "seq": d.seq, "topk": min(d.topk, vocab), "source": d.source,
                "data": list(d.data)}

    @classmethod
    def prepare(cls, path: Path, teacher_prog: Program, d: Distill, source: Source, compute: Compute,
                rank: int = 0, world: int = 1, teacher_hash: str | None = None) -> TeacherStore:
        """The directory for these settings, with every file written (the missing ones now: each process
        computes every world-th chunk); a directory of other settings is refused."""
        from .puzzle.library import parent_hash

        path = Path(path)
        vocab = teacher_prog.find("lm_head")[0].op.vocab if teacher_prog.find("lm_head") else None
        if vocab is None:
            raise PassError("distill: teacher_logits= needs the teacher's LM head (its vocabulary)")
        want = cls.expected(d, teacher_hash or parent_hash(teacher_prog), vocab)
        chunk = max(1, CHUNK_BYTES // max(1, d.batch * d.seq * want["topk"] * 8))
        meta_file = path / "meta.json"
        if meta_file.exists():
            have = json.loads(meta_file.read_text())
            short = lambda k, v: f"{v[:12]}..." if k == "teacher" and isinstance(v, str) else repr(v)
            diff = [f"{k} {short(k, have.get(k))} there, {short(k, v)} here" for k, v in want.items()
                    if have.get(k) != v]
            if diff:
                what = "another teacher" if have.get("teacher") != want["teacher"] else "other settings"
                raise PassError(f"distill: teacher_logits={path} holds the top-k logits of {what} "
                                f"({'; '.join(diff)}); use a new directory, or the settings it was written for")
            chunk = have["chunk"]
        elif rank == 0:
            path.mkdir(parents=True, exist_ok=True)
            tmp = path / f".meta.json.{os.getpid()}.tmp"
            tmp.write_text(json.dumps({**want, "chunk": chunk, "vocab": vocab}, indent=1))
            os.replace(tmp, meta_file)
        path.mkdir(parents=True, exist_ok=True)
        gen = torch.Generator().manual_seed(d.seed)  # the training loop's sampler, replayed
        for c, first in enumerate(range(0, d.steps, chunk)):
            end = min(d.steps, first + chunk)
            ids = torch.stack([source.sample(gen) for _ in range(first, end)])  # [n, batch, seq + 1]
            f = path / cls.chunk_name(first, end)
            if c % world != rank or f.exists():
                continue
            v, ix, _, _ = _topk_of(teacher_prog, ids.reshape(-1, ids.shape[-1])[:, :-1], compute, want["topk"])
            shape = (end - first, d.batch, d.seq, want["topk"])
            _save_atomic({"ids": ids.to(torch.int32), "values": v.reshape(shape), "indices": ix.reshape(shape)}, f)
        ev = path / "eval.safetensors"
        if rank == world - 1 and not cls._eval_matches(ev, source.held_out):
            v, ix, ce, count = _topk_of(teacher_prog, source.held_out, compute, want["topk"], source.token_bytes)
            _save_atomic({"ids": source.held_out.to(torch.int32), "values": v, "indices": ix}, ev,
                         {"teacher_bits_per_byte": repr(ce / count / metrics.LN2)})
        barrier(world)
        store = cls(path)
        missing = [cls.chunk_name(f, min(d.steps, f + chunk)) for f in range(0, d.steps, chunk)
                   if not (path / cls.chunk_name(f, min(d.steps, f + chunk))).exists()]
        if missing:
            raise PassError(f"distill: teacher_logits={path} lacks {missing[0]} after writing it; "
                            "is the directory on a file system every process shares?")
        return store

    @staticmethod
    def chunk_name(first: int, end: int) -> str:
        return f"steps-{first:07d}-{end:07d}.safetensors"

    @staticmethod
    def _eval_matches(f: Path, windows: torch.Tensor) -> bool:
        if not f.exists():
            return False
        from safetensors import safe_open

        with safe_open(str(f), "pt") as h:
            ids = h.get_tensor("ids")
        return ids.shape == windows.shape and torch.equal(ids.long(), windows.long())

    def step(self, step: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's (values, indices) [batch, seq, k] for step `step`'s global batch `ids`."""
        from safetensors.torch import load_file

        chunk = self.meta["chunk"]
        first = step // chunk * chunk
        if self._chunk is None or self._chunk[0] != first:
            self._chunk = (first, load_file(str(self.path / self.chunk_name(first, min(self.meta["steps"],
                                                                                         first + chunk)))))
        got = self._chunk[1]
        if not torch.equal(got["ids"][step - first].long(), ids.long()):
            raise PassError(f"distill: teacher_logits={self.path}: the stored windows of step {step} are not "
                            "the ones the sampler draws (did the data files change?); use a new directory")
        return got["values"][step - first], got["indices"][step - first]

    def held_out(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(values, indices) on the evaluation windows and the teacher's bits per byte there."""
        from safetensors import safe_open

        with safe_open(str(self.path / "eval.safetensors"), "pt") as h:
            bpb = float(h.metadata()["teacher_bits_per_byte"])
            return h.get_tensor("values"), h.get_tensor("indices"), bpb


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
    from .puzzle.library import parent_hash

    if prog.is_meta or teacher_prog.is_meta:
        raise PassError("distill needs weights: the student or the teacher was loaded from a bare config")
    quantized = [n.path for n in prog.nodes if n.op.quant]
    if quantized:
        raise PassError(f"distill trains full-precision weights, but {quantized[0]} is quantized; "
                        "distill before the quantize pass")
    terms = parse_terms(d)
    if d.teacher_logits:
        for name, needs in (("cos", "hidden states"), ("mtp", "MTP-head logits")):
            if name in terms:
                raise PassError(f"distill: teacher_logits= stores only the teacher's next-token top-k, and the {name} "
                                f"term needs its {needs}; set {name}=0 (or leave teacher_logits unset)")
    shard = "fsdp" if d.shard == "fsdp" else "ddp"  # auto: DDP (the built-in and pruned children fit one device)
    if shard == "fsdp":
        _fsdp_available()
    rank, world = distributed()
    if d.batch % world:
        raise PassError(f"distill: batch={d.batch} must divide evenly over the {world} processes")
    per_rank = d.batch // world
    if d.accumulate > per_rank:
        raise PassError(f"distill: accumulate={d.accumulate} micro-batches need a row each, and batch={d.batch} over "
                        f"{world} process(es) gives {per_rank} rows per process; lower accumulate or raise batch")
    if state_dir is not None:
        other = {"ddp": state_dir / "distill_state.dcp", "fsdp": state_dir / "distill_state.pt"}[shard]
        if other.exists():
            raise PassError(f"distill: {state_dir} holds a {'ddp' if shard == 'fsdp' else 'fsdp'} run's checkpoint "
                            f"({other.name}); resume it with shard={'ddp' if shard == 'fsdp' else 'fsdp'}, or use a "
                            "new state directory")
    check_shared(prog, teacher_prog)
    source = _lookup(DATA, d.source, "data source", "source")(d, tokenizer_of(prog))
    schedule = _lookup(OPTIMIZERS, d.optimizer, "optimizer", "optimizer")(d)
    users = [_lookup(CALLBACKS, c, "callback", "callbacks")(d) for c in d.callbacks]

    teacher_hash = parent_hash(teacher_prog)
    store = None
    if d.teacher_logits:  # before the student is built: the streamed teacher has the memory to itself
        store = TeacherStore.prepare(Path(d.teacher_logits), teacher_prog, d, source, compute, rank, world,
                                     teacher_hash)
    torch.manual_seed(d.seed)
    mesh = None
    if shard == "fsdp" and world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(compute.device.type, (world,))
    student = _build(prog, compute, mesh, train=True, checkpointing=d.checkpointing)
    teacher = None if store else _build(teacher_prog, compute, mesh, train=False, checkpointing=False)
    head = [n.path for n in prog.nodes if n.op.kind == "mtp"]
    if d.head_only:
        if not head:
            raise PassError("distill: head_only=true trains the MTP head, and this model has none")
        for name, p in student.named_parameters():  # the head's own tensors; embedding and LM head stay
            p.requires_grad_(name.startswith(head[0] + "."))
    net, no_sync = student, None
    if shard == "ddp" and world > 1:
        from torch.nn.parallel import DistributedDataParallel

        ids = [compute.device.index] if compute.device.type == "cuda" else None
        net = DistributedDataParallel(student, device_ids=ids, find_unused_parameters=True)  # unrouted experts
        no_sync = net.no_sync  # micro-batches before the last: one all-reduce per step
    # (FSDP reduce-scatters every micro-batch's gradients: accumulating them unsharded would undo the sharding)
    s_seen, s_undo = _capture(student)
    t_seen, t_undo = _capture(teacher) if teacher is not None else ([], lambda: None)
    gen = torch.Generator().manual_seed(d.seed)
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    micro = [(int(r[0]), int(r[-1]) + 1) for r in torch.arange(per_rank).tensor_split(d.accumulate)]
    current: dict = {}

    def step_loss(step: int, k: int = 0):
        if k == 0:  # every process draws the same global batch and keeps its slice
            ids = source.sample(gen)
            current["ids"] = ids[rows].to(compute.device)
            if store is not None:
                v, ix = store.step(step, ids)
                current["topk"] = (v[rows].to(compute.device), ix[rows].to(compute.device))
        lo, hi = micro[k]
        ids = current["ids"][lo:hi]
        x = ids[:, :-1]
        if store is None:
            with torch.no_grad():
                t_out, topk = _outputs(teacher, t_seen, x), None
        else:
            t_out, topk = Outputs(None, None, []), tuple(t[lo:hi] for t in current["topk"])
        b = Batch(ids, _outputs(net, s_seen, x), t_out, d.temperature, topk)
        parts = {name: LOSSES[name](b) for name in terms}
        share = (hi - lo) / per_rank  # the micro-batch's part of the step's mean: the shares sum to 1
        loss = sum(w * parts[n] for n, w in terms.items())
        if d.accumulate > 1:
            loss = loss * share
        return loss, {n: v.item() * share for n, v in parts.items()}

    metric = "mtp_kl" if d.head_only else "kl"
    stored_eval = None
    if store is not None:
        *stored_eval, teacher_bpb = store.held_out()
    ev = Evaluator(student, teacher, source.held_out, d.eval_every, metric, users, stored_eval)
    identity = {**d.options(), "callbacks": list(d.callbacks), "student": parent_hash(prog),
                "teacher": teacher_hash}  # not the process count: the global batch is the same
    identity["teacher_logits"] = bool(d.teacher_logits)  # what it holds is checked by its meta.json, not where
    if not d.teacher_logits:
        identity.pop("topk")
    # none of these changes what is trained (the same global batch, the same numbers): a run may resume
    # elsewhere, on another number of devices, with more micro-batches or recomputed activations
    for option in ("eval_windows", "device", "shard", "accumulate", "checkpointing"):
        identity.pop(option, None)
    if state_dir is None:
        checkpoint = None
    elif shard == "fsdp":
        checkpoint = ShardedCheckpoint(state_dir / "distill_state.dcp")
    else:
        checkpoint = FileCheckpoint(state_dir / "distill_state.pt", write=rank == 0)
    with warnings.catch_warnings():
        # FSDP2 warns of blocks returning views (their decode states): nothing here changes them in place
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        before = {**ev.measure(), "bits_per_byte": metrics.bits_per_byte(student, source.held_out,
                                                                          token_bytes=source.token_bytes)}
        _reshard(student)
        ev.keep({"step": 0, **before})  # the starting point competes too: distillation must earn its keep
        try:
            run = fit(student, step_loss, schedule, rng=gen, every=d.checkpoint_every, identity=identity,
                      checkpoint=checkpoint, desc="distill", progress=progress and rank == 0, callbacks=[ev],
                      micro=d.accumulate, no_sync=no_sync, zero_unused=shard == "fsdp" and world == 1)
        finally:
            s_undo(), t_undo()
        after = ev.measure()
        if d.keep_best and ev.best is not None and ev.best[metric] < after[metric]:
            student.load_state_dict(ev.best_weights)
            after = ev.measure()
        for name, t in full_state(student):  # whole tensors on every process: later passes run on each
            prog.weights.set(name, t.detach().clone().to("cpu", prog.weights.dtype(name)))
            prog.weights.spill_over(compute.budget // 4)  # past the budget, to scratch files as they come
        after["bits_per_byte"] = metrics.bits_per_byte(student, source.held_out, token_bytes=source.token_bytes)
        if teacher is not None:
            teacher_bpb = metrics.bits_per_byte(teacher, source.held_out, token_bytes=source.token_bytes)
        _reshard(student, teacher)
    return {"steps": run.step, "resumed_from": run.resumed_from, "stopped": run.stopped, "terms": terms,
            "before": before, "after": after, "teacher_bits_per_byte": teacher_bpb, "shard": shard,
            "evals": ev.evals, "best": ev.best, "log": run.log, "seconds": round(run.seconds, 2)}


@register("distill")
class Distill(ComputePass):
    """Recover quality by knowledge distillation from a teacher (a snapshot or a checkpoint path).

    Under `torchrun` each process takes its slice of the same global `batch` (so the result does not depend
    on the process count). `shard`: `ddp` replicates the student on every process and all-reduces the
    gradients (DDP); `fsdp` shards parameters, gradients and optimizer state (float32 master weights) over
    the processes with FSDP2, and the teacher's parameters too, for a model one device cannot train; its
    checkpoints (`state=`) are sharded and resume on any number of processes; with one process it runs
    unsharded through the same loop and checkpoint format. `auto` is ddp for now (the models puzzlekit
    distills fit one device; choose fsdp explicitly). `accumulate=n` splits each process's rows into n
    micro-batches with one optimizer step (the same step as one big batch); `checkpointing=true`
    recomputes block activations in the backward. `teacher_logits=DIR` computes the teacher's top-`topk`
    next-token log-probabilities for every step once (streamed layer by layer), stores them in DIR, and
    trains from them without a teacher in memory: the KL is then over the teacher's renormalised top-k
    (`topk_kl`; exact at topk = vocabulary), and the cos and mtp terms, which need the live teacher, must be
    set to 0. Neither `shard`, `accumulate` nor `checkpointing` is part of what a resumed run must match.
    """

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
    # scaling up: how the student is spread over the torchrun processes (auto: ddp; see below)
    shard: str = "auto"
    checkpointing: bool = False  # recompute each block's activations in the backward (less memory, same numbers)
    accumulate: int = 1  # micro-batches per step: each process's rows of the global batch in this many parts
    teacher_logits: str = ""  # a directory of the teacher's stored top-k logits ("": run the teacher live)
    topk: int = 64  # how many of the teacher's log-probabilities per token teacher_logits stores
    minimum: ClassVar[dict] = {"steps": 1, "batch": 1, "seq": 2, "eval_every": 1, "eval_windows": 1,
                               "checkpoint_every": 1, "warmup": 0, "lr": 1e-12, "temperature": 1e-6,
                               "accumulate": 1, "topk": 1}

    def __post_init__(self):
        super().__post_init__()
        if self.shard not in SHARDS:
            raise PassError(f"pass 'distill': shard={self.shard!r} is not one of {', '.join(SHARDS)} (ddp: a replica "
                            "per process; fsdp: parameters, gradients and optimizer state sharded over them)")

    def run(self, prog, am):
        if self.head_only and not prog.find("mtp"):  # compress's recovery stage, on a model without a head
            print("distill: head_only=true, and the model has no MTP head: nothing to train", file=sys.stderr)
            return Preserved.all()
        state_dir = None
        if self.state:
            state_dir = Path(self.state)
            rounds = getattr(am, "round", (1, 1))
            if rounds[1] > 1:  # each round of repeat{...} resumes its own run
                state_dir = state_dir / f"round{rounds[0]}"
            state_dir.mkdir(parents=True, exist_ok=True)
        ins = getattr(am, "instrument", None)
        settings = replace(self, data=pipeline_data(self.data, am))
        report = distill(prog, teacher_program(self.teacher, am), settings, state_dir, bool(ins and ins.progress),
                         self.compute(am))
        am.reports.setdefault("distill", []).append(report)
        return Preserved.structure_only()
