"""Layer-streamed execution within a memory budget: a streamed forward, evaluation, library build and
quantization give what the whole model in memory gives, while reading layers one at a time, spilling
activations and new weights to scratch files."""
from __future__ import annotations

import json

import pytest
import torch

from puzzlekit import evaluation as evaluate, ir
from puzzlekit.backends.torch import materialize
from puzzlekit.backends.torch import stream as stream_module
from puzzlekit.backends.torch.device import Compute
from puzzlekit.backends.torch.stream import StreamedProgram
from puzzlekit.text.data import held_out_windows, load_corpus, sequential_windows
from puzzlekit.memory import parse_size
from puzzlekit.passes import PassManager
from puzzlekit.passes.puzzle import LibrarySettings, build_library
from puzzlekit.passes.puzzle.search import realise
from puzzlekit.tools.default_model import model_path

#: small enough that no two layers of the built-in model are cached together and a sweep's values spill
TINY = Compute(memory=600_000)


@pytest.fixture(scope="module")
def parent():
    return ir.load(model_path(None))


def _close(a: float, b: float, rel: float = 1e-5) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


@pytest.fixture
def spills(monkeypatch):
    """The scratch files the stream writes activations to."""
    made = []
    real = stream_module.scratch_file
    monkeypatch.setattr(stream_module, "scratch_file", lambda suffix: made.append(real(suffix)) or made[-1])
    return made


def test_a_streamed_forward_in_a_tiny_budget_equals_the_whole_model(parent, spills):
    ids = torch.randint(0, 256, (24, 64), generator=torch.Generator().manual_seed(0))
    whole = materialize(parent)
    s = StreamedProgram(parent, TINY)
    got = list(s.outputs(ids, batch=8))
    for rows, out in got:
        logits, mtp = whole(ids[rows])
        torch.testing.assert_close(out["logits"], logits, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out["mtp_logits"], mtp, rtol=1e-5, atol=1e-6)
    assert [r for r, _ in got] == [slice(0, 8), slice(8, 16), slice(16, 24)]
    assert spills and not any(f.exists() for f in spills)  # values spilled, and their files were removed
    roomy = StreamedProgram(parent)
    for stream in (s, roomy):
        list(stream.outputs(ids[:8]))
    assert s.reads > len(parent.nodes) + 2  # a second sweep reads again what did not fit
    assert roomy.reads == len(parent.nodes)  # ... and nothing when everything fits
    x = s.values(ids[:2], "x5")
    torch.testing.assert_close(x, whole.values(ids[:2], "x5"), rtol=1e-5, atol=1e-6)


def test_streamed_evaluation_equals_the_whole_models(parent):
    windows = sequential_windows(load_corpus(None).valid, 65, limit=6)
    whole, s = materialize(parent), StreamedProgram(parent, TINY)
    assert _close(evaluate.bits_per_byte(s, windows), evaluate.bits_per_byte(whole, windows))
    assert _close(evaluate.mtp_accuracy(s, windows), evaluate.mtp_accuracy(whole, windows))
    prompts = windows[:2, :24]
    assert evaluate.acceptance_length(s, prompts, 2, 8) == evaluate.acceptance_length(whole, prompts, 2, 8)
    child = parent.copy()
    PassManager("set-topk{k=1}").run(child)
    a = evaluate.teacher_agreement(StreamedProgram(parent, TINY), StreamedProgram(child, TINY), windows)
    b = evaluate.teacher_agreement(whole, materialize(child), windows)
    assert a["kl"] > 1e-5 and _close(a["kl"], b["kl"]) and a["top1_agreement"] == b["top1_agreement"]


def test_recorded_outputs_score_as_the_model_did_and_only_on_their_windows(parent, spills):
    """A teacher recorded once (spilling past a tiny budget) scores a student as the live teacher does."""
    windows = sequential_windows(load_corpus(None).valid, 65, limit=6)
    child = parent.copy()
    PassManager("set-topk{k=1}").run(child)
    recorded = StreamedProgram(parent, TINY).record(windows, 4)
    assert spills  # the record itself spilled
    got = evaluate.teacher_agreement(recorded, materialize(child), windows, batch=4)
    want = evaluate.teacher_agreement(materialize(parent), materialize(child), windows, batch=4)
    assert got["kl"] > 1e-5 and _close(got["kl"], want["kl"]) and got["top1_agreement"] == want["top1_agreement"]
    for other in ((windows[:4], 4), (windows, 8)):
        with pytest.raises(ValueError, match="windows and batch they were recorded on"):
            evaluate.teacher_agreement(recorded, materialize(child), *other[:1], batch=other[1])


