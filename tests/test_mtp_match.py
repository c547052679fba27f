"""`mtp-match-attention`: the MTP head's attention takes the trunk's heads, so that TensorRT-LLM, which builds the
head's attention from the top-level fields, loads a child whose trunk attention was pruned. Oracles: the merged
heads' weights by hand, the kept groups by their output columns' norms by hand, and check-serving's reading of
TensorRT-LLM's code on the saved child."""
from __future__ import annotations

import pytest
import torch

from puzzlekit import ir
from puzzlekit.backends.serving_check import check_serving
from puzzlekit.backends.torch import materialize
from puzzlekit.passes import PassError, PassManager
from puzzlekit.tools.default_model import DEFAULT_MODEL

D = 32  # the built-in model's head size


def _pruned_trunk(axis: str, keep):
    """The built-in model with every trunk attention layer shrunk along `axis` to the `keep` units (its head: 4
    query heads in 2 KV groups, untouched)."""
    prog = ir.load(DEFAULT_MODEL)
    for node in prog.find("attention"):
        local = {k: prog.weights.get(f"{node.path}.{k}") for k in node.op.params()}
        spec, w = node.op.shrink(axis, torch.tensor(keep), local)
        prog.rewrite(node, op=spec, weights={k: v for k, v in w.items() if "_proj." in k})
    return prog


def _head_weights(prog) -> dict:
    return {k: prog.weights.get(f"mtp.layers.0.mixer.{k}_proj.weight").clone() for k in "qkvo"}


def _run(prog, text: str):
    return PassManager(text).run(prog)


def _trunk_logits(prog, ids):
    with torch.no_grad():
        return materialize(prog, inference=True)(ids)[0]


def test_merged_kv_heads_are_the_means_and_the_trunk_is_untouched(tmp_path):
    prog = _pruned_trunk("kv_merge", [0])  # 4 query heads, 1 KV head: Puzzle's GQA reduction
    before, ids = _head_weights(prog), torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    trunk = _trunk_logits(prog, ids)
    _run(prog, "mtp-match-attention{engine=all}")
    att = prog.find("mtp")[0].op.blocks[0]
    assert (att.q_heads, att.kv_heads, att.head_dim) == (4, 1, D)
    after = _head_weights(prog)
    for k in "kv":  # the two KV heads' rows merge into their mean
        assert torch.allclose(after[k], before[k].reshape(2, D, -1).mean(0), rtol=1e-6, atol=1e-7)
    assert torch.equal(after["q"], before["q"]) and torch.equal(after["o"], before["o"])
    assert torch.equal(_trunk_logits(prog, ids), trunk)
    ir.save(prog, tmp_path / "child")
    (trt,) = check_serving(tmp_path / "child", engines=("tensorrt-llm",))
    assert trt.loads, trt.problems


def test_whole_kv_groups_are_kept_by_the_weight_of_their_output_columns():
    prog = _pruned_trunk("kv_heads", [0])  # 2 query heads in 1 KV group
    before = _head_weights(prog)
    before["o"][:, :2 * D] *= 0.01  # group 0's query heads now write least: group 1 must stay
    prog.weights.set("mtp.layers.0.mixer.o_proj.weight", before["o"].clone())
    _run(prog, "mtp-match-attention{engine=tensorrt-llm}")
    att = prog.find("mtp")[0].op.blocks[0]
    assert (att.q_heads, att.kv_heads) == (2, 1)
    after = _head_weights(prog)
    assert torch.equal(after["k"], before["k"][D:]) and torch.equal(after["q"], before["q"][2 * D:])
    assert torch.equal(after["o"], before["o"][:, 2 * D:])


def test_engines_that_read_the_heads_own_fields_leave_it_alone_and_a_match_is_a_no_op():
    prog = _pruned_trunk("kv_merge", [0])
    before = _head_weights(prog)
    for text in ("mtp-match-attention{engine=vllm}", "mtp-match-attention{engine=sglang}"):
        _run(prog, text)
        assert prog.find("mtp")[0].op.blocks[0].kv_heads == 2
    parent = ir.load(DEFAULT_MODEL)
    _run(parent, "mtp-match-attention{engine=all}")  # trunk and head already agree
    assert parent.find("mtp")[0].op == ir.load(DEFAULT_MODEL).find("mtp")[0].op
    assert torch.equal(_head_weights(prog)["k"], before["k"])


def test_a_trunk_no_shrink_reaches_is_refused_naming_the_way_out():
    prog = _pruned_trunk("q_heads", [0, 2])  # 2 query heads over 2 KV groups: neither merging nor dropping groups
    with pytest.raises(PassError, match="only merging or dropping whole KV groups.*--engine vllm"):
        _run(prog, "mtp-match-attention{engine=all}")
