"""program_hash: cheap (no tensor reads for checkpoint-backed weights, computed once per store state), the
same for the same values however they are held, different when a weight changes; quantised programs too."""
from __future__ import annotations

import os

import pytest
import torch

from puzzlekit import ir
from puzzlekit.backends.torch import random_weights
from puzzlekit.ir import identity
from puzzlekit.ir.identity import program_hash
from puzzlekit.ir.ops import MLP, Attention, Embed, LMHead, Mamba2, MoE, Norm
from puzzlekit.ir.weights import _Lazy
from puzzlekit.passes import PassManager
from puzzlekit.passes.puzzle.library import parent_hash


@pytest.fixture
def prog(make_small_program):
    return make_small_program()


def _saved(prog, d):
    ir.save(prog, d, extended=True)
    return d


def _a_weight(p) -> str:
    return next(n for n in sorted(p.weights.names()) if n.endswith("mixer.in_proj.weight"))


@pytest.fixture(scope="module")
def quantized():
    h = 32
    blocks = [Mamba2(h, 4, 8, 8, 2, chunk=4), MoE(h, 4, 2, 16, 16), Attention(h, 4, 2, 8), MLP(h, 32)]
    p = random_weights(ir.assemble(Embed(256, h), blocks, Norm(h), LMHead(256, h), meta={"dtype": "float32"}),
                       seed=5, std=0.2)
    PassManager("quantize{recipe=nvfp4,samples=1,seq=16}").run(p)
    return p


def test_a_quantized_program_with_0_dim_scales_hashes(quantized, tmp_path):
    w = quantized.weights
    assert any(w.shape(n) == () for n in w.names()) and any(w.is_quantized(n) for n in w.names())
    h = program_hash(quantized)
    assert len(h) == 64
    assert program_hash(ir.load(_saved(quantized, tmp_path / "q"))) == h  # lazy quantised parts hash alike


def test_a_checkpoint_hashes_alike_when_loaded_again_and_as_the_program_it_was_saved_from(prog, tmp_path):
    d = _saved(prog, tmp_path / "a")
    a, b = ir.load(d), ir.load(d)
    assert program_hash(a) == program_hash(b) == program_hash(prog) == parent_hash(a)


def test_the_hash_changes_when_a_tensor_is_set(prog, tmp_path):
    a = ir.load(_saved(prog, tmp_path / "a"))
    before, name = program_hash(a), _a_weight(a)
    a.weights.set(name, a.weights.get(name) + 1)
    assert program_hash(a) != before


def test_checkpoints_differing_in_one_tensor_hash_differently(prog, tmp_path):
    a = _saved(prog, tmp_path / "a")
    name = _a_weight(prog)
    prog.weights.set(name, prog.weights.get(name) * 2)
    b = _saved(prog, tmp_path / "b")
    assert program_hash(ir.load(a)) != program_hash(ir.load(b))


def test_large_tensors_are_sampled_alike_in_memory_and_on_disk_and_still_tell_a_change(prog, tmp_path,
                                                                                        monkeypatch):
    monkeypatch.setattr(identity, "FULL_BYTES", 64)  # every weight past 64 bytes is hashed by windows
    monkeypatch.setattr(identity, "WINDOW_BYTES", 16)
    a = ir.load(_saved(prog, tmp_path / "a"))
    assert program_hash(a) == program_hash(prog)
    name = _a_weight(prog)
    prog.weights.set(name, prog.weights.get(name) + 1)
    assert program_hash(prog) != program_hash(a)


def test_hashing_a_checkpoint_reads_no_tensor(prog, tmp_path, monkeypatch):
    a = ir.load(_saved(prog, tmp_path / "a"))
    monkeypatch.setattr(identity, "FULL_BYTES", 0)  # as for a large model: windows, not whole tensors
    calls = []
    for f in ("read", "chunks"):
        monkeypatch.setattr(_Lazy, f, lambda *args, f=f: calls.append(f))
    monkeypatch.setattr(ir.WeightStore, "get", lambda *args: calls.append("get"))
    program_hash(a)
    assert calls == []


def test_a_second_call_on_an_unchanged_program_does_not_rehash(prog, tmp_path, monkeypatch):
    a = ir.load(_saved(prog, tmp_path / "a"))
    real, calls = identity._digest, []
    monkeypatch.setattr(identity, "_digest", lambda *args: calls.append(1) or real(*args))
    first = program_hash(a)
    assert program_hash(a) == first and len(calls) == 1
    name = _a_weight(a)
    t = a.weights.get(name)
    a.weights.set(name, t)  # the same values, set again: rehashed, the same hash
    assert program_hash(a) == first and len(calls) == 2
    t.mul_(3)  # in place: the store's tensor changed
    assert program_hash(a) != first and len(calls) == 3
    a.weights.delete(name)
    assert program_hash(a) != first and len(calls) == 4


def test_spilling_to_scratch_keeps_the_hash(prog):
    name = _a_weight(prog)
    prog.weights.set(name, prog.weights.get(name) + 1)
    before = program_hash(prog)
    prog.weights.spill_over(0)
    assert prog.weights.source(name) is not None and program_hash(prog) == before


def test_a_checkpoint_rewritten_on_disk_is_hashed_again(prog, tmp_path):
    d = _saved(prog, tmp_path / "a")
    a = ir.load(d)
    before = program_hash(a)
    name = _a_weight(a)
    e = a.weights._entries[name]
    st = os.stat(e.file)
    with open(e.file, "r+b") as f:  # same header, other values
        f.seek(e.start)
        f.write((torch.ones(e.shape, dtype=e.dtype) * 7).numpy().tobytes())
    os.utime(e.file, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert program_hash(a) != before


@pytest.mark.parametrize("full_bytes", [identity.FULL_BYTES, 0])
def test_a_tensor_cast_on_read_hashes_as_its_value_in_memory(make_small_program, tmp_path, monkeypatch, full_bytes):
    monkeypatch.setattr(identity, "FULL_BYTES", full_bytes)
    p = make_small_program(dtype=torch.bfloat16)
    p.meta["dtype"] = "float32"  # stored in bfloat16, computed in float32: cast on read
    a = ir.load(_saved(p, tmp_path / "a"))
    name = _a_weight(a)
    assert a.weights._entries[name].stored == torch.bfloat16
    mem = a.copy()
    for n in mem.weights.names():
        mem.weights.set(n, mem.weights.get(n))
    assert program_hash(a) == program_hash(mem)
