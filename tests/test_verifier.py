"""The verifier rejects inconsistent programs, naming the node (value and path) and the attribute.

Bad programs are built by replacing Nodes / specs directly (dataclasses.replace), bypassing rewrite.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from puzzlekit import ir
from puzzlekit.errors import PuzzlekitError, VerifyError
from puzzlekit.ir import Node
from puzzlekit.ir.ops import MTP, Attention, MoE


def with_spec(prog: ir.Program, path: str, **changes) -> ir.Program:
    """Replaces the spec of the node at `path` in place (no weight changes), bypassing rewrite."""
    i = next(i for i, n in enumerate(prog.nodes) if n.path == path)
    n = prog.nodes[i]
    prog.nodes[i] = Node(n.name, dataclasses.replace(n.op, **changes), n.args, n.path)
    return prog


def rejected(prog: ir.Program, *fragments: str) -> str:
    """Asserts verify raises VerifyError and that one problem line holds every fragment; returns that line."""
    with pytest.raises(VerifyError) as exc:
        ir.verify(prog)
    msg = str(exc.value)
    lines = [p for p in ir.problems(prog) if all(f in p for f in fragments)]
    assert lines, f"no problem names all of {fragments}:\n{msg}"
    for line in lines:
        assert line in msg  # verify reports what problems() finds
    return lines[0]


def test_sound_program_verifies(small_program):
    assert ir.problems(small_program) == []
    assert ir.problems(small_program, check_finite=True) == []
    assert ir.verify(small_program) is small_program
    assert ir.verify(small_program, check_finite=True) is small_program


def test_verify_error_is_a_puzzlekit_error():
    assert issubclass(VerifyError, PuzzlekitError)


def test_moe_top_k_above_experts(small_program):
    with_spec(small_program, "backbone.layers.2", top_k=5)
    line = rejected(small_program, "backbone.layers.2", "attribute top_k")
    assert "%x3" in line and "moe" in line and "5" in line and "4" in line


def test_mamba2_heads_not_divisible_by_groups(small_program):
    # heads 4, groups 3: params change too, but the spec problem is what must be named
    with_spec(small_program, "backbone.layers.0", groups=3)
    line = rejected(small_program, "backbone.layers.0", "attribute groups")
    assert "%x1" in line and "mamba2" in line and "heads=4" in line and "groups=3" in line


def test_attention_q_heads_not_divisible_by_kv_heads(small_program):
    with_spec(small_program, "backbone.layers.3", kv_heads=3)
    line = rejected(small_program, "backbone.layers.3", "attribute kv_heads")
    assert "%x4" in line and "q_heads=4" in line and "kv_heads=3" in line


def test_block_hidden_differs_from_embedding(small_program):
    with_spec(small_program, "backbone.layers.4", hidden=16)
    line = rejected(small_program, "backbone.layers.4", "attribute hidden")
    assert "16" in line and "32" in line and "%x5" in line


def test_final_norm_hidden_differs_from_embedding(make_small_program):
    prog = with_spec(make_small_program(), "backbone.norm_f", hidden=48)
    rejected(prog, "backbone.norm_f", "attribute hidden", "48")


def test_lm_head_vocab_differs_from_embedding(small_program):
    with_spec(small_program, "lm_head", vocab=65)
    line = rejected(small_program, "lm_head", "attribute vocab")
    assert "65" in line and "64" in line and "%logits" in line


def test_mtp_inner_block_hidden_mismatch(small_program):
    mtp = small_program.node("mtp")
    blocks = (dataclasses.replace(mtp.op.blocks[0], hidden=16), mtp.op.blocks[1])
    with_spec(small_program, "mtp", blocks=blocks)
    line = rejected(small_program, "mtp", "blocks[0].hidden")
    assert "16" in line and "32" in line and "%mtp_logits" in line


def test_mtp_inner_block_spec_problem(small_program):
    mtp = small_program.node("mtp")
    blocks = (mtp.op.blocks[0], dataclasses.replace(mtp.op.blocks[1], top_k=9))
    with_spec(small_program, "mtp", blocks=blocks)
    rejected(small_program, "mtp", "blocks[1].top_k")


def test_mtp_without_blocks(small_program):
    with_spec(small_program, "mtp", blocks=())
    rejected(small_program, "mtp", "attribute blocks")


def test_mtp_block_that_is_not_a_residual_block(small_program):
    mtp = small_program.node("mtp")
    with_spec(small_program, "mtp", blocks=(mtp.op.blocks[0], small_program.node("backbone.norm_f").op))
    rejected(small_program, "mtp", "blocks[1]", "not a residual block")


def test_weight_shape_mismatch(small_program):
    small_program.weights.set("backbone.layers.3.mixer.k_proj.weight", torch.zeros(8, 32))
    line = rejected(small_program, "backbone.layers.3", "mixer.k_proj.weight")
    assert "[8, 32]" in line and "[16, 32]" in line


def test_mtp_weight_shape_mismatch(small_program):
    small_program.weights.set("mtp.layers.0.eh_proj.weight", torch.zeros(32, 32))
    line = rejected(small_program, "mtp", "layers.0.eh_proj.weight")
    assert "[32, 32]" in line and "[32, 64]" in line


def test_missing_weight(small_program):
    small_program.weights.delete("backbone.layers.1.mixer.fc1_latent_proj.weight")
    line = rejected(small_program, "backbone.layers.1", "mixer.fc1_latent_proj.weight", "missing")
    assert "%x2" in line


def test_orphan_weight(small_program):
    small_program.weights.set("backbone.layers.5.mixer.linear.weight", torch.zeros(32, 32))  # layer 5 is a noop
    rejected(small_program, "backbone.layers.5.mixer.linear.weight", "belongs to no node")


def test_undefined_ssa_input(small_program):
    n = small_program.node("backbone.layers.3")
    small_program.nodes[small_program.nodes.index(n)] = Node(n.name, n.op, ("x99",), n.path)
    rejected(small_program, "backbone.layers.3", "%x4", "input %x99", "not defined")


def test_input_used_before_its_definition(small_program):
    nodes = small_program.nodes
    i = nodes.index(small_program.node("backbone.layers.3"))
    nodes[i], nodes[i + 1] = nodes[i + 1], nodes[i]
    rejected(small_program, "backbone.layers.4", "input %x4", "not defined before")


def test_value_defined_twice(small_program):
    n = small_program.node("backbone.layers.4")
    small_program.nodes[small_program.nodes.index(n)] = Node("x4", n.op, n.args, n.path)
    rejected(small_program, "backbone.layers.4", "%x4", "defined twice")


def test_path_used_twice(small_program):
    n = small_program.node("backbone.layers.6")
    small_program.nodes[small_program.nodes.index(n)] = Node(n.name, n.op, n.args, "backbone.layers.5")
    rejected(small_program, "backbone.layers.5", "used by another node")


def test_wrong_number_of_inputs(small_program):
    n = small_program.node("mtp")
    small_program.nodes[small_program.nodes.index(n)] = Node(n.name, n.op, ("x7",), n.path)
    rejected(small_program, "mtp", "takes 2 inputs", "got 1")


def test_undefined_output(small_program):
    small_program.outputs = ("logits", "hidden_states")
    rejected(small_program, "output %hidden_states", "not defined")


@pytest.mark.parametrize("path,attr,value", [
    ("backbone.layers.1", "d_ff", 0),
    ("backbone.layers.2", "experts", 0),
    ("backbone.layers.3", "head_dim", -8),
    ("backbone.layers.0", "state", 0),
    ("backbone.layers.0", "chunk", -4),
    ("backbone.layers.4", "d_ff", -48),
    ("backbone.embeddings", "vocab", 0),
    ("lm_head", "vocab", -64),
    ("mtp", "hidden", 0),
])
def test_zero_or_negative_dims(small_program, path, attr, value):
    with_spec(small_program, path, **{attr: value})
    line = rejected(small_program, path, f"attribute {attr}")
    assert str(value) in line


def test_negative_shared_expert_width(small_program):
    with_spec(small_program, "backbone.layers.2", shared_d_ff=-1)
    rejected(small_program, "backbone.layers.2", "attribute shared_d_ff", "-1")


def test_every_problem_is_reported_at_once(small_program):
    with_spec(small_program, "backbone.layers.2", top_k=5)
    with_spec(small_program, "backbone.layers.3", kv_heads=3)
    small_program.weights.delete("backbone.layers.4.mixer.up_proj.weight")
    with pytest.raises(VerifyError) as exc:
        ir.verify(small_program)
    msg = str(exc.value)
    assert "backbone.layers.2" in msg and "backbone.layers.3" in msg and "backbone.layers.4" in msg
    assert len(ir.problems(small_program)) >= 3


def test_meta_programs_verify(make_small_program):
    prog = make_small_program(weights=False)
    for n in prog.nodes:
        for local, shape in n.op.params().items():
            prog.weights.set_meta(f"{n.path}.{local}", shape, torch.float32)
    assert ir.problems(prog, check_finite=True) == []


def test_non_finite_weights_only_with_check_finite(small_program):
    t = small_program.weights.get("backbone.layers.6.mixer.linear.weight").clone()
    t[1, 2] = float("inf")
    small_program.weights.set("backbone.layers.6.mixer.linear.weight", t)
    ir.verify(small_program)
    with pytest.raises(VerifyError, match="NaN or inf"):
        ir.verify(small_program, check_finite=True)
    assert any("backbone.layers.6" in p and "mixer.linear.weight" in p
               for p in ir.problems(small_program, check_finite=True))


def test_moe_spec_error_not_masked_by_weights(small_program):
    """A bad MoE spec with matching weights (top_k only changes routing) is still caught."""
    op = small_program.node("backbone.layers.1").op
    assert isinstance(op, MoE)
    with_spec(small_program, "backbone.layers.1", top_k=0)
    rejected(small_program, "backbone.layers.1", "attribute top_k")
    assert isinstance(small_program.node("backbone.layers.3").op, Attention)
    assert isinstance(small_program.node("mtp").op, MTP)
