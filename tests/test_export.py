"""torch.export of materialised programs: the full forward (every block kind + MTP) and the one-token decode
step, with dynamic batch, sequence and past lengths; the exported modules equal eager on other shapes.

Named `Dim`s work for the batch; the sequence and past lengths use `Dim.DYNAMIC`. (With torch 2.13 a named
`Dim("seq")` is rejected for programs with a Mamba-2 block, and a named `Dim("past")` for the decode step, because
the symbolic-shape solver cannot prove guards such as `(4 + 4*((3+T)//4)) % (1 + (3+T)//4) == 0` that hold for
every length; Dim.DYNAMIC / Dim.AUTO accept them, and the exported modules run at lengths 1 and up.)
"""
from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from puzzlekit import ir
from puzzlekit.backends.torch import materialize, random_weights
from puzzlekit.ir.ops import MLP, MTP, Attention, Embed, Linear, LMHead, Mamba2, MoE, Noop, Norm

H, VOCAB = 32, 64
TOL = 1e-5  # relative to the magnitudes compared (see _maxdiff)


def _program():
    blocks = [Mamba2(H, 4, 8, 8, 2, chunk=4, dt_min=0.01), MoE(H, 4, 2, 16, 24, latent=16, scaling=2.0),
              Attention(H, 4, 2, 8), MLP(H, 48), Noop(H), Linear(H), MoE(H, 4, 2, 16, 24), Mamba2(H, 4, 8, 8, 1, chunk=3)]
    mtp = MTP(H, (Attention(H, 4, 2, 8), MoE(H, 4, 2, 16, 24, scaling=2.0)))
    prog = ir.assemble(Embed(VOCAB, H), blocks, Norm(H), LMHead(VOCAB, H), mtp)
    random_weights(prog, seed=3, std=0.3)
    g = torch.Generator().manual_seed(4)
    for name in prog.weights.names():
        t = prog.weights.get(name)
        if name.endswith("norm.weight"):
            prog.weights.set(name, 1 + 0.1 * torch.randn(t.shape, generator=g))
        elif name.endswith("e_score_correction_bias"):
            prog.weights.set(name, 0.05 * torch.randn(t.shape, generator=g))
    ir.verify(prog)
    return prog


@pytest.fixture(scope="module")
def model():
    return materialize(_program())


@pytest.fixture(scope="module")
def export_model():
    """The same program in its export form (routed MoE, fused attention and the scan's chunk loop have
    data-dependent shapes or loops): what is exported, compared below with the eager `model`."""
    return materialize(_program()).use_export_form()


def _ids(b, t, seed):
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def _maxdiff(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.shape == y.shape, (x.shape, y.shape)
    return max((x - y).abs().max().item() / max(1.0, y.abs().max().item()) for x, y in zip(a, b))


# -- the full forward ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def exported_forward(export_model):
    ids = _ids(2, 7, seed=0)
    ep = torch.export.export(export_model, (ids,), dynamic_shapes=({0: Dim("batch"), 1: Dim.DYNAMIC},), strict=False)
    return ep


def test_export_forward_has_no_specialised_shapes(exported_forward):
    ph = [n for n in exported_forward.graph.nodes if n.op == "placeholder" and n.name == "input_ids"]
    assert len(ph) == 1
    shape = ph[0].meta["val"].shape
    assert all(not isinstance(s, int) for s in shape), f"input_ids shape was specialised: {shape}"


@pytest.mark.parametrize("b,t", [(3, 13), (1, 5), (1, 1), (2, 8), (2, 7)])
def test_exported_forward_equals_eager(model, exported_forward, b, t):
    em = exported_forward.module()
    ids = _ids(b, t, seed=b * 100 + t)
    with torch.no_grad():
        want = model(ids)
        got = em(ids)
    assert isinstance(want, tuple) and len(want) == 2  # logits, mtp_logits
    assert want[0].shape == (b, t, VOCAB) and want[1].shape == (b, t, VOCAB)
    assert want[0].abs().max() > 0.1 and want[1].abs().max() > 0.1
    assert _maxdiff(want, got) < TOL


# -- the decode step ---------------------------------------------------------------------------------------------------
class DecodeStep(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, token_ids, *state):
        outs, new_state = self.m.decode(token_ids, state)
        return outs, new_state


def _decode_dynamic_shapes(model, batch):
    past = Dim.DYNAMIC
    states = tuple({0: batch, 2: past} if n.endswith((".k", ".v")) else {0: batch} for n in model.state_names)
    return ({0: batch}, states)


def _run_steps(model, em, b, t, steps=3, seed=0):
    """Prefill eagerly, then decode `steps` tokens with eager and with the exported step (each fed its own state)."""
    ids = _ids(b, t + steps, seed=seed)
    with torch.no_grad():
        _, s_eager = model.prefill(ids[:, :t])
        s_exp = s_eager
        for i in range(steps):
            tok = ids[:, t + i]
            want, s_eager = model.decode(tok, s_eager)
            got, s_exp = em(tok, *s_exp)
            assert want[0].shape == (b, 1, VOCAB)
            assert _maxdiff(want, got) < TOL, f"step {i}"
            assert _maxdiff(s_eager, s_exp) < TOL, f"state after step {i}"
            assert s_exp[model.state_names.index("backbone.layers.2.k")].shape[2] == t + i + 1


@pytest.fixture(scope="module", params=["named-contiguous", "dynamic-as-prefill-returns"])
def exported_decode(model, export_model, request):
    """The decode step exported from a prefill state: with the batch a named Dim and contiguous copies of the
    state, or with Dim.DYNAMIC per tensor and the state exactly as prefill returns it (its own strides). Each is
    then fed prefill's state and, step after step, the state it returns itself (`_run_steps`): a decode loop
    must be able to feed a step's output back in, whatever the strides the export saw."""
    with torch.no_grad():
        _, state = model.prefill(_ids(2, 7, seed=1))
    named = request.param.startswith("named")
    state = tuple(s.contiguous() for s in state) if named else state
    tok = _ids(2, 1, seed=2)[:, 0]
    return torch.export.export(DecodeStep(export_model), (tok, *state),
                               dynamic_shapes=_decode_dynamic_shapes(model, Dim("batch") if named else Dim.DYNAMIC),
                               strict=False)


@pytest.mark.parametrize("b,t", [(3, 5), (1, 12), (1, 1), (2, 2), (2, 7)])
def test_exported_decode_step_equals_eager(model, exported_decode, b, t):
    _run_steps(model, exported_decode.module(), b, t, seed=b * 10 + t)
