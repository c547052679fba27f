"""Engine profiles: what the search chooses under a profile is what the serving engines load.

Oracle: transformers' NemotronHBlock built for every layer from the child's saved config the way vLLM builds a
layer's config must hold exactly the child's parameter shapes (conftest's `assert_served`)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from puzzlekit import ir
from puzzlekit.ir.checkpoint import configs
from puzzlekit.ir.nemotron_h_puzzle import Unpublishable
from puzzlekit.backends.cost import get_scenario
from puzzlekit.backends.layout import Layout
from puzzlekit.ir.ops import MLP as MLPOp
from puzzlekit.ir.ops import MTP, Attention, Mamba2, MoE
from puzzlekit.passes import PassError
from puzzlekit.passes.puzzle import build_library
from puzzlekit.passes.puzzle.engines import ATTENTION, MAMBA, MLP, PROFILES, get_engine, split_refusal
from puzzlekit.passes.puzzle.search import Constraints, Search
from puzzlekit.tools.default_model import DEFAULT_MODEL

TARGET = [("h100", "decode-heavy")]


@pytest.fixture(scope="module")
def meta_lib(tmp_path_factory):
    """A weightless library of the built-in model on the default grid (replacements included)."""
    parent = ir.load(DEFAULT_MODEL / "config.json")
    return parent, build_library(parent, tmp_path_factory.mktemp("lib") / "lib")


def _search(lib, parent, engine, speedup=1.5):
    return Search(lib, parent, TARGET, constraints=Constraints(speedup=speedup), engine=engine)


@pytest.mark.parametrize("method", ["mip", "greedy", "uniform"])
def test_the_default_profile_gives_a_child_every_engine_loads(meta_lib, method, assert_served):
    parent, lib = meta_lib
    search = _search(lib, parent, "all")
    plan = search.plan(method)
    child = search.child(search.rows_of(plan))
    assert plan.params_total < parent.param_counts()["total"]
    assert {n.op.kind for n in child.blocks()} <= {"mamba2", "moe", "attention", "mlp"}
    for kind, attrs in (MAMBA, ATTENTION, MLP):
        assert len({tuple(getattr(n.op, a) for a in attrs) for n in child.blocks(kind)}) == 1, kind
    assert_served(child, configs(child)[0])


def test_tensorrt_llm_and_all_put_one_rule_on_the_mtp_heads_attention():
    """Both build the head's attention from the top level: a trunk attention is offered where mtp-match-attention
    can take the head's to it (KV heads merged, whole KV groups dropped), under either profile alike."""
    att = Attention(128, 4, 2, 32)
    head = MTP(128, (att, MoE(128, 8, 2, 128, 128)))
    trt, every = get_engine("tensorrt-llm"), get_engine("all")
    reachable = (att, att.replace(kv_heads=1), att.replace(q_heads=2, kv_heads=1))  # itself, merged, one group
    unreachable = (att.replace(q_heads=2), att.replace(head_dim=16))  # query heads cut within a group, narrower
    for spec in reachable + unreachable:
        assert bool(trt.refusal(spec, att, "", head)) == bool(every.refusal(spec, att, "", head)) \
            == (spec in unreachable), spec
    assert "MTP head" in trt.refusal(att.replace(q_heads=2), att, "", head)
    assert get_engine("vllm").refusal(att.replace(q_heads=2), att, "", head) == ""  # reads the head's own fields
    assert trt.refusal(att.replace(q_heads=2), att, "") == ""  # no head: no rule


def test_lifting_the_rules_finds_a_better_child_the_engines_cannot_load(meta_lib):
    parent, lib = meta_lib
    served, free = _search(lib, parent, "all", 2.0).plan(), _search(lib, parent, "none", 2.0)
    plan = free.plan()
    assert plan.objective < served.objective  # the rules cost score: the report shows how much
    with pytest.raises(Unpublishable, match="extended"):
        configs(free.child(free.rows_of(plan)))
    with pytest.raises(PassError, match="infeasible") as e:
        _search(lib, parent, "all", 3.0).plan()  # reachable only with what no engine loads
    assert "profile 'all'" in str(e.value) and "engine=none" in str(e.value)  # the way out is named
    _search(lib, parent, "none", 3.0).plan()


