"""Runs a Program one node at a time, within a memory budget, so a model larger than memory still runs.

A node's module is built and its weights read from the store (lazily, from the checkpoint) when it runs;
modules are kept while the weights kept by every stream of the process, and the work held beside them
(`holding`: a library layer's variants and their training), fit half the budget, and the rest are read again
when next used: layers are visited in order, again and again (every sweep, every layer scored), and for such
scans keeping a fixed set beats evicting the least recently used (which would keep none of the layers that
come next); a caller that knows a layer will not be read again drops it (`release(nodes)`). `sweep` runs the
trunk node-major, every window through one node before the next node is read, so each layer is read once per
sweep, and keeps each value as a `Tape` of per-batch tensors in host memory that spills to scratch files past
a quarter of the budget. The nodes after the last block (final norm, LM head, MTP head) then run batch by
batch, so logits are never held for more than one batch.

`StreamedProgram` answers like `ProgramModule` for what evaluation and the passes use: `outputs(windows)`,
a call on one batch, `values`, `get_submodule` of a node, `program` and `compute`.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ...ir.program import Node, Program
from ...memory import scratch_file
from . import _dense, head_matrix, hold_in, load_into, run_nodes
from .device import CPU, Compute

#: attach(node, module) -> finish() or None: called before a node runs over the windows; finish() after it
Attach = Callable[[Node, nn.Module], Callable[[], None] | None]


def to_host(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(a host copy of `t`, whether it is in pinned memory). A CUDA tensor is copied into page-locked memory
    without waiting (the copy is queued on the stream, before anything that reuses `t`'s memory, and so is
    the copy back); any other is copied as it is."""
    if t.device.type != "cuda":
        return t.detach().cpu(), False
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t.detach(), non_blocking=True)
    return host, True


class Tape:
    """One value for every batch of windows, kept in host memory up to `room` bytes (shared by the tapes of
    one sweep; pinned for CUDA values, copied both ways without waiting), past it in scratch files; read
    back onto the device it came from."""

    def __init__(self, room: list[int]):
        self._items: list = []
        self._room = room

    def append(self, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        if n <= self._room[0]:
            self._room[0] -= n
            self._items.append((*to_host(t), t.device))
            return
        f = scratch_file(".safetensors")
        save_file({"t": t.detach().cpu().contiguous()}, str(f))  # the file needs the bytes now: a blocking copy
        self._items.append((f, False, t.device))

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, b: int) -> torch.Tensor:
        held, pinned, device = self._items[b]
        if isinstance(held, torch.Tensor):
            return held.to(device, non_blocking=pinned)
        return load_file(str(held))["t"].to(device)

    def cat(self) -> torch.Tensor:
        return torch.cat([self[b] for b in range(len(self))])

    def __del__(self):
        for held, _, _ in self._items:  # duck-typed: at interpreter exit `torch` may already be gone
            if hasattr(held, "unlink"):
                held.unlink(missing_ok=True)
            else:
                self._room[0] += held.numel() * held.element_size()
        self._items = []


class Recorded:
    """A model's outputs on one set of windows in one batching (`StreamedProgram.record`), in tapes sharing
    `room` bytes: `outputs` as a streamed model's, for those windows and that batch only."""

    def __init__(self, source: StreamedProgram, windows: torch.Tensor, batch: int, room: list[int],
                 project: bool = True):
        self.source, self.windows, self.batch, self.room, self.tapes = source, windows, batch, room, {}
        self.project = project  # false: the hidden states the LM head would project were recorded
        self.compute = source.compute

    def head_module(self) -> nn.Module:
        return self.source.head_module()

    def head_weight(self) -> torch.Tensor:
        return self.source.head_weight()

    def named_parameters(self):
        """The recorded model's weights, to name the non-finite ones when its outputs are not finite."""
        return self.source.named_parameters()

    def add(self, out: dict) -> None:
        for name, value in out.items():
            self.tapes.setdefault(name, Tape(self.room)).append(value)

    def outputs(self, windows: torch.Tensor, batch: int = 8, project: bool = True):
        if batch != self.batch or not torch.equal(windows, self.windows) or project != self.project:
            raise ValueError("recorded outputs are read for the windows and batch they were recorded on, projected or "
                             "not as they were recorded")
        start = 0
        for b in range(len(next(iter(self.tapes.values())))):
            vals = {name: tape[b] for name, tape in self.tapes.items()}
            rows = len(next(iter(vals.values())))
            yield slice(start, start + rows), vals
            start += rows


def module_bytes(m: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])


#: bytes of the modules kept by all streams of this process and of the work held beside them (`holding`): the
#: budget is the process's
_kept = [0]
#: the live streams, whose kept modules make room for held work
_streams: weakref.WeakSet = weakref.WeakSet()