def _floats_close(a, b, path="") -> None:
    """Equal structure and strings/ints; floats within 1e-5 relative."""
    if isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            _floats_close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _floats_close(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        assert _close(a, b), (path, a, b)
    else:
        assert a == b, (path, a, b)


def test_a_library_built_in_a_tiny_budget_equals_the_one_built_in_memory(small_library, small_grid_file, parent,
                                                                         tmp_path):
    settings = LibrarySettings(calib_windows=8, score_windows=2, seq=64, bld_tokens=4096)  # the fixture's
    lib = build_library(parent, tmp_path / "lib", small_grid_file, settings, compute=TINY)
    _floats_close(lib.rows, small_library.rows)
    assert json.loads((lib.path / "importance.json").read_text()) == \
        json.loads((small_library.path / "importance.json").read_text())
    assert not (lib.path / "activations").exists()  # the layer inputs are removed with the manifest written


def test_replace_one_block_scores_equal_the_whole_model_with_that_block_swapped(small_library, parent):
    """An independent oracle: the child with one layer realised from the library, run whole, against the parent."""
    s = small_library.manifest["settings"]
    held = held_out_windows(load_corpus(None), small_library.manifest["scored_on"], s["seq"] + 1,
                            limit=s["score_windows"])[:, :-1]
    teacher = materialize(parent)
    rows = [r for r in small_library.rows if r["id"] != "parent" and r["layer"] in (0, 1, 4)]
    assert {r["kind"] for r in rows} >= {"mamba2", "moe"}
    for r in rows:
        child = realise(parent.copy(), small_library, [r])
        got = evaluate.teacher_agreement(teacher, materialize(child), held)
        assert _close(r["scores"]["kl"], got["kl"], 1e-4) and r["scores"]["top1"] == got["top1_agreement"], r["id"]


def test_quantize_in_a_tiny_budget_spills_and_equals_quantize_in_memory(parent):
    runs = {}
    for name, memory in (("memory", ""), ("tiny", 2_000_000)):
        prog = parent.copy()
        am = PassManager("quantize{recipe=fp8,samples=4,seq=64}", max_memory=memory).run(prog)
        runs[name] = prog, am.reports["quantize"]
    (a, ra), (b, rb) = runs["memory"], runs["tiny"]
    assert _close(ra["kl"], rb["kl"]) and ra["weights"] == rb["weights"] > 0
    assert b.weights.resident_bytes() <= 2_000_000 // 4 < a.weights.resident_bytes()
    for k in a.weights.names():
        x, y = a.weights.get(k), b.weights.get(k)
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), k
        else:
            assert torch.equal(x.data.view(torch.uint8), y.data.view(torch.uint8)) and torch.equal(x.scale, y.scale), k


def test_spilled_weights_save_byte_identical_files(parent, tmp_path):
    prog = parent.copy()
    PassManager("quantize{recipe=nvfp4,samples=2,seq=32}").run(prog)
    ir.save(prog, tmp_path / "a", extended=True)
    prog.weights.spill_over(0)
    assert prog.weights.resident_bytes() == 0
    ir.save(prog, tmp_path / "b", extended=True)
    for f in (tmp_path / "a").iterdir():
        assert f.read_bytes() == (tmp_path / "b" / f.name).read_bytes(), f.name


def test_the_resident_bytes_kept_as_entries_change_equal_their_sum(parent, tmp_path):
    """The store keeps its in-memory bytes as entries come and go (checked after every new tensor, for free);
    the oracle is the sum over the entries held in memory, through every way an entry changes."""
    from puzzlekit.ir.quant.formats import quantize_fp8

    store = parent.copy().weights  # the default model's: lazy entries read from its checkpoint
    summed = lambda w: sum(w.nbytes(k) for k in w._in_memory())  # noqa: E731
    names = store.names()
    steps = [lambda: store.set(names[0], torch.ones(7, 3)), lambda: store.set(names[0], torch.ones(2)),
             lambda: store.set(names[1], quantize_fp8(torch.randn(16, 32, generator=torch.Generator().manual_seed(0)))),
             lambda: store.update({names[2]: torch.zeros(5, dtype=torch.bfloat16), "new.weight": torch.zeros(3)}),
             lambda: store.set_meta(names[2], (4, 4)), lambda: store.delete("new.weight"),
             lambda: store.spill_over(10**12), lambda: store.spill_over(0),
             lambda: store.set(names[3], torch.ones(11))]
    for i, step in enumerate(steps):
        step()
        assert store.resident_bytes() == summed(store), i
    copy = store.copy()
    copy.set(names[4], torch.ones(100))
    assert (copy.resident_bytes(), store.resident_bytes()) == (summed(copy), summed(store))
    assert store.resident_bytes() == 44 and copy.resident_bytes() == 444


@pytest.mark.parametrize("text, want", [("24GB", 24 * 10**9), ("512MiB", 512 * 2**20), ("3e9", 3 * 10**9),
                                        ("1.5 gib", int(1.5 * 2**30))])
def test_memory_sizes_parse(text, want):
    assert parse_size(text) == want


def test_a_bad_max_memory_is_refused_naming_the_fix(capsys):
    from puzzlekit.tools.cli import main

    for bad, says in (("lots", "24GB"), ("1KB", "least budget")):
        code = main(["eval", "--max-memory", bad, "--windows", "1"])
        err = capsys.readouterr().err
        assert code == 2 and "--max-memory" in err and says in err and "Traceback" not in err, err
