"""Every member of the family: the public configs shipped by name (Nemotron-3 Nano, Super and Ultra,
Nemotron-3.5-Lightning, the dense Nemotron-H-56B) plan at full size in every command, and miniatures of each,
built by transformers from the shipped config, compute transformers' logits and compress end to end into a child
that transformers loads and the engines' code accepts (the dense 56B, without a head, in the default suite).
Oracles: transformers' NemotronH (logits, the child's own code), check-serving's reading of the engines' code,
and the configs' own counts."""
from __future__ import annotations

import json
import math

import pytest
import torch

from puzzlekit import ir
from puzzlekit.tools.cli import main
from puzzlekit.tools.default_model import config_path
from puzzlekit.tools.miniature import build_miniature, layer_kinds, load_config, shortest_prefix

pytest.importorskip("transformers")

NANO, SUPER, ULTRA = "nemotron-3-nano-30b-a3b", "nemotron-3-super-120b-a12b", "nemotron-3-ultra-550b-a55b"
LIGHTNING, DENSE = "nemotron-3.5-lightning-30b-a3b-nvfp4", "nemotron-h-56b-base-8k"
FAMILY = (NANO, SUPER, ULTRA, LIGHTNING, DENSE)
#: (trunk layers, MTP head, routed experts, top-k, config form) as each public config states them
FACTS = {NANO: (52, False, 128, 6, "pattern"), SUPER: (88, True, 512, 22, "pattern"),
         ULTRA: (108, True, 512, 22, "lists"), LIGHTNING: (52, True, 128, 6, "lists"),
         DENSE: (118, False, 0, 0, "pattern")}
TOL = 1e-5


def _cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _rel(got, want) -> float:
    return (got - want).abs().max().item() / max(1.0, want.abs().max().item())


# -- full size: the shipped configs in every planning command --------------------------------------------------
@pytest.mark.parametrize("name", FAMILY)
def test_every_shipped_config_reads_as_it_states_itself(name):
    layers, head, experts, top_k, form = FACTS[name]
    cfg = load_config(name)
    assert ("layers_block_type" in cfg) == (form == "lists")
    prog = ir.verify(ir.load(config_path(name)))
    assert len(prog.blocks()) == layers == len(layer_kinds(cfg)) and bool(prog.find("mtp")) == head
    moe = prog.blocks("moe")
    assert (moe[0].op.experts, moe[0].op.top_k) == (experts, top_k) if experts else not moe
    assert all(n.op.dt_max == math.inf for n in prog.blocks("mamba2"))  # Ultra's 1e308 included: no clamp


