"""The parallel layouts tried follow the model: one serving no routed experts (a dense Nemotron-H) gets no
expert parallel (`ep`) and no attention data parallel (`dp`, which the engines run to feed expert-parallel MoE;
over dense layers it is replicas), and such a layout given by hand is refused naming the one to use. A model
with experts keeps every layout it had."""
import json
from pathlib import Path

import pytest

from puzzlekit import ir
from puzzlekit.backends.cost import Scenario, Unservable, best_layout, layouts_of, serves_experts
from puzzlekit.backends.layout import Layout, layouts, no_experts_refusal
from puzzlekit.backends.targets import get_target
from puzzlekit.ir.checkpoint_config import program_from_config
from puzzlekit.ir.ops import MTP, Attention, Embed, LMHead, Mamba2, MoE, Norm
from puzzlekit.tools.default_model import config_path

DENSE = config_path("nemotron-h-56b-base-8k")  # M, -, * blocks: no experts
NANO = config_path("nemotron-3-nano-30b-a3b")
EVERY_8 = ["tp8", "tp8.ep8", "tp4.dp2.ep8", "tp2.dp4.ep8", "tp1.dp8.ep8", "tp4.r2", "tp4.ep4.r2", "tp2.dp2.ep4.r2",
           "tp1.dp4.ep4.r2", "tp2.r4", "tp2.ep2.r4", "tp1.dp2.ep2.r4", "tp1.r8"]
DENSE_8 = ["tp8", "tp4.r2", "tp2.r4", "tp1.r8"]


def _dense(pattern: str = "M-M*-") -> ir.Program:
    """A small dense Nemotron-H from its config: Mamba, MLP and attention blocks, no MoE."""
    cfg = json.loads(DENSE.read_text()) | {"hybrid_override_pattern": pattern, "num_hidden_layers": len(pattern)}
    return program_from_config(cfg, Path("x"))


def _names(got) -> list[str]:
    return [str(L) for L in got]


def test_a_model_without_experts_gets_neither_expert_nor_attention_data_parallel():
    prog = _dense()
    assert not prog.find("moe") and not serves_experts(prog, Scenario())
    got = layouts_of(get_target("8xh100"), Scenario(), prog)
    assert _names(got) == DENSE_8 and all(L.ep == 1 and L.dp == 1 for L in got)
    assert _names(layouts_of(get_target("8xh100"), Scenario(gpus=6), prog)) == ["tp6", "tp3.r2", "tp2.r3", "tp1.r6"]


def test_a_model_with_experts_keeps_every_layout():
    prog = ir.load(NANO)
    assert serves_experts(prog, Scenario())
    assert _names(layouts_of(get_target("8xh100"), Scenario(), prog)) == EVERY_8 == _names(layouts(8, experts=True))
    assert _names(layouts_of(get_target("8xh100"), Scenario())) == EVERY_8  # no model given: every layout
    assert _names(layouts_of(get_target("8xh100"), Scenario(layout="tp2.dp4.ep8"), prog)) == ["tp2.dp4.ep8"]


def test_experts_only_in_the_mtp_head_count_when_the_head_is_loaded():
    """Plain decoding does not load the MTP head (as the cost model prices it), so its experts are served only
    when drafting or with `mtp_resident`."""
    h = 64
    trunk = [Mamba2(h, heads=8, head_dim=16, state=16, groups=8), Attention(h, q_heads=8, kv_heads=8, head_dim=8)]
    prog = ir.meta_weights(ir.assemble(Embed(256, h), trunk, Norm(h), LMHead(256, h),
                                       mtp=MTP(h, (Attention(h, 8, 8, 8), MoE(h, 8, 2, 16, 24))),
                                       meta={"dtype": "bfloat16"}))
    target = get_target("8xh100")
    assert _names(layouts_of(target, Scenario(), prog)) == DENSE_8
    assert _names(layouts_of(target, Scenario(mtp_draft=1, mtp_acceptance=1.5), prog)) == EVERY_8
    assert _names(layouts_of(target, Scenario(mtp_resident=True), prog)) == EVERY_8
    with pytest.raises(Unservable, match=r"the model serves none \(its MTP head's are loaded only when drafting"):
        layouts_of(target, Scenario(layout="tp8.ep8"), prog)


@pytest.mark.parametrize("layout, fix", [
    ("tp8.ep8", "layout tp8.ep8 spreads routed experts over ep8, and the model has none; use tp8, or leave the "
                "layout out"),
    ("tp2.ep2.r4", "use tp2.r4, or leave"),
    ("tp2.dp4.ep8", "layout tp2.dp4.ep8 spreads routed experts over ep8 and runs 4 attention data-parallel groups "
                    "to feed them, and the model has none; use tp2.r4 (its 4 attention groups as replicas)"),
    ("tp1.dp2.ep2.r4", "use tp1.r8 (its 2 attention groups as replicas)"),
])
def test_an_expert_layout_given_for_a_model_without_experts_is_refused(layout, fix):
    assert fix in no_experts_refusal(Layout.parse(layout))
    with pytest.raises(Unservable) as e:
        best_layout(_dense(), "8xh100", Scenario(layout=layout))
    assert fix in str(e.value)


def test_a_plain_layout_given_for_a_model_without_experts_is_priced():
    assert not no_experts_refusal(Layout.parse("tp2.r4"))
    assert best_layout(_dense(), "8xh100", Scenario(layout="tp2.r4"))[1].layout == "tp2.r4"


def test_the_cost_command_on_a_dense_model_lists_no_expert_layout(capsys):
    from puzzlekit.tools.cli import main

    assert main(["cost", str(DENSE), "--target", "8xh100", "--scenario", "chat", "--json"]) == 0
    j = json.loads(capsys.readouterr().out)
    assert [r["layout"] for r in j["layouts"]] == DENSE_8 and j["layout"] in DENSE_8
    assert main(["cost", str(DENSE), "--target", "8xh100", "--scenario", "chat"]) == 0
    out = capsys.readouterr().out
    assert ".ep" not in out and ".dp" not in out and "(best of 4)" in out, out
    assert main(["cost", str(DENSE), "--target", "8xh100", "--layout", "tp8.ep8"]) == 2
    err = capsys.readouterr().err
    assert "layout tp8.ep8 spreads routed experts over ep8, and the model has none; use tp8" in err, err
