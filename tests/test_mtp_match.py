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


def _attend(w, x, kv: int):
    """The head's attention by hand (no positional encoding, causal, grouped KV heads): the oracle for a merge."""
    t, (q, k, v, o) = x.shape[0], (w[n].double() for n in "qkvo")
    qh, kh, vh = (x @ m.T for m in (q, k, v))
    rep, outs = q.shape[0] // D // kv, []
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    for h in range(q.shape[0] // D):
        g = h // rep
        s = (qh[:, h * D:(h + 1) * D] @ kh[:, g * D:(g + 1) * D].T / D ** 0.5).masked_fill(~mask, float("-inf"))
        outs.append(s.softmax(-1) @ vh[:, g * D:(g + 1) * D])
    return torch.cat(outs, 1) @ o.T


def test_merged_kv_heads_keep_every_query_heads_attention_and_the_trunk_is_untouched(tmp_path):
    prog = _pruned_trunk("kv_merge", [0])  # 4 query heads, 1 KV head: Puzzle's GQA reduction
    before, ids = _head_weights(prog), torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    x = torch.randn(24, 128, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    trunk = _trunk_logits(prog, ids)
    _run(prog, "mtp-match-attention{engine=all}")
    att = prog.find("mtp")[0].op.blocks[0]
    assert (att.q_heads, att.kv_heads, att.head_dim) == (4, 1, D)
    after = _head_weights(prog)
    # closer to the head's own attention than the mean merge (Puzzle's start), which keeps q and o
    mean = before | {k: before[k].reshape(2, D, -1).mean(0) for k in "kv"}
    want = _attend(before, x, 2)
    err = lambda w: ((_attend(w, x, 1) - want).norm() / want.norm()).item()
    assert err(after) < 0.3 * err(mean), (err(after), err(mean))  # 0.10 against 0.60 here
    assert torch.equal(_trunk_logits(prog, ids), trunk)
    ir.save(prog, tmp_path / "child")
    (trt,) = check_serving(tmp_path / "child", engines=("tensorrt-llm",))
    assert trt.loads, trt.problems


def test_kv_heads_one_spans_merge_exactly():
    """Where a group's K and V projections span head_dim rows (head 2's are a linear map of head 1's), the merged
    head computes exactly the attention of the two: each query head's scores and values are kept."""
    prog = ir.load(DEFAULT_MODEL)
    g = torch.Generator().manual_seed(2)
    w = _head_weights(prog)
    for k in "kv":
        first = w[k][:D]
        w[k] = torch.cat([first, (torch.eye(D) + 0.3 * torch.randn(D, D, generator=g)) @ first])
        prog.weights.set(f"mtp.layers.0.mixer.{k}_proj.weight", w[k].clone())
    for node in prog.find("attention"):  # the trunk merged to one KV head
        local = {k: prog.weights.get(f"{node.path}.{k}") for k in node.op.params()}
        spec, new = node.op.shrink("kv_merge", torch.tensor([0]), local)
        prog.rewrite(node, op=spec, weights={k: v for k, v in new.items() if "_proj." in k})
    _run(prog, "mtp-match-attention{engine=all}")
    x = torch.randn(24, 128, generator=g, dtype=torch.float64)
    want = _attend(w, x, 2)
    assert torch.allclose(_attend(_head_weights(prog), x, 1), want, rtol=1e-4, atol=1e-5 * want.abs().max().item())


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
    _run(prog, "mtp-match-attention{engine=vllm}")
    assert prog.find("mtp")[0].op.blocks[0].kv_heads == 2
    parent = ir.load(DEFAULT_MODEL)
    _run(parent, "mtp-match-attention{engine=all}")  # trunk and head already agree
    assert parent.find("mtp")[0].op == ir.load(DEFAULT_MODEL).find("mtp")[0].op
    assert torch.equal(_head_weights(prog)["k"], before["k"])


def test_sglang_matches_only_the_kv_pool_shape_of_the_head():
    """SGLang's one KV pool takes the top level's (the head's) KV heads: the head's KV heads follow the trunk's,
    its query heads stay whatever the trunk's are."""
    prog = _pruned_trunk("kv_heads", [0])  # the trunk keeps one KV group: 2 query heads, 1 KV head
    _run(prog, "mtp-match-attention{engine=sglang}")
    head = prog.find("mtp")[0].op.blocks[0]
    assert (head.q_heads, head.kv_heads) == (4, 1)  # merged KV heads, the head's own 4 query heads


def test_a_trunk_no_shrink_reaches_is_refused_naming_the_way_out():
    prog = _pruned_trunk("q_heads", [0, 2])  # 2 query heads over 2 KV groups: neither merging nor dropping groups
    with pytest.raises(PassError, match="only merging or dropping whole KV groups.*--engine vllm"):
        _run(prog, "mtp-match-attention{engine=all}")


@pytest.mark.parametrize("grid", ["default", "planning"])
@pytest.mark.parametrize("engine", ["all", "sglang"])
def test_every_attention_the_search_offers_the_heads_match_follows_and_no_other(grid, engine, tmp_path):
    """On a miniature with Super's counts (32 query / 2 KV heads, head `*E`), where an engine builds the head's
    attention from the top level: each trunk attention of the library that the search offers, put in every trunk
    attention layer, is one mtp-match-attention takes the head to (the engines' top-level fields then agree), and
    each that it refuses is one the pass cannot reach."""
    from puzzlekit.passes.puzzle import build_library
    from puzzlekit.passes.puzzle.engines import PROFILES, get_engine
    from puzzlekit.passes.puzzle.search import Constraints, Search
    from puzzlekit.tools.miniature import build_miniature, load_config

    build_miniature(load_config("nemotron-3-super-120b-a12b"), tmp_path / "m", 256)
    parent = ir.load(tmp_path / "m")
    grid_file = None if grid == "default" else ir.__file__.rsplit("/", 2)[0] + "/passes/puzzle/planning-grid.toml"
    lib = build_library(ir.load(tmp_path / "m" / "config.json"), tmp_path / "lib", grid_file)
    search = Search(lib, parent, [("h100", "decode-heavy")], constraints=Constraints(speedup=1.2), engine=engine)
    offered = {s for s in search.specs if s.kind == "attention"}
    every = {lib.spec(r) for r in lib.rows if r["kind"] == "attention"}
    head, profile = parent.find("mtp")[0].op, get_engine(engine)
    block = next(b for b in head.blocks if b.kind == "attention")
    # q-head cuts within a KV group are refused where all three fields are the top level's (TensorRT-LLM's, in
    # `all`); SGLang reads only the KV pool's shape, which a merge always reaches
    assert len(offered) > 1 and bool(every - offered) == (engine == "all")
    g = torch.Generator().manual_seed(0)
    for spec in sorted(every, key=lambda s: (s.q_heads, s.kv_heads)):
        prog = ir.load(tmp_path / "m")
        for node in prog.find("attention"):
            prog.rewrite(node, op=spec, weights={k: torch.randn(shape, generator=g) * 0.1
                                                 for k, shape in spec.params().items()})
        if spec not in offered:
            assert profile.head_cannot_follow(spec, head)
            with pytest.raises(PassError, match="only merging or dropping whole KV groups"):
                _run(prog, f"mtp-match-attention{{engine={engine}}}")
            continue
        _run(prog, f"mtp-match-attention{{engine={engine}}}")
        got = next(b for b in prog.find("mtp")[0].op.blocks if b.kind == "attention")
        assert (got.q_heads, got.kv_heads, got.head_dim) == profile.head_attention(spec, block)
    assert PROFILES["vllm"].head_cannot_follow(min(every, key=lambda s: s.q_heads), head) == ""
