"""Program.rewrite: the spec and its weights change together, or not at all."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from puzzlekit import ir
from puzzlekit.backends.torch import materialize
from puzzlekit.errors import PuzzlekitError, RewriteError
from puzzlekit.ir.ops import Linear, MoE, Noop


def run(prog: ir.Program, ids: torch.Tensor):
    with torch.no_grad():
        return materialize(prog)(ids)


def snapshot(prog: ir.Program):
    """Everything a rewrite may touch: the node list and the store (names -> the very tensor objects)."""
    return list(prog.nodes), {k: prog.weights.get(k) for k in prog.weights.names()}


def assert_unchanged(prog: ir.Program, snap) -> None:
    nodes, weights = snap
    assert prog.nodes == nodes
    assert sorted(prog.weights.names()) == sorted(weights)
    for k, t in weights.items():
        assert prog.weights.get(k) is t


def hand_moe_block(spec: MoE, w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The MoE residual block written out token by token: x + moe(rmsnorm(x))."""
    h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + spec.eps) * w["norm.weight"]
    out = torch.zeros_like(h)
    for i in range(h.shape[0]):
        for j in range(h.shape[1]):
            v = h[i, j]
            scores = torch.sigmoid(w["mixer.gate.weight"] @ v)
            chosen = torch.topk(scores + w["mixer.gate.e_score_correction_bias"], spec.top_k).indices
            gates = scores[chosen]
            if spec.norm_topk:
                gates = gates / gates.sum()
            gates = gates * spec.scaling
            u = w["mixer.fc1_latent_proj.weight"] @ v if spec.latent else v
            y = torch.zeros_like(u)
            for g, e in zip(gates, chosen.tolist()):
                a = F.relu(w[f"mixer.experts.{e}.up_proj.weight"] @ u) ** 2
                y = y + g * (w[f"mixer.experts.{e}.down_proj.weight"] @ a)
            if spec.latent:
                y = w["mixer.fc2_latent_proj.weight"] @ y
            if spec.shared_d_ff:
                s = F.relu(w["mixer.shared_experts.up_proj.weight"] @ v) ** 2
                y = y + w["mixer.shared_experts.down_proj.weight"] @ s
            out[i, j] = y
    return x + out


def block_module(prog: ir.Program, path: str):
    m = materialize(prog)
    for part in path.split("."):
        m = getattr(m, part)
    return m


# -- top_k --------------------------------------------------------------------------------------------------
def test_rewrite_top_k_keeps_weights_and_changes_outputs(small_program, ids):
    before = run(small_program, ids)
    node = small_program.node("backbone.layers.2")
    weights_before = small_program.node_weights(node)
    new = small_program.rewrite(node, op=node.op.replace(top_k=1))
    assert new.op.top_k == 1 and new.path == node.path and new.name == node.name and new.args == node.args
    assert small_program.node("backbone.layers.2") is new
    after_weights = small_program.node_weights(new)
    assert after_weights.keys() == weights_before.keys()
    for k, t in weights_before.items():
        assert after_weights[k] is t  # the very same tensors
    ir.verify(small_program)
    after = run(small_program, ids)
    assert after[0].shape == before[0].shape
    assert not torch.allclose(after[0], before[0])
    # only the rewritten node changed
    assert "top_k=1" in ir.print_program(small_program).splitlines()[3]


def test_rewrite_top_k_by_name_and_back_restores_outputs(small_program, ids):
    before = run(small_program, ids)
    old = small_program.node("x2").op
    small_program.rewrite("x2", op=old.replace(top_k=4))
    assert small_program.node("backbone.layers.1").op.top_k == 4
    assert not torch.allclose(run(small_program, ids)[0], before[0])
    small_program.rewrite("backbone.layers.1", op=old)
    for a, b in zip(run(small_program, ids), before):
        assert torch.equal(a, b)