@contextmanager
def holding(nbytes: int):
    """Counts `nbytes` of work held outside the streams (a library layer's parent weights, variants and their
    training state) against the room of kept modules while it lasts: kept modules are dropped, the last kept
    first, until they fit beside it, and no module is kept that would not."""
    _kept[0] += nbytes
    try:
        for stream in list(_streams):
            stream._fit()
        yield
    finally:
        _kept[0] -= nbytes


class StreamedProgram:
    """`prog` run node by node on `compute`'s device, in its precision, within its memory budget; `dtype`
    casts the weights as they are read (float32 for the passes that need the parent's exact numbers)."""

    def __init__(self, prog: Program, compute: Compute = CPU, dtype: torch.dtype | None = None):
        self.program, self.compute, self.dtype = prog, compute, dtype
        self.budget = compute.budget
        #: room for kept modules: half the budget, and on a GPU at most half of its free memory
        self.room = self.budget // 2
        if compute.device.type == "cuda":
            self.room = min(self.room, torch.cuda.mem_get_info(compute.device)[0] // 2)
        self._cache: dict[str, tuple[nn.Module, int]] = {}
        self.reads = 0  # modules built from the store (a measure of the weight traffic, for tests and benchmarks)
        _streams.add(self)

    # -- modules -----------------------------------------------------------------------------------------------
    def module(self, node: Node | str) -> nn.Module:
        """The node's module, with its weights (built on first use, then cached while it fits)."""
        node = self.program.node(node) if isinstance(node, str) else node
        if node.path in self._cache:
            return self._cache[node.path][0]
        with torch.device("meta"):  # no initialisation: every tensor is assigned from the store
            m = node.op.build()
        load_into(m, self.program.weights, self.compute.device, [node], node.path)
        if self.dtype is not None:
            m.to(self.dtype)
        else:  # inference in the forward's precision: weights cast once, not in every call
            hold_in(m, self.compute.dtype)
        kind = lambda k: self.program.find(k)[0]
        if node.op.kind == "lm_head" and node.op.tied:
            m.bind(self.module(kind("embed")))
        if node.op.kind == "mtp":
            m.bind(self.module(kind("embed")), self.module(kind("lm_head")))
        m.eval().requires_grad_(False)
        self.reads += 1
        size = module_bytes(m)
        if _kept[0] + size <= self.room:
            self._cache[node.path] = (m, size)
            _kept[0] += size
        return m

    def get_submodule(self, path: str) -> nn.Module:
        """A node's module by its path (what hooks and drafters look up on a ProgramModule)."""
        return self.module(path)

    def named_parameters(self):
        """(name, dense tensor) of every weight, read one at a time (to name the non-finite ones)."""
        w = self.program.weights
        for n in self.program.nodes:
            for local in n.op.params():
                yield f"{n.path}.{local}", _dense(w.get(f"{n.path}.{local}"))

    def release(self, nodes=None) -> None:
        """Drops the kept modules, or those of `nodes` (nodes or paths; say, layers a scan will not read again):
        their weights are read again when next used."""
        paths = list(self._cache) if nodes is None else [n if isinstance(n, str) else n.path for n in nodes]
        for path in paths:
            if path in self._cache:
                _kept[0] -= self._cache.pop(path)[1]

    def kept_bytes(self) -> int:
        """Bytes of the modules this stream keeps."""
        return sum(size for _, size in self._cache.values())

    def _fit(self) -> None:
        """Drops kept modules, the last kept first, while the process keeps more than this stream's room."""
        while _kept[0] > self.room and self._cache:
            _kept[0] -= self._cache.pop(next(reversed(self._cache)))[1]

    def __del__(self):
        if _kept is not None:  # None at interpreter exit, when there is nothing left to account for
            self.release()

    # -- running ----------------------------------------------------------------------------------------------
    def _apply(self, node: Node, m: nn.Module, args: list, project: bool = True) -> torch.Tensor:
        """`node`'s output; `project` false: the LM head and the MTP head's projection left out (their inputs)."""
        if not project and node.op.kind == "lm_head":
            return args[0]
        with self.compute.autocast():
            if node.op.kind == "mtp" and not project:
                out = m(*args, None, False, False)
            else:
                out = m(*args, None, False) if node.op.is_block or node.op.kind == "mtp" else m(*args)
        return out[0] if isinstance(out, tuple) else out

    def head_module(self) -> nn.Module:
        return self.module(self.program.find("lm_head")[0])

    def head_weight(self) -> torch.Tensor:
        """The LM head's matrix (the embedding's when tied): with `outputs(project=False)`, what the metrics build
        the logits from, a chunk of tokens at a time (evaluation.vocab)."""
        return head_matrix(self.head_module())

    def trunk_end(self) -> int:
        """Index of the first node after the last block: the nodes from there run batch by batch."""
        ends = [i for i, n in enumerate(self.program.nodes) if n.op.is_block]
        return ends[-1] + 1 if ends else 1

    @torch.no_grad()
    def sweep(self, windows: torch.Tensor, batch: int = 8, keep=(), attach: Attach | None = None,
              ) -> Iterator[tuple[Node, Tape, dict[str, Tape]]]:
        """Runs the trunk over `windows` [n, T], node by node; after each node yields (node, its output tape,
        the tapes of `keep` so far). A tape is dropped once its last reader ran, unless kept."""
        nodes = self.program.nodes[: self.trunk_end()]
        later = self.program.nodes[self.trunk_end():]
        last_use = {a: i for i, n in enumerate(nodes) for a in n.args}
        needed = set(keep) | {a for n in later for a in n.args} | {self.program.inputs[0]}
        room = [self.budget // 4]
        ids = Tape(room)
        for b in windows.split(batch):
            ids.append(b.to(self.compute.device))
        env = {self.program.inputs[0]: ids}
        for i, node in enumerate(nodes):
            m = self.module(node)
            finish = attach(node, m) if attach else None
            out = Tape(room)
            for b in range(len(ids)):
                out.append(self._apply(node, m, [env[a][b] for a in node.args]))
            if finish:
                finish()
            env[node.name] = out
            for a in node.args:
                if last_use.get(a) == i and a not in needed:
                    del env[a]
            yield node, out, {k: env[k] for k in keep if k in env}

    @torch.no_grad()
    def outputs(self, windows: torch.Tensor, batch: int = 8, names=None, attach: Attach | None = None,
                project: bool = True) -> Iterator[tuple[slice, dict[str, torch.Tensor]]]:
        """Per batch of rows of `windows`: {name: value} of `names` (default: the program's outputs; any SSA
        value may be named). `project` false: the outputs are the hidden states the LM head would project
        (see `head_weight`)."""
        names = tuple(names or self.program.outputs)
        later = self.program.nodes[self.trunk_end():]
        keep = {*names, *(a for n in later for a in n.args), self.program.inputs[0]}
        env = {}
        for _, _, env in self.sweep(windows, batch, keep=keep, attach=attach):
            pass
        mods = [self.module(n) for n in later]
        finishes = [attach(n, m) for n, m in zip(later, mods)] if attach else []
        start = 0
        for b in range(len(env[self.program.inputs[0]])):
            vals = {k: t[b] for k, t in env.items()}
            for n, m in zip(later, mods):
                vals[n.name] = self._apply(n, m, [vals[a] for a in n.args], project)
            rows = len(vals[self.program.inputs[0]])
            yield slice(start, start + rows), {k: vals[k] for k in names}
            start += rows
        for f in finishes:
            if f:
                f()

    def record(self, windows: torch.Tensor, batch: int = 8, names=None, attach: Attach | None = None,
               project: bool = True) -> Recorded:
        """The values `names` (default: the program's outputs) on `windows`, run once (with `attach`, e.g. a
        calibration's hooks) and kept in tapes, to be read again as this model's by the metrics: a teacher
        measured against its own changed copy is then run once, not once more for the report."""
        kept = Recorded(self, windows, batch, [self.budget // 4], project)
        for _, out in self.outputs(windows, batch, names, attach=attach, project=project):
            kept.add(out)
        return kept

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, state=None):
        """Like ProgramModule.prefill, on one batch: (outputs, decode state), continuing from `state` (the cached
        tokens) when given; node by node, each module read as it runs."""
        return self._step(input_ids, state, False)

    @torch.no_grad()
    def decode(self, token_ids: torch.Tensor, state):
        return self._step(token_ids.reshape(-1, 1), state, True)

    def _step(self, ids, state, decode):
        with self.compute.autocast():
            return run_nodes(self.program, ((n, self.module(n)) for n in self.program.nodes),
                             ids.to(self.compute.device), state, decode)

    def __call__(self, input_ids: torch.Tensor):
        """Like ProgramModule.forward: logits, or (logits, MTP logits) with a head."""
        _, got = next(self.outputs(input_ids, batch=len(input_ids)))
        outs = tuple(got.values())
        return outs if len(outs) > 1 else outs[0]

    def values(self, input_ids: torch.Tensor, *names):
        _, got = next(self.outputs(input_ids, batch=len(input_ids), names=names))
        return tuple(got.values()) if len(names) > 1 else got[names[0]]
