"""Engine profiles: what the search chooses under a profile is what the serving engines load.

Oracle: transformers' NemotronHBlock built for every layer from the child's saved config the way vLLM builds a
layer's config must hold exactly the child's parameter shapes (conftest's `assert_served`)."""
from __future__ import annotations

import pytest

from puzzlekit import ir
from puzzlekit.ir.checkpoint import config_of
from puzzlekit.ir.nemotron_h_puzzle import Unpublishable
from puzzlekit.ir.ops import MoE
from puzzlekit.passes import PassError
from puzzlekit.passes.puzzle import build_library
from puzzlekit.passes.puzzle.engines import ATTENTION, MAMBA, MLP, PROFILES, get_engine
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
    assert_served(child, config_of(child))


def test_lifting_the_rules_finds_a_better_child_the_engines_cannot_load(meta_lib):
    parent, lib = meta_lib
    served, free = _search(lib, parent, "all", 2.0).plan(), _search(lib, parent, "none", 2.0)
    plan = free.plan()
    assert plan.objective < served.objective  # the rules cost score: the report shows how much
    with pytest.raises(Unpublishable, match="extended"):
        config_of(free.child(free.rows_of(plan)))
    with pytest.raises(PassError, match="infeasible") as e:
        _search(lib, parent, "all", 3.0).plan()  # reachable only with what no engine loads
    assert "profile 'all'" in str(e.value) and "engine=none" in str(e.value)  # the way out is named
    _search(lib, parent, "none", 3.0).plan()


def test_each_engine_constrains_what_it_reads_from_the_top_level(meta_lib):
    parent, lib = meta_lib
    kinds = {"mamba2", "moe", "attention", "mlp"}
    assert _search(lib, parent, "vllm").uniform.keys() == {"mamba2.heads+head_dim+state+groups"}
    assert set(_search(lib, parent, "sglang").uniform) == {"mamba2.heads+head_dim+state+groups", "mlp.d_ff"}
    assert set(_search(lib, parent, "tensorrt-llm").uniform) == set(PROFILES["all"].uniform_groups(kinds))
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


def test_the_command_line_offers_every_profile():
    """The CLI writes the names out (it imports no pass at start-up): they must stay the profiles'."""
    import argparse

    from puzzlekit.passes.puzzle.engines import DEFAULT_ENGINE
    from puzzlekit.tools.puzzle import add_constraint_arguments

    p = argparse.ArgumentParser()
    add_constraint_arguments(p, int, float)
    engine = next(a for a in p._actions if a.dest == "engine")
    assert set(engine.choices) == set(PROFILES) and engine.default == DEFAULT_ENGINE
