"""Checkpoints of a training run's state: `FileCheckpoint` (one `torch.save` file written by rank 0: the default,
for unsharded and DDP models) and `ShardedCheckpoint` (a `torch.distributed.checkpoint` directory every rank
writes its shards into, for FSDP; it reshards on load, so a run resumes on another number of processes), and
`save_tensors` / `load_tensors` for a set of tensors kept on disk beside them (a run's best weights)."""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import torch

from ..outputs import atomic_file
from .ranks import _world, barrier


def save_atomic(obj, path: Path) -> None:
    with atomic_file(path) as tmp:
        torch.save(obj, tmp)


class FileCheckpoint:
    """The run's state in one `torch.save` file, replaced atomically; only the process with `write` writes
    (every data-parallel process holds the same model), every process reads."""

    def __init__(self, path: Path, write: bool = True):
        self.path, self.write = Path(path), write

    def read(self, model: torch.nn.Module) -> dict | None:
        """The saved state (step, identity, rng, ...) or None when there is none yet."""
        if not self.path.exists():
            return None
        return torch.load(self.path, weights_only=True, map_location=next(model.parameters()).device)

    def restore(self, st: dict, model: torch.nn.Module, opt: torch.optim.Optimizer, callbacks) -> list:
        """Loads the model and optimizer from `st` (what `read` gave); returns the callbacks' states."""
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optimizer"])
        return st.get("callbacks", [])

    def save(self, model: torch.nn.Module, opt: torch.optim.Optimizer, meta: dict, callback_states: list) -> None:
        if self.write:
            save_atomic({"step": meta["step"], "model": model.state_dict(), "optimizer": opt.state_dict(),
                         "rng": meta["rng"], "identity": meta["identity"], "callbacks": callback_states,
                         "seconds": meta["seconds"], "stopped": meta["stopped"], "scaler": meta.get("scaler")},
                        self.path)


_TENSOR = "__checkpoint_tensor__"


def _split_tensors(obj, path=(), out=None):
    """(`obj` with every tensor replaced by a placeholder naming it, {name: tensor}): the tensors go to the
    sharded checkpoint (as DTensors where they are), the rest into its small side file."""
    out = {} if out is None else out
    if isinstance(obj, torch.Tensor):
        name = f"t{len(out)}"
        out[name] = obj
        return {_TENSOR: name, "path": list(path), "shape": list(obj.shape), "dtype": str(obj.dtype)}, out
    if isinstance(obj, dict):
        return {k: _split_tensors(v, (*path, k), out)[0] for k, v in obj.items()}, out
    if isinstance(obj, (list, tuple)):
        return type(obj)(_split_tensors(v, (*path, i), out)[0] for i, v in enumerate(obj)), out
    return obj, out


def _placeholders(obj):
    if isinstance(obj, dict):
        if _TENSOR in obj:
            yield obj
            return
        for v in obj.values():
            yield from _placeholders(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _placeholders(v)


def _at(obj, path):
    for k in path:
        try:
            obj = obj[k]
        except (KeyError, IndexError, TypeError):
            return None
    return obj


def _join_tensors(obj, tensors: dict):
    if isinstance(obj, dict):
        if _TENSOR in obj:
            return tensors[obj[_TENSOR]]
        return {k: _join_tensors(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_join_tensors(v, tensors) for v in obj)
    return obj


@contextlib.contextmanager
def _single_process_quiet():
    """Without a process group DCP saves and loads in this process alone, as meant here: no warning."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


class ShardedCheckpoint:
    """The run's state as a `torch.distributed.checkpoint` directory: every process writes its shards of the
    model, the optimizer and the callbacks' tensors (an FSDP run's best weights stay sharded), rank 0 a small
    side file with the rest (step, identity, rng, the callbacks' other state). Parameters and optimizer state
    are keyed by name, so a later run on another number of processes (1 included) loads and reshards them.

    Atomic: written into `<path>.tmp`, the side file last; then the complete previous checkpoint is moved to
    `<path>.old`, the new one into place, and the old one removed, so a kill at any point leaves a complete
    checkpoint (`<path>`, else `<path>.old`) to resume from.
    """

    META = "puzzlekit_state.pt"

    def __init__(self, path: Path):
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self.old = self.path.with_name(self.path.name + ".old")

    def exists(self) -> bool:
        return self._complete() is not None

    def _complete(self) -> Path | None:
        for d in (self.path, self.old):
            if (d / self.META).exists():
                return d
        return None

    def read(self, model: torch.nn.Module) -> dict | None:
        where = self._complete()
        if where is None:
            return None
        st = torch.load(where / self.META, weights_only=True)
        st["_dir"] = str(where)
        return st

    def restore(self, st: dict, model: torch.nn.Module, opt: torch.optim.Optimizer, callbacks) -> list:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        msd, osd = get_state_dict(model, opt)  # this run's layout (sharded or not) is what the load fills in
        skeleton = st.get("callbacks", [])
        templates = [cb.state_dict() if hasattr(cb, "state_dict") else None for cb in callbacks]
        tensors = {}
        for ph in _placeholders(skeleton):
            like = _at(templates, ph["path"])
            if isinstance(like, torch.Tensor) and list(like.shape) == ph["shape"] and str(like.dtype) == ph["dtype"]:
                tensors[ph[_TENSOR]] = like.detach().clone()  # its sharding; the load overwrites the values
            else:
                tensors[ph[_TENSOR]] = torch.empty(ph["shape"], dtype=getattr(torch, ph["dtype"].split(".")[-1]))
        state = {"model": msd, "optimizer": osd, "callbacks": tensors}
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=st["_dir"])
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        return _join_tensors(skeleton, state["callbacks"])

    def save(self, model: torch.nn.Module, opt: torch.optim.Optimizer, meta: dict, callback_states: list) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        rank, world = _world()
        msd, osd = get_state_dict(model, opt)
        skeleton, tensors = _split_tensors(list(callback_states))
        if rank == 0:
            shutil.rmtree(self.tmp, ignore_errors=True)  # a checkpoint a kill left half-written
            self.tmp.mkdir(parents=True)
        barrier(world)
        with _single_process_quiet():
            dcp.save({"model": msd, "optimizer": osd, "callbacks": tensors}, checkpoint_id=str(self.tmp))
        barrier(world)
        if rank == 0:
            save_atomic({**meta, "callbacks": skeleton}, self.tmp / self.META)  # last: marks it complete
            if self.path.exists():
                shutil.rmtree(self.old, ignore_errors=True)
                os.replace(self.path, self.old)
            os.replace(self.tmp, self.path)
            shutil.rmtree(self.old, ignore_errors=True)
        barrier(world)


def save_tensors(tensors: dict, path: Path) -> None:
    """`tensors` (plain or DTensor shards: every process calls this with its own) as a
    `torch.distributed.checkpoint` directory at `path`, replaced atomically: written into `<path>.tmp`, then
    renamed over the old one by rank 0. A later `load_tensors` reshards to its own layout."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    rank, world = _world()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(world)
    with _single_process_quiet():
        dcp.save(tensors, checkpoint_id=str(tmp))
    barrier(world)
    if rank == 0:
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    barrier(world)


def load_tensors(tensors: dict, path: Path) -> dict:
    """Fills `tensors` (this process's layout: plain tensors or DTensor shards) in place from a
    `save_tensors` directory; returns them."""
    import torch.distributed.checkpoint as dcp

    with _single_process_quiet():
        dcp.load(tensors, checkpoint_id=str(path))
    return tensors
