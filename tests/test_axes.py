"""Prunable axes: keeping every unit reproduces the block exactly, in identity or in any order the axis
allows (importance order is a permutation); keeping fewer gives a verified, smaller block; bad keeps are
refused with a message naming the axis."""
from __future__ import annotations

import pytest
import torch

from puzzlekit.backends.torch import materialize

TOL = 1e-5  # relative to the magnitude of the block's output


def blocks_and_axes(prog):
    return [(n.path, axis) for n in prog.nodes if n.op.is_block for axis in n.op.axes()]


def run_block(prog, path, x):
    with torch.no_grad():
        return materialize(prog).get_submodule(path)(x)[0]


def shuffled(ax, g: torch.Generator) -> torch.Tensor:
    """Every unit, in a random order the axis allows: shuffled within each group, groups in order."""
    per = ax.size // ax.groups
    return torch.cat([grp * per + torch.randperm(per, generator=g) for grp in range(ax.groups)])


def shrunk(prog, path, axis, keep):
    p = prog.copy()
    node = p.node(path)
    spec, w = node.op.shrink(axis, keep, p.node_weights(node))
    p.rewrite(node, op=spec, weights=w)
    return p


@pytest.fixture
def x():
    return torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(3))


def test_every_block_kind_has_its_axes(small_program):
    got = {n.path.rsplit(".", 1)[1]: sorted(n.op.axes()) for n in small_program.nodes if n.op.is_block}
    assert got == {"0": ["head_dim", "heads", "state"], "1": ["d_ff", "experts", "latent", "shared_d_ff", "top_k"],
                   "2": ["d_ff", "experts", "shared_d_ff", "top_k"], "3": ["kv_heads", "kv_merge", "q_heads"], "4": ["d_ff"],
                   "5": [], "6": []}


@pytest.mark.parametrize("order", ["identity", "permutation"])
def test_keeping_every_unit_reproduces_the_parent(small_program, x, order):
    g = torch.Generator().manual_seed(0)
    for path, axis in blocks_and_axes(small_program):
        ax = small_program.node(path).op.axes()[axis]
        if order == "identity" or not ax.ranked:
            keep = torch.arange(ax.size)
        elif ax.per_unit:  # a different order for every expert
            keep = torch.stack([shuffled(ax, g) for _ in range(small_program.node(path).op.experts)])
        else:
            keep = shuffled(ax, g)
        p = shrunk(small_program, path, axis, keep)
        assert p.node(path).op == small_program.node(path).op
        want = run_block(small_program, path, x)
        got = run_block(p, path, x)
        if order == "identity":
            assert torch.equal(got, want), f"{path} {axis}"
        else:
            assert (got - want).abs().max() <= TOL * want.abs().max(), f"{path} {axis}"


def test_a_permutation_really_moves_weights(small_program):
    node = small_program.node("backbone.layers.0")
    keep = torch.tensor([1, 0, 3, 2])  # heads swapped within each of the 2 groups
    _, w = node.op.shrink("heads", keep, small_program.node_weights(node))
    assert not torch.equal(w["mixer.A_log"], small_program.node_weights(node)["mixer.A_log"])


@pytest.mark.parametrize("path,axis,keep,attr,value", [
    ("backbone.layers.0", "heads", [0, 2], "heads", 2),
    ("backbone.layers.0", "state", [0, 1, 2, 8, 9, 10], "state", 3),
    ("backbone.layers.0", "head_dim", list(range(8)), "head_dim", 8),
    ("backbone.layers.1", "experts", [3, 1], "experts", 2),
    ("backbone.layers.1", "d_ff", list(range(0, 16, 2)), "d_ff", 8),
    ("backbone.layers.1", "shared_d_ff", list(range(12)), "shared_d_ff", 12),
    ("backbone.layers.1", "latent", list(range(8)), "latent", 8),
    ("backbone.layers.2", "top_k", [0], "top_k", 1),
    ("backbone.layers.3", "kv_heads", [1], "kv_heads", 1),
    ("backbone.layers.3", "q_heads", [0, 2], "q_heads", 2),
    ("backbone.layers.3", "kv_merge", [0], "kv_heads", 1),
    ("backbone.layers.4", "d_ff", list(range(20)), "d_ff", 20),
])
def test_keeping_fewer_units_gives_a_smaller_verified_block(small_program, x, path, axis, keep, attr, value):
    from puzzlekit import ir

    p = shrunk(small_program, path, axis, keep)
    ir.verify(p)
    assert getattr(p.node(path).op, attr) == value
    assert p.param_counts()["total"] <= small_program.param_counts()["total"]
    y = run_block(p, path, x)
    assert y.shape == x.shape and torch.isfinite(y).all()
    assert not torch.allclose(y, run_block(small_program, path, x))


def test_kv_groups_take_their_query_heads(small_program):
    node = small_program.node("backbone.layers.3")  # 4 query heads in 2 groups, head_dim 8
    w = small_program.node_weights(node)
    spec, got = node.op.shrink("kv_heads", [1], w)
    assert (spec.kv_heads, spec.q_heads) == (1, 2)
    assert torch.equal(got["mixer.q_proj.weight"], w["mixer.q_proj.weight"][16:32])
    assert torch.equal(got["mixer.k_proj.weight"], w["mixer.k_proj.weight"][8:16])


@pytest.mark.parametrize("path,axis,keep,match", [
    ("backbone.layers.0", "heads", [0, 1, 2], "multiple of its 2 groups"),
    ("backbone.layers.0", "heads", [2, 0], "each of the 2 groups"),
    ("backbone.layers.0", "heads", [0, 9], r"\[0, 4\)"),
    ("backbone.layers.0", "heads", [], "non-empty"),
    ("backbone.layers.0", "heads", [0.5], "non-empty list of unit indices"),
    ("backbone.layers.0", "rows", [0], "no axis 'rows'"),
    ("backbone.layers.1", "experts", [0], "below top_k=2"),
    ("backbone.layers.1", "d_ff", [[0, 1]] * 3, "one row of indices per expert"),
    ("backbone.layers.3", "kv_heads", [0, 0], "repeat"),
    ("backbone.layers.3", "kv_merge", [0, 1, 2], r"\[0, 2\)"),
    ("backbone.layers.4", "d_ff", [[0, 1]], "one list of indices"),
])
def test_bad_keeps_are_refused(small_program, path, axis, keep, match):
    node = small_program.node(path)
    with pytest.raises(ValueError, match=match):
        node.op.shrink(axis, keep, small_program.node_weights(node))


def test_merged_kv_heads_are_the_mean_of_their_group(small_program):
    node = small_program.node("backbone.layers.3")
    w = small_program.node_weights(node)
    spec, got = node.op.shrink("kv_merge", [0], w)
    assert (spec.kv_heads, spec.q_heads) == (1, 4)
    assert torch.allclose(got["mixer.v_proj.weight"], (w["mixer.v_proj.weight"][:8] + w["mixer.v_proj.weight"][8:]) / 2)
    assert torch.equal(got["mixer.q_proj.weight"], w["mixer.q_proj.weight"])
