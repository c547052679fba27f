"""Stored teacher logits (`teacher_logits=`): the teacher's top-k log-probabilities computed once, streamed
layer by layer, and `TeacherStore`, their on-disk format (chunked safetensors files written atomically,
`meta.json` naming the settings they are of). Apart from the run because it is a file format of its own.
(`Distill` in annotations is the pass, `passes.distill.Distill`: not imported, since the package imports
this module.)"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from ...evaluation import metrics
from ...backends.torch.device import Compute
from ...ir import Program
from ...ir.identity import program_hash
from ...outputs import atomic_file, write_text
from ...training import barrier
from ..core import PassError
from .registries import Source

# -- stored teacher logits ---------------------------------------------------------------------------------------
CHUNK_BYTES = 256 << 20  # about this much per file of stored top-k (values float32 + indices int32)


def _teacher_outputs(teacher_prog: Program, windows: torch.Tensor, compute: Compute,
                     batch: int = 8) -> Iterator[tuple[slice, dict[str, torch.Tensor]]]:
    """The teacher's next-token logits on `windows` [n, T], per batch of rows: (rows, {"logits": [b, T, V]}).
    The one place the stored logits are computed: streamed layer by layer (`backends.torch.stream`), so the
    teacher need not fit in memory; float32 weights like the live teacher's."""
    from ...backends.torch.stream import StreamedProgram

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

    with atomic_file(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)


class TeacherStore:
    """A directory of the teacher's top-k next-token log-probabilities (of its full-vocabulary log_softmax)
    for every step's global batch, computed once and reused by later runs (and by every process).

    The sampler is deterministic from the seed, so the windows of step s are known ahead: files
    `steps-<first>-<end>.safetensors` hold, for a chunk of steps, `ids` [n, batch, seq + 1] (checked against
    what the sampler draws), `values` [n, batch, seq, k] float32 and `indices` int32; `eval.safetensors` the
    same for the held-out windows (every position), with the teacher's bits per byte there. Each file is
    written atomically (temp file, os.replace), so a directory a kill left half-written is completed, and
    `meta.json` records what the logits are of (the teacher's program_hash, seed, steps, batch, seq, topk,
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

        path = Path(path)
        vocab = teacher_prog.find("lm_head")[0].op.vocab if teacher_prog.find("lm_head") else None
        if vocab is None:
            raise PassError("distill: teacher_logits= needs the teacher's LM head (its vocabulary)")
        want = cls.expected(d, teacher_hash or program_hash(teacher_prog), vocab)
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
            write_text(meta_file, json.dumps({**want, "chunk": chunk, "vocab": vocab}, indent=1))
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