# -- shrinking d_ff -----------------------------------------------------------------------------------------
def test_shrinking_moe_d_ff_without_weights_raises(small_program):
    snap = snapshot(small_program)
    node = small_program.node("backbone.layers.1")
    with pytest.raises(RewriteError) as exc:
        small_program.rewrite(node, op=node.op.replace(d_ff=8))
    msg = str(exc.value)
    assert "backbone.layers.1" in msg
    assert "mixer.experts.0.up_proj.weight" in msg and "[8, 16]" in msg and "weights=" in msg
    assert_unchanged(small_program, snap)
    ir.verify(small_program)


def test_shrinking_moe_d_ff_with_some_weights_missing_raises(small_program):
    snap = snapshot(small_program)
    node = small_program.node("backbone.layers.1")
    w = small_program.node_weights(node)
    given = {f"mixer.experts.{e}.up_proj.weight": w[f"mixer.experts.{e}.up_proj.weight"][:8] for e in range(4)}
    given.update({f"mixer.experts.{e}.down_proj.weight": w[f"mixer.experts.{e}.down_proj.weight"][:, :8]
                  for e in range(3)})  # expert 3's down_proj forgotten
    with pytest.raises(RewriteError, match=r"mixer\.experts\.3\.down_proj\.weight"):
        small_program.rewrite(node, op=node.op.replace(d_ff=8), weights=given)
    assert_unchanged(small_program, snap)


def test_shrinking_moe_d_ff_with_a_wrongly_sliced_weight_raises(small_program):
    snap = snapshot(small_program)
    node = small_program.node("backbone.layers.1")
    w = small_program.node_weights(node)
    given = {f"mixer.experts.{e}.up_proj.weight": w[f"mixer.experts.{e}.up_proj.weight"][:8] for e in range(4)}
    given.update({f"mixer.experts.{e}.down_proj.weight": w[f"mixer.experts.{e}.down_proj.weight"][:8]
                  for e in range(4)})  # sliced along the wrong axis: [8, 16] instead of [16, 8]
    with pytest.raises(RewriteError) as exc:
        small_program.rewrite(node, op=node.op.replace(d_ff=8), weights=given)
    assert "down_proj.weight" in str(exc.value) and "[8, 16]" in str(exc.value) and "[16, 8]" in str(exc.value)
    assert_unchanged(small_program, snap)