def test_each_engine_constrains_what_it_reads_from_the_top_level(meta_lib):
    parent, lib = meta_lib
    kinds = {"mamba2", "moe", "attention", "mlp"}
    assert _search(lib, parent, "vllm").uniform.keys() == {"mamba2.heads+head_dim+state+groups"}
    # SGLang: MLP widths from the top level, and one KV pool shape for every attention layer
    assert set(_search(lib, parent, "sglang").uniform) == {"mamba2.heads+head_dim+state+groups", "mlp.d_ff",
                                                           "attention.kv_heads+head_dim"}
    assert set(_search(lib, parent, "tensorrt-llm").uniform) | {"attention.kv_heads+head_dim"} == \
        set(PROFILES["all"].uniform_groups(kinds))
    assert {r["kind"] for r in _search(lib, parent, "vllm").rows} == kinds
    assert {r["kind"] for r in _search(lib, parent, "none").rows} == kinds | {"noop", "linear"}


def test_kernel_shape_rules_refuse_by_recipe():
    moe = MoE(hidden=64, experts=8, top_k=2, d_ff=64, shared_d_ff=64, latent=1024)
    engine = get_engine("all")
    assert "multiple of 512" in engine.refusal(moe.replace(latent=768), moe, "nvfp4-hybrid")
    assert engine.refusal(moe.replace(latent=768), moe, "fp8") == ""
    assert engine.refusal(moe.replace(latent=512), moe, "nvfp4") == ""
    assert "multiple of 16" in engine.refusal(moe.replace(d_ff=40), moe, "nvfp4")
    assert engine.refusal(moe.replace(d_ff=48), moe, "nvfp4") == ""
    many = MoE(hidden=64, experts=512, top_k=22, d_ff=64, shared_d_ff=64)
    assert "top-k" in engine.refusal(many.replace(experts=384, top_k=11), many)
    assert engine.refusal(many.replace(experts=384, top_k=8), many) == ""
    assert "top-k" in engine.refusal(many.replace(experts=384), many)  # fewer experts, the parent's top-22
    assert get_engine("vllm").refusal(many.replace(experts=384, top_k=11), many) == ""
    assert get_engine("none").refusal(moe.replace(latent=768, d_ff=40), moe, "nvfp4") == ""


def test_a_parent_whose_mtp_head_no_engine_loads_is_refused_with_the_way_out(meta_lib):
    parent, lib = meta_lib
    odd = ir.load(DEFAULT_MODEL)
    mtp = odd.node("mtp")
    odd.rewrite(mtp, op=mtp.op.replace(blocks=mtp.op.blocks[:1]),
                weights={k.replace("layers.1.final", "layers.0.final"): v for k, v in odd.node_weights(mtp).items()
                         if not k.startswith("layers.1.") or "final_layernorm" in k})
    with pytest.raises(PassError, match=r"MTP head has blocks \['attention'\].*--engine none"):
        get_engine("all").check_parent(odd)
    get_engine("none").check_parent(odd)
    with pytest.raises(PassError, match="unknown engine 'trt'"):
        get_engine("trt")


def test_a_parent_whose_head_cannot_follow_its_own_trunk_attention_is_refused_before_the_library(tmp_path, capsys):
    """The built-in model's trunk attention at head size 16 (its head's 32): no merge or dropped group takes the
    head there, so under TensorRT-LLM's top-level attention no child is servable; compress stops before any work."""
    from puzzlekit.tools.cli import main

    odd = ir.load(DEFAULT_MODEL)
    for node in odd.find("attention"):
        op = node.op.replace(head_dim=16)
        odd.rewrite(node, op=op, weights={k: torch.zeros(shape) for k, shape in op.params().items() if "_proj" in k})
    with pytest.raises(PassError, match=r"4 query / 2 KV heads of 16: the MTP head's \(4 / 2 of 32\) cannot follow"):
        get_engine("all").check_parent(odd)
    get_engine("vllm").check_parent(odd)  # vLLM builds the head from its own fields
    ir.save(odd, tmp_path / "odd", extended=True)
    code = main(["compress", str(tmp_path / "odd"), "--quick", "--target", "h100", "-o", str(tmp_path / "out")])
    assert code != 0 and "cannot follow" in capsys.readouterr().err
    assert not (tmp_path / "out" / "library").exists()


