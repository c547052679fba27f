"""The stable text form of Programs (golden files) and the parameter table."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from puzzlekit import ir
from puzzlekit.ir import Node
from puzzlekit.ir.ops import Opaque
from puzzlekit.tools.default_model import config_path

GOLDEN = Path(__file__).parent / "golden"
SUPER = config_path("nemotron-3-super-120b-a12b")
NANO = config_path("nemotron-3-nano-30b-a3b")


def golden(name: str) -> str:
    return (GOLDEN / name).read_text()


def table(text: str) -> dict[str, list[str]]:
    """format_params text -> first column -> the other columns."""
    rows = {}
    for line in text.splitlines()[1:]:
        if line.startswith("mtp head"):
            rows["mtp head"] = line[len("mtp head"):].split()
        else:
            first, *rest = line.split()
            rows[first] = rest
    return rows


def test_small_program_golden(make_small_program):
    prog = make_small_program(weights=False)
    assert ir.print_program(prog) == golden("small_program.txt")


def test_printing_does_not_depend_on_weights(make_small_program):
    assert ir.print_program(make_small_program()) == ir.print_program(make_small_program(weights=False))


def test_nano_golden():
    assert ir.print_program(ir.load(NANO)) == golden("nano.txt")


def test_print_is_deterministic_and_one_line_per_node():
    prog = ir.load(NANO)
    text = ir.print_program(prog)
    assert text == ir.print_program(prog)
    lines = text.splitlines()
    assert len(lines) == len(prog.nodes) + 1 and lines[-1] == "return %logits"
    for n, line in zip(prog.nodes, lines):
        assert line.startswith(f"%{n.name} = {n.op.kind}(") and line.endswith(f"  # {n.path}")


def test_super_print_shows_the_mtp_head_and_its_blocks():
    lines = ir.print_program(ir.load(SUPER)).splitlines()
    assert lines[-1] == "return %logits, %mtp_logits"
    assert lines[-4] == '%mtp_logits = mtp(%x88, %input_ids) {hidden=4096, pattern="*E"}  # mtp'
    assert lines[-3] == "    layers.0 = attention {hidden=4096, q_heads=32, kv_heads=2, head_dim=128}"
    assert lines[-2] == ("    layers.1 = moe {hidden=4096, experts=512, top_k=22, d_ff=2688, shared_d_ff=5376, "
                         "latent=1024, scaling=5.0}")
    assert len(lines) == 88 + 4 + 2 + 1


def test_default_attributes_are_left_out_and_changed_ones_shown(make_small_program):
    prog = make_small_program(weights=False)
    n = prog.node("backbone.layers.2")
    prog.nodes[prog.nodes.index(n)] = Node(n.name, n.op.replace(norm_topk=False, eps=1e-6), n.args, n.path)
    line = ir.print_program(prog).splitlines()[3]
    assert line == ("%x3 = moe(%x2) {hidden=32, experts=4, top_k=2, d_ff=16, shared_d_ff=24, norm_topk=false, "
                    "eps=1e-06}  # backbone.layers.2")


def test_opaque_node_prints_its_module_quoted(make_small_program):
    prog = make_small_program(weights=False)
    n = prog.node("backbone.layers.5")
    prog.nodes[prog.nodes.index(n)] = Node(n.name, Opaque('Odd"Module'), n.args, n.path)
    line = ir.print_program(prog).splitlines()[6]
    assert line == '%x6 = opaque(%x5) {module="Odd\\"Module", ops=0}  # backbone.layers.5'


def test_format_params_super_has_the_moe_row():
    text = ir.format_params(ir.load(SUPER))
    rows = table(text)
    assert text.splitlines()[0].split() == ["kind", "count", "total", "active"]
    assert rows["moe"] == ["40", "114.92B", "7.03B"]
    assert rows["mamba2"][0] == "40" and rows["attention"][0] == "8"
    assert rows["trunk"] == ["120.67B", "12.77B"]
    assert rows["mtp head"] == ["2.94B", "244.86M"]


def test_format_params_nano_has_no_mtp_row():
    rows = table(ir.format_params(ir.load(NANO)))
    assert rows["moe"][0] == "23" and rows["mamba2"][0] == "23" and rows["attention"][0] == "6"
    assert rows["trunk"] == ["31.58B", "3.58B"]
    assert "mtp head" not in rows


def test_format_params_small_program(make_small_program):
    text = ir.format_params(make_small_program(weights=False))
    rows = table(text)
    assert rows["noop"] == ["1", "0", "0"]
    assert rows["moe"][0] == "2" and rows["linear"] == ["1", "1.06K", "1.06K"]
    assert "mtp head" in rows
    widths = {len(line) for line in text.splitlines()}
    assert len(widths) == 1  # a right-aligned table


@pytest.mark.parametrize("cfg", [SUPER, NANO], ids=["super", "nano"])
def test_golden_files_are_not_stale(cfg):
    """The printed pattern agrees with the config's own pattern (guards the goldens themselves)."""
    prog = ir.load(cfg)
    pattern = json.loads(cfg.read_text())["hybrid_override_pattern"]
    kinds = {"M": "mamba2", "E": "moe", "*": "attention", "-": "mlp"}
    lines = ir.print_program(prog).splitlines()[1:1 + len(pattern)]
    assert [line.split(" = ")[1].split("(")[0] for line in lines] == [kinds[c] for c in pattern]