@pytest.mark.parametrize("path", ["backbone.layers.1", "backbone.layers.2"], ids=["latent", "no-latent"])
def test_shrinking_moe_d_ff_with_sliced_weights(small_program, ids, path):
    node = small_program.node(path)
    keep = 8
    w = small_program.node_weights(node)
    names_before = sorted(small_program.weights.names())
    # zero the channels that will be cut, so that cutting them cannot change the function
    for e in range(node.op.experts):
        up = w[f"mixer.experts.{e}.up_proj.weight"].clone()
        up[keep:] = 0
        small_program.weights.set(f"{node.path}.mixer.experts.{e}.up_proj.weight", up)
    before = run(small_program, ids)
    w = small_program.node_weights(node)
    given = {}
    for e in range(node.op.experts):
        given[f"mixer.experts.{e}.up_proj.weight"] = w[f"mixer.experts.{e}.up_proj.weight"][:keep].clone()
        given[f"mixer.experts.{e}.down_proj.weight"] = w[f"mixer.experts.{e}.down_proj.weight"][:, :keep].clone()
    new = small_program.rewrite(node, op=node.op.replace(d_ff=keep), weights=given)
    assert new.op.d_ff == keep
    ir.verify(small_program)
    # the same names, the expert tensors in their new shape only, everything else untouched
    assert sorted(small_program.weights.names()) == names_before
    width = node.op.expert_width
    for e in range(node.op.experts):
        assert small_program.weights.shape(f"{path}.mixer.experts.{e}.up_proj.weight") == (keep, width)
        assert small_program.weights.shape(f"{path}.mixer.experts.{e}.down_proj.weight") == (width, keep)
        stored = small_program.weights.get(f"{path}.mixer.experts.{e}.up_proj.weight")
        assert torch.equal(stored, given[f"mixer.experts.{e}.up_proj.weight"])
        assert stored.data_ptr() == given[f"mixer.experts.{e}.up_proj.weight"].data_ptr()  # not copied
    for local in ("norm.weight", "mixer.gate.weight", "mixer.shared_experts.up_proj.weight"):
        assert small_program.weights.get(f"{path}.{local}") is w[local]
    after = run(small_program, ids)
    for a, b in zip(after, before):
        assert a.shape == b.shape == (2, 11, 64)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    counts = small_program.param_counts()["by_kind"]["moe"]
    assert counts["total"] == sum(
        sum(small_program.weights.nbytes(f"{n.path}.{k}") // 4 for k in n.op.params())
        for n in small_program.blocks("moe"))


def test_shrunk_moe_block_matches_a_hand_computation(small_program):
    node = small_program.node("backbone.layers.1")
    w = small_program.node_weights(node)
    g = torch.Generator().manual_seed(3)
    given = {}
    for e in range(node.op.experts):
        idx = torch.randperm(16, generator=g)[:6]  # any 6 channels, in any order
        given[f"mixer.experts.{e}.up_proj.weight"] = w[f"mixer.experts.{e}.up_proj.weight"][idx]
        given[f"mixer.experts.{e}.down_proj.weight"] = w[f"mixer.experts.{e}.down_proj.weight"][:, idx]
    new = small_program.rewrite(node, op=node.op.replace(d_ff=6), weights=given)
    ir.verify(small_program)
    x = torch.randn(2, 5, 32, generator=g)
    with torch.no_grad():
        got, state = block_module(small_program, node.path)(x)
    assert state == ()
    want = hand_moe_block(new.op, small_program.node_weights(new), x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# -- bad weights ------------------------------------------------------------------------------------------------
def test_rewrite_with_an_extra_weight_name_raises(small_program):
    snap = snapshot(small_program)
    node = small_program.node("backbone.layers.2")
    with pytest.raises(RewriteError) as exc:
        small_program.rewrite(node, op=node.op.replace(top_k=1),
                              weights={"mixer.fc1_latent_proj.weight": torch.zeros(16, 32)})
    assert "mixer.fc1_latent_proj.weight" in str(exc.value) and "backbone.layers.2" in str(exc.value)
    assert_unchanged(small_program, snap)
    with pytest.raises(RewriteError, match="mixer.bogus"):
        small_program.rewrite(node, weights={"mixer.bogus": torch.zeros(1)})
    assert_unchanged(small_program, snap)


def test_rewrite_with_a_wrong_shape_for_the_same_spec_raises(small_program):
    snap = snapshot(small_program)
    with pytest.raises(RewriteError, match=r"mixer\.linear\.weight.*\[32, 16\].*\[32, 32\]"):
        small_program.rewrite("backbone.layers.6", weights={"mixer.linear.weight": torch.zeros(32, 16)})
    assert_unchanged(small_program, snap)


def test_rewrite_weights_only(small_program, ids):
    before = run(small_program, ids)
    z = torch.zeros(32, 32)
    node = small_program.rewrite("backbone.layers.6", weights={"mixer.linear.weight": z})
    assert torch.equal(small_program.weights.get("backbone.layers.6.mixer.linear.weight"), z)
    assert node.op == Linear(32)
    ir.verify(small_program)
    after = run(small_program, ids)
    assert not torch.equal(after[0], before[0])
    # a zero linear mixer is the identity block: the same as a noop there
    small_program.rewrite("backbone.layers.6", op=Noop(32))
    for a, b in zip(run(small_program, ids), after):
        assert torch.equal(a, b)


def test_rewrite_error_is_a_puzzlekit_error():
    assert issubclass(RewriteError, PuzzlekitError)


# -- changing the kind ----------------------------------------------------------------------------------------
def test_rewrite_to_noop_drops_the_block_weights(small_program, ids):
    n_before = len(small_program.weights)
    owned = [k for k in small_program.weights.names() if k.startswith("backbone.layers.3.")]
    assert len(owned) == 5
    new = small_program.rewrite("backbone.layers.3", op=Noop(32))
    assert new.op.kind == "noop" and new.op.params() == {}
    assert not [k for k in small_program.weights.names() if k.startswith("backbone.layers.3.")]
    assert len(small_program.weights) == n_before - 5
    ir.verify(small_program)
    out = run(small_program, ids)
    assert out[0].shape == (2, 11, 64) and out[1].shape == (2, 11, 64)
    counts = small_program.param_counts()["by_kind"]
    assert counts["noop"]["count"] == 2 and "attention" not in counts
    assert "%x4 = noop(%x3) {hidden=32}  # backbone.layers.3" in ir.print_program(small_program)


def test_rewrite_moe_to_linear_keeps_the_norm_and_drops_the_rest(small_program):
    norm = small_program.weights.get("backbone.layers.2.norm.weight")
    lin = torch.randn(32, 32)
    small_program.rewrite("backbone.layers.2", op=Linear(32), weights={"mixer.linear.weight": lin})
    assert sorted(k for k in small_program.weights.names() if k.startswith("backbone.layers.2.")) == \
        ["backbone.layers.2.mixer.linear.weight", "backbone.layers.2.norm.weight"]
    assert small_program.weights.get("backbone.layers.2.norm.weight") is norm
    ir.verify(small_program)


def test_rewrite_to_linear_without_its_weight_raises(small_program):
    snap = snapshot(small_program)
    with pytest.raises(RewriteError, match="mixer.linear.weight"):
        small_program.rewrite("backbone.layers.2", op=Linear(32))
    assert_unchanged(small_program, snap)


# -- copies -------------------------------------------------------------------------------------------------------
def test_copy_is_independent(small_program, ids):
    before = run(small_program, ids)
    text = ir.print_program(small_program)
    snap = snapshot(small_program)
    twin = small_program.copy()
    twin.rewrite("backbone.layers.4", op=Noop(32))
    twin.rewrite("backbone.layers.6", weights={"mixer.linear.weight": torch.zeros(32, 32)})
    node = twin.node("backbone.layers.2")
    twin.rewrite(node, op=node.op.replace(top_k=1))
    twin.weights.set("backbone.embeddings.weight", torch.zeros(64, 32))
    ir.verify(twin)
    assert_unchanged(small_program, snap)
    assert ir.print_program(small_program) == text
    ir.verify(small_program)
    for a, b in zip(run(small_program, ids), before):
        assert torch.equal(a, b)
    # and the other way round
    twin_text, twin_snap = ir.print_program(twin), snapshot(twin)
    small_program.rewrite("backbone.layers.3", op=Noop(32))
    assert ir.print_program(twin) == twin_text
    assert_unchanged(twin, twin_snap)
    assert "backbone.layers.3.mixer.q_proj.weight" in twin.weights


def test_copy_of_a_loaded_program_is_independent(small_program, tmp_path):
    ir.save(small_program, tmp_path / "ckpt", extended=True)
    loaded = ir.load(tmp_path / "ckpt")
    twin = loaded.copy()
    twin.rewrite("backbone.layers.0", op=Noop(32))
    assert "backbone.layers.0.mixer.in_proj.weight" in loaded.weights
    assert loaded.weights.source("backbone.layers.0.mixer.in_proj.weight") is not None
    ir.verify(loaded)
    ir.verify(twin)
    assert loaded.node("backbone.layers.0").op.kind == "mamba2"
    ir.save(twin, tmp_path / "twin", extended=True)  # the copy still reads its lazy tensors
    again = ir.load(tmp_path / "twin")
    assert again.node("backbone.layers.0").op.kind == "noop"
    assert torch.equal(again.weights.get("lm_head.weight"), small_program.weights.get("lm_head.weight"))
