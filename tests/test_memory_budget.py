"""The memory budget's accounting: the layers streams keep (a layer's stacked experts included) and the work held
beside them (a library layer's variants and their training) share half the budget, and quantize keeps none of the
original's layers beside its new weights, so a command's peak stays near its budget whatever the model's size
(benchmarks/scale.py measures the peaks)."""
from __future__ import annotations

import math

import pytest
import torch

from puzzlekit import ir
from puzzlekit.backends.torch import stream as stream_module
from puzzlekit.backends.torch.device import Compute
from puzzlekit.backends.torch.stream import StreamedProgram, holding, module_bytes
from puzzlekit.passes import PassManager
from puzzlekit.passes import quant as quant_module
from puzzlekit.passes.puzzle import LibrarySettings, build, build_library
from puzzlekit.tools.default_model import model_path


@pytest.fixture(scope="module")
def parent():
    return ir.load(model_path(None))


def _bytes(op) -> int:
    """float32 bytes of an op's weights."""
    return 4 * sum(math.prod(shape) for shape in op.params().values())


def _kept_by_streams() -> int:
    return sum(s.kept_bytes() for s in list(stream_module._streams))


def test_kept_modules_count_stacked_experts_and_make_room_for_held_work(parent):
    blocks = parent.blocks()
    moe = next(b for b in blocks if b.op.kind == "moe")
    s = StreamedProgram(parent, Compute(memory=8_000_000), dtype=torch.float32)
    others = stream_module._kept[0]  # streams of other tests still alive
    s.module(moe)
    assert s.kept_bytes() == _bytes(moe.op)  # the stacked experts' bytes, counted once
    s.release()
    for b in blocks:
        s.module(b)
    kept = list(s._cache)
    assert 1 < len(kept) < len(blocks) and others + s.kept_bytes() <= s.room
    first = module_bytes(s.module(kept[0]))
    with holding(s.room - others - first):  # room beside it for the first kept module alone
        assert list(s._cache) == kept[:1]  # the last kept went first
        s.module(kept[1])
        assert list(s._cache) == kept[:1]  # read, but not kept: it does not fit beside the held work
    assert stream_module._kept[0] == others + first  # the held bytes are returned
    s.module(kept[1])
    s.release([kept[0]])
    assert list(s._cache) == kept[1:2] and stream_module._kept[0] == others + s.kept_bytes()
    s.release()
    assert s.kept_bytes() == 0 and stream_module._kept[0] == others


def test_a_library_layer_s_work_takes_room_from_the_scorer_s_kept_layers(parent, small_grid_file, tmp_path,
                                                                         monkeypatch):
    """While a variant trains, the layers the scorer keeps fit the room left beside the trained block, its
    starting copy, gradient and AdamW moments (and the parent block's weights, which are not counted here)."""
    compute = Compute(memory=8_000_000)
    room, seen, real = compute.budget // 2, [], build.distill_block

    def watched(block, *args, **kwargs):
        seen.append((_kept_by_streams(), max(0, room - 4 * module_bytes(block))))
        return real(block, *args, **kwargs)

    monkeypatch.setattr(build, "distill_block", watched)
    settings = LibrarySettings(calib_windows=4, score_windows=2, seq=32, bld_tokens=256)
    build_library(parent, tmp_path / "lib", small_grid_file, settings, compute=compute)
    assert seen and any(kept for kept, _ in seen)  # the scorer keeps layers where they fit beside the work
    assert all(kept <= allowed for kept, allowed in seen), seen


def test_quantize_keeps_no_layer_of_the_original_beside_its_new_weights(parent, monkeypatch):
    """The original runs once (calibration and the report's teacher, recorded): its kept layers are released
    before the weights are quantised."""
    seen = []
    real = quant_module.quantize_weights
    monkeypatch.setattr(quant_module, "quantize_weights",
                        lambda *args, **kwargs: seen.append(_kept_by_streams()) or real(*args, **kwargs))
    PassManager("quantize{recipe=fp8,samples=2,seq=32}", max_memory=8_000_000).run(parent.copy())
    assert seen and not any(seen)
