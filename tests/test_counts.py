"""Work that follows the bytes and FLOPs, not the number of experts: counts, not times, so that a return to
per-expert Python work (a module per expert, a read per tensor, a GEMM call per expert) fails on any machine.

The same 8-layer model is built with 128 and with 512 routed experts (top-k 4; a batch leaves some of either
unused, so both take the same path); each stage's counts are taken
on both: torch operators dispatched (TorchDispatchMode), modules built, file reads. Where a count must not
grow with the experts, the two are equal."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from puzzlekit import ir
from puzzlekit.backends.torch import materialize, random_weights
from puzzlekit.backends.torch.stream import StreamedProgram
from puzzlekit.ir import weights as weights_mod
from puzzlekit.ir.ops import MTP, Attention, Embed, LMHead, Mamba2, MoE, Norm

H, VOCAB, LAYERS = 32, 64, 8
SMALL, LARGE = 128, 512


def _program(experts: int) -> ir.Program:
    moe = MoE(H, experts=experts, top_k=4, d_ff=16, shared_d_ff=24, latent=16)
    blocks = [Mamba2(H, heads=4, head_dim=8, state=8, groups=2, chunk=8) if i % 2 == 0 else moe
              for i in range(LAYERS - 1)] + [Attention(H, 4, 2, 8)]
    prog = ir.assemble(Embed(VOCAB, H), blocks, Norm(H), LMHead(VOCAB, H), mtp=MTP(H, (Attention(H, 4, 2, 8), moe)))
    return random_weights(prog, seed=0, std=0.3)


class _Ops(TorchDispatchMode):
    """Counts the torch operators dispatched while it is on."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    d = tmp_path_factory.mktemp("counts")
    return {e: ir.save(_program(e), d / f"e{e}") for e in (SMALL, LARGE)}


def _ops(fn) -> int:
    with _Ops() as ops:
        fn()
    return ops.count


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))


def test_a_forward_and_a_training_step_dispatch_no_more_operators_at_512_experts_than_at_128(checkpoints):
    """The routed products run in batches of experts with about as many rows (at most log2(rows) batches, as the
    routing falls), never one expert at a time: 4x the experts dispatch no more operators (a loop over the
    experts would add thousands)."""
    counts = {}
    for e, path in checkpoints.items():
        m = materialize(ir.load(path))
        with torch.no_grad():
            fwd = _ops(lambda: m(_ids()))

        def step():
            logits, mtp = m(_ids())
            (logits.float().pow(2).mean() + mtp.float().pow(2).mean()).backward()
        counts[e] = (fwd, _ops(step))
        assert m.get_submodule("backbone.layers.1.mixer.experts").up_proj.grad.abs().sum() > 0
    assert all(large <= small * 1.1 for small, large in zip(counts[SMALL], counts[LARGE])), counts


def test_modules_and_parameters_do_not_grow_with_the_experts(checkpoints):
    sizes = {}
    for e, path in checkpoints.items():
        m = materialize(ir.load(path))
        sizes[e] = (len(list(m.modules())), len(list(m.parameters())), len(m.state_dict()))
    assert sizes[SMALL] == sizes[LARGE]


def test_materialising_reads_each_layer_once_not_each_expert(checkpoints, monkeypatch):
    """The checkpoint stores 2 x 512 matrices per MoE layer; they come in one read per layer."""
    reads = []
    real = weights_mod._Lazy.read
    monkeypatch.setattr(weights_mod._Lazy, "read", lambda self: reads.append(self.key) or real(self))
    per = {}
    for e, path in checkpoints.items():
        prog = ir.load(path)
        reads.clear()
        materialize(prog)
        per[e] = len(reads)
        assert per[e] < len(prog.weights) / 10  # far fewer reads than tensors
        reads.clear()
        s = StreamedProgram(prog)
        for n in prog.nodes:
            s.module(n)
        assert len(reads) == per[e]
    assert per[SMALL] == per[LARGE]


def test_quantizing_a_layer_of_experts_is_one_batch(checkpoints):
    """FP8 and NVFP4 of a layer's expert matrices as one batch: each expert's values are its own quantization,
    and what each further expert adds is the hand-over of its own tensors (a few operators), not the several
    dozen of quantising it alone."""
    from puzzlekit.passes.quant.calibrate import quantize_weight, quantize_weights

    for fmt in ("fp8", "nvfp4"):
        batch, alone = {}, {}
        for e, path in checkpoints.items():
            prog = ir.load(path)
            names = [f"backbone.layers.1.mixer.experts.{j}.{side}.weight" for j in range(e)
                     for side in ("up_proj", "down_proj")]
            ws = prog.weights.get_many(names)
            with _Ops() as ops:
                qs = quantize_weights(ws, fmt)
            batch[e] = ops.count
            alone[e] = _ops(lambda: [quantize_weight(w, fmt) for w in ws])
            for w, q in zip(ws[:: e // 8], qs[:: e // 8]):
                assert torch.equal(q.dequantize(torch.float32), quantize_weight(w, fmt).dequantize(torch.float32))
        more = 2 * (LARGE - SMALL)
        per_expert = (batch[LARGE] - batch[SMALL]) / more
        assert per_expert <= 2 and per_expert < (alone[LARGE] - alone[SMALL]) / more / 4, (fmt, batch, alone)


def test_a_stage_says_how_long_it_has_left_after_its_first_unit():
    import io

    from puzzlekit.eta import Remaining

    out = io.StringIO()
    left = Remaining("library", 88, stream=out)
    left.done()
    left.done()
    line = out.getvalue()
    assert line.startswith("library: 1 of 88 layers in ") and "left" in line and line.count("\n") == 1
    quiet = io.StringIO()
    Remaining("quantize", 1, stream=quiet).done()  # nothing is left to estimate
    assert quiet.getvalue() == ""