def test_the_command_line_offers_every_profile():
    """The CLI writes the names out (it imports no pass at start-up): they must stay the profiles'."""
    import argparse

    from puzzlekit.passes.puzzle.engines import DEFAULT_ENGINE
    from puzzlekit.tools.puzzle import add_constraint_arguments

    p = argparse.ArgumentParser()
    add_constraint_arguments(p, int, float)
    engine = next(a for a in p._actions if a.dest == "engine")
    assert set(engine.choices) == set(PROFILES) and engine.default == DEFAULT_ENGINE


@pytest.mark.parametrize("op, layout, recipes, refused", [
    (Mamba2(128, heads=7, head_dim=32, state=32, groups=1), "tp2", "", "7 Mamba heads over tp2"),
    (Mamba2(128, heads=8, head_dim=32, state=32, groups=2), "tp4", "", "2 Mamba groups over tp4"),
    (Mamba2(128, heads=8, head_dim=32, state=32, groups=1), "tp4", "", ""),  # one group, replicated
    (Mamba2(128, heads=8, head_dim=32, state=32, groups=1), "tp4", "fp8", "1 Mamba groups over tp4"),
    (Attention(128, q_heads=4, kv_heads=2, head_dim=32), "tp4", "", ""),  # each KV head on two devices
    (Attention(128, q_heads=4, kv_heads=2, head_dim=32), "tp8", "", "4 query heads over tp8"),
    (Attention(128, q_heads=6, kv_heads=3, head_dim=32), "tp2", "", "3 KV heads over tp2"),
    (MLPOp(128, d_ff=100), "tp8", "", "MLP width 100 over tp8"),
    (MoE(128, experts=8, top_k=2, d_ff=100, shared_d_ff=128), "tp8", "", "expert width 100 over the 8 devices"),
    (MoE(128, experts=8, top_k=2, d_ff=100, shared_d_ff=128), "tp8.ep8", "", ""),  # whole experts per device
    (MoE(128, experts=8, top_k=2, d_ff=128, shared_d_ff=100), "tp8.ep8", "", "shared expert width 100 over tp8"),
])
def test_a_block_splits_over_tensor_parallel_devices_as_the_engines_assert(op, layout, recipes, refused):
    why = split_refusal(op, Layout.parse(layout), recipes)
    assert why.startswith(refused) if refused else why == ""


def test_a_multi_gpu_search_keeps_to_what_the_engines_split(meta_lib):
    """The built-in model's 4 query heads (its MTP head's too) split over at most 4 devices, its 2 Mamba
    groups over at most 2: under the engines' rules no tp4 or tp8 layout is searched or priced for the
    parent, and a pinned layout refuses exactly the options that do not split over it."""
    parent, lib = meta_lib
    free = Search(lib, parent, [("8xb200", "decode-heavy")], constraints=Constraints(speedup=1.5), engine="none")
    served = Search(lib, parent, [("8xb200", "decode-heavy")], constraints=Constraints(speedup=1.5))
    assert {cm.layout.tp for cm in free.models[0]} == {1, 2, 4, 8}
    assert {cm.layout.tp for cm in served.models[0]} == {1, 2}
    assert {Layout.parse(r["layout"]).tp for r in served.base[0].layouts} == {1, 2}
    scenario = dataclasses.replace(get_scenario("decode-heavy"), layout="tp2.r4")
    # vLLM: per-layer attention (under `all` the MTP head's attention keeps the trunk's to what it can follow)
    search = Search(lib, parent, [("8xb200", scenario)], constraints=Constraints(max_params=0.8 * _total(parent)),
                    engine="vllm")
    off = search.problem(search.spans()[0]).rows["unsplit_layers"].costs
    expected = [bool(split_refusal(sp, Layout.parse("tp2.r4"))) for sp in search.specs]
    assert off.astype(bool).tolist() == expected and any(expected)  # e.g. 1 query head
    child = search.child(search.rows_of(search.plan()))
    assert not [n.path for n in child.nodes if split_refusal(n.op, Layout.parse("tp2.r4"))]
    with pytest.raises(PassError, match="no layout of 8xb200 splits.*4 query heads over tp8"):
        Search(lib, parent, [("8xb200", dataclasses.replace(scenario, layout="tp8"))],
               constraints=Constraints(max_params=0.8 * _total(parent)))


def _total(prog) -> int:
    return prog.param_counts()["total"]