@pytest.mark.parametrize("name", FAMILY)
def test_every_shipped_config_is_inspected_priced_and_planned_at_full_size(name, capsys, tmp_path):
    recipe = ["--recipe", "nvfp4"]  # Ultra in BF16 reaches no 100 tokens/s per user on 8xB200 at batch 1
    assert _cli(capsys, "inspect", name)[0] == 0
    code, out, err = _cli(capsys, "cost", name, "--target", "8xb200", *recipe, "--json")
    assert code == 0, err
    layouts = [r["layout"] for r in json.loads(out)["layouts"]]
    assert all(".ep" not in L and ".dp" not in L for L in layouts) == (name == DENSE)
    assert _cli(capsys, "library", name, "--grid", "planning", "-o", tmp_path / "lib")[0] == 0
    code, out, err = _cli(capsys, "plan", tmp_path / "lib", "--target", "8xb200", *recipe, "--speedup", "1.5", "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["feasible"] and plan["predicted"]["serve_seconds"] <= plan["limits"]["serve_seconds"] * (1 + 1e-9)
    assert (".ep" not in plan["layout"]) or name != DENSE


def test_mtp_pricing_of_a_model_without_a_head_is_refused_naming_the_fix(capsys):
    code, _, err = _cli(capsys, "cost", NANO, "--target", "h100", "--mtp", "--mtp-acceptance", "2")
    assert code == 2 and "has none" in err and "drop --mtp" in err


# -- miniatures: transformers' logits --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def minis(subword, tmp_path_factory):
    """name -> (checkpoint directory, transformers' model) for every member, in the subword tokenizer's vocabulary."""
    root = tmp_path_factory.mktemp("family")
    return {n: (root / n, build_miniature(load_config(n), root / n, len(subword.tokenizer), subword.tokenizer))
            for n in FAMILY}


@pytest.mark.parametrize("name", FAMILY)
def test_a_miniature_keeps_every_count_and_kind_and_computes_transformers_logits(name, minis):
    d, hf = minis[name]
    full, mini = ir.load(config_path(name)), ir.verify(ir.load(d))
    kinds = layer_kinds(load_config(name))
    assert [n.op.kind for n in mini.blocks()] == kinds[:shortest_prefix(kinds)]
    assert {n.op.kind for n in mini.blocks()} == set(kinds)
    for kind, counts in (("moe", ("experts", "top_k")), ("attention", ("q_heads", "kv_heads")),
                         ("mamba2", ("heads", "groups"))):
        for a in counts if full.blocks(kind) else ():
            assert getattr(mini.blocks(kind)[0].op, a) == getattr(full.blocks(kind)[0].op, a), (kind, a)
    assert [b.kind for n in mini.find("mtp") for b in n.op.blocks] == \
        [b.kind for n in full.find("mtp") for b in n.op.blocks]
    cfg = json.loads((d / "config.json").read_text())
    assert ("layers_block_type" in cfg) == (FACTS[name][4] == "lists")
    ids = torch.randint(0, hf.config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(0))
    from puzzlekit.backends.torch import materialize

    with torch.no_grad():
        want = hf(ids, use_cache=False).logits
        got = materialize(mini)(ids)
    got = got[0] if isinstance(got, tuple) else got
    assert want.abs().max() > 0.1 and _rel(got, want) < TOL


def test_an_upper_dt_clamp_is_applied_as_transformers_applies_it(subword, tmp_path):
    """time_step_limit's upper end clamps softplus(dt + dt_bias) (here on most steps): the logits are
    transformers' own, and not those of the same weights without the clamp."""
    cfg = load_config(NANO) | {"time_step_limit": [0.01, 0.03]}
    hf = build_miniature(cfg, tmp_path / "m", len(subword.tokenizer), subword.tokenizer)
    prog = ir.load(tmp_path / "m")
    assert {(n.op.dt_min, n.op.dt_max) for n in prog.blocks("mamba2")} == {(0.01, 0.03)}
    from puzzlekit.backends.torch import materialize

    ids = torch.randint(0, hf.config.vocab_size, (2, 29), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids, use_cache=False).logits
        got = materialize(prog)(ids)
        hf.config.time_step_limit = (0.01, math.inf)
        for layer in hf.model.layers:
            if hasattr(layer.mixer, "time_step_limit"):
                layer.mixer.time_step_limit = (0.01, math.inf)
        unclamped = hf(ids, use_cache=False).logits
    assert _rel(got, want) < TOL and _rel(unclamped, want) > 100 * TOL


# -- compress end to end -------------------------------------------------------------------------------------
#: the default grid with one Mamba variant besides the parent block's (a Mamba block's training is the run's cost)
GRID = """[mamba2]\nheads = [1.0, 0.5]\n[moe]\nexperts = [1.0, 0.5]\ntop_k = [1.0, 0.5]\n[attention]
q_heads = [1.0, 0.5]\nkv_heads = [1.0, 0.5]\n[mlp]\nd_ff = [1.0, 0.5, 0.25, 0.125]\n[replacements]
kinds = ["noop", "linear"]\n"""


def _compress(capsys, d, docs, out):
    """compress --quick on a smaller grid (the run end to end is what is checked, not the grid)."""
    (out.parent / "grid.toml").write_text(GRID)
    code, res, err = _cli(capsys, "compress", d, "--quick", "--target", "h100", "--scenario", "decode-heavy",
                          "--speedup", "1.3", "--data", docs, "--steps", "4", "--head-steps", "4", "--grid", out.parent / "grid.toml",
                          "-o", out, "--json")
    assert code == 0, err[-3000:]
    return json.loads(res)


def _child_is_served_and_transformers_computes_it(out):
    from transformers import AutoModelForCausalLM

    from puzzlekit.backends.layout import Layout
    from puzzlekit.backends.serving_check import check_serving
    from puzzlekit.backends.torch import materialize

    child = ir.load(out / "model")
    assert all(v.loads for v in check_serving(out / "model", layout=Layout.parse("tp1")))
    model = AutoModelForCausalLM.from_pretrained(out / "model", trust_remote_code=True, dtype=torch.float32).eval()
    ids = torch.randint(0, child.find("embed")[0].op.vocab, (2, 21), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = materialize(child)(ids)
        got = model(ids).logits
    want = want[0] if isinstance(want, tuple) else want
    assert _rel(got, want) < TOL
    return child


def _members(*slow):
    return [pytest.param(n, marks=pytest.mark.slow) if n in slow else n for n in FAMILY]


@pytest.mark.parametrize("name", _members(NANO, SUPER, ULTRA, LIGHTNING))  # the dense 56B: no head, no experts
def test_a_miniature_of_each_member_compresses_into_a_child_transformers_and_the_engines_load(
        name, minis, subword, capsys, tmp_path):
    d, _ = minis[name]
    summary = _compress(capsys, d, subword.docs, tmp_path / "run")
    child = _child_is_served_and_transformers_computes_it(tmp_path / "run")
    head = FACTS[name][1]
    assert bool(child.find("mtp")) == head == summary["mtp_head"]
    ran = summary["pipeline"]
    assert ("mtp-check" in ran) == ("head_only=true" in ran) == ("mtp-match-attention" in ran) == head
    bundle = tmp_path / "run" / "bundle"
    for where in (tmp_path / "run" / "model", bundle):  # the parent's tokenizer, byte for byte
        assert (where / "tokenizer.json").read_bytes() == (d / "tokenizer.json").read_bytes(), where
    assert "tokenizer.json" in json.loads((bundle / "build.json").read_text())["tokenizer_files"]
    serve = (bundle / "serve.sh").read_text()
    assert ("--speculative-config" in serve) == head
    report = (tmp_path / "run" / "report" / "report.md").read_text()
    assert ("The model has no MTP head" in report) != head and ("## MTP acceptance length" in report) == head
