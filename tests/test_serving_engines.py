"""What the engines' code does with a published child, rule by rule: the context a serve command asks
for, SGLang's one KV pool, vLLM's MTP expert map, TensorRT-LLM's filled MoE fields, Mamba groups and routing
backend, vLLM's batched tokens, and the dt clamp written only where it is not the default. Each child is saved by
`ir.save` from a small program built here; the rules' sources are in docs/engines.md, and
tests/test_engine_oracles.py checks the ones whose engine code runs here against that code."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from puzzlekit import ir
from puzzlekit.backends.cost import get_scenario
from puzzlekit.backends.layout import Layout
from puzzlekit.backends.serving import serving
from puzzlekit.backends.serving_check import check_serving
from puzzlekit.backends.torch import random_weights
from puzzlekit.errors import CheckpointError
from puzzlekit.ir.ops import MTP, Attention, Embed, LMHead, Mamba2, MoE, Norm
from puzzlekit.passes.puzzle.engines import PROFILES
from puzzlekit.tools.cli import main

H, V = 32, 64


def mamba(groups=2, dt_min=0.0):
    return Mamba2(H, heads=4, head_dim=16, state=8, groups=groups, chunk=4, dt_min=dt_min)


def moe(experts=8, top_k=2, latent=16):
    return MoE(H, experts=experts, top_k=top_k, d_ff=16, shared_d_ff=24, latent=latent)


def attention(kv=2):
    return Attention(H, q_heads=4, kv_heads=kv, head_dim=8)


def child(tmp_path, name, blocks, head=(attention(), moe()), edit=None, seed=0):
    """A child saved as `save` writes it (random weights), its config then edited by `edit(cfg)` if given."""
    prog = ir.assemble(Embed(V, H), list(blocks), Norm(H), LMHead(V, H), MTP(H, tuple(head)) if head else None)
    random_weights(prog, seed=seed, std=0.3)
    d = tmp_path / name
    ir.save(prog, d)
    if edit is not None:
        cfg = json.loads((d / "config.json").read_text())
        edit(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    return d


def verdicts(d, **kw):
    return {v.engine: v for v in check_serving(d, **kw)}


PLAIN = (mamba(), moe(), attention(), moe())


# -- 1: the context ---------------------------------------------------------------------------------------------
def test_serve_commands_never_ask_for_more_context_than_the_checkpoint_holds(tmp_path):
    sc = get_scenario("decode-heavy")  # 8K in / 64K out: 73,728 tokens
    unset = child(tmp_path, "unset", PLAIN)
    s = serving(unset, unset, "tp1", sc, 64)
    assert s.context_len == 4096 and "--max-model-len" in s.vllm()
    assert s.vllm()[s.vllm().index("--max-model-len") + 1] == "4096"
    assert s.sglang()[s.sglang().index("--context-length") + 1] == "4096"
    assert s.trtllm()[s.trtllm().index("--max_seq_len") + 1] == "4096"
    assert any("73,728" in n and "no max_position_embeddings" in n for n in s.notes)
    short = child(tmp_path, "short", PLAIN, edit=lambda c: c.update(max_position_embeddings=256))
    assert serving(short, short, "tp1", sc, 64).context_len == 256
    long = child(tmp_path, "long", PLAIN, edit=lambda c: c.update(max_position_embeddings=131072))
    s = serving(long, long, "tp1", sc, 64)
    assert s.context_len == sc.context_len == 73728 and not any("context" in n for n in s.notes)


def test_check_serving_refuses_a_context_past_max_position_embeddings(tmp_path):
    d = child(tmp_path, "unset", PLAIN)
    v = verdicts(d)
    assert all(x.loads for x in v.values())
    assert all(any("no max_position_embeddings" in n for n in x.notes) for x in v.values())
    assert any("assumes 4,096" in n for n in v["vllm"].notes) and any("assumes 4,096" in n for n in v["sglang"].notes)
    v = verdicts(d, context=73728)
    assert not v["vllm"].loads and not v["sglang"].loads and v["tensorrt-llm"].loads
    assert "VLLM_ALLOW_LONG_MAX_MODEL_LEN" in v["vllm"].problems[0]
    assert "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN" in v["sglang"].problems[0]
    assert all(x.loads for x in verdicts(d, context=4096).values())


def test_context_of_is_the_stated_field_else_the_trained_window():
    from puzzlekit.ir.hf_fields import context_of, served_context

    assert context_of({"max_position_embeddings": 1024}) == 1024
    assert context_of({"provenance": {"training": {"config": {"seq": 256}}}}) == 256
    assert context_of({}) is None and served_context({}) == 4096
    builtin = Path(__file__).resolve().parents[1] / "tools" / "default-model" / "config.json"
    assert context_of(json.loads(builtin.read_text())) == 256  # the built-in model's training window


# -- 2: SGLang's one KV pool ----------------------------------------------------------------------------------------
def test_sglang_refuses_attention_layers_whose_kv_pool_shape_differs(tmp_path):
    d = child(tmp_path, "kv", (mamba(), moe(), attention(kv=1), moe(), attention(kv=2)), head=(attention(2), moe()))
    v = verdicts(d)
    assert v["vllm"].loads, v["vllm"].problems  # vLLM builds each attention layer and its cache per layer
    (p,) = v["sglang"].problems
    assert p.startswith("backbone.layers.2: 1 KV heads of 8") and "(2 of 8" in p
    # the profile keeps them equal (and the MTP head's, through mtp-match-attention)
    sg = PROFILES["sglang"]
    assert "attention.kv_heads+head_dim" in sg.uniform_groups({"attention"}) and sg.head_from_top
    assert "attention.kv_heads+head_dim" in PROFILES["all"].uniform_groups({"attention"})


# -- 3: vLLM's MTP head expert map --------------------------------------------------------------------------------
def test_vllm_sizes_the_mtp_heads_experts_by_the_top_level_not_the_trunks(tmp_path):
    # trunk layers of 8 experts load per layer; the head of 4 is what the top level sizes
    d = child(tmp_path, "head4", PLAIN, head=(attention(), moe(experts=4)))
    assert json.loads((d / "config.json").read_text())["n_routed_experts"] == 4
    assert verdicts(d, engines=("vllm",))["vllm"].loads
    unset = child(tmp_path, "unset", PLAIN, edit=lambda c: c.update(n_routed_experts=None))
    (p,) = verdicts(unset, engines=("vllm",))["vllm"].problems
    assert "top-level n_routed_experts is None" in p and "nemotron_h_mtp" in p


# -- 4: TensorRT-LLM fills null top-level MoE fields for trunk layers too -----------------------------------------
def test_tensorrt_llm_fills_a_null_latent_for_trunk_layers_without_one(tmp_path):
    d = child(tmp_path, "latent", (mamba(), moe(latent=16), attention(), moe(latent=0)), head=(attention(), moe()))
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["moe_latent_size"] is None and cfg["block_configs"][3]["moe_latent_size"] is None
    v = verdicts(d)
    assert v["vllm"].loads and v["sglang"].loads
    trt = v["tensorrt-llm"]
    layer = {x["layer"]: x for x in trt.layers}["backbone.layers.3"]
    assert layer["fields"]["moe_latent_size"] == 16  # _normalize_puzzle_config's fill, from the head's MoE block
    assert any(p.startswith("backbone.layers.3 (moe)") and "would not load" in p for p in trt.problems)
    # the same trunk with a head of no latent: the fill is "none", and layer 3 loads
    ok = child(tmp_path, "ok", (mamba(), moe(latent=16), attention(), moe(latent=0)), head=(attention(), moe(latent=0)))
    assert not any("backbone.layers.3" in p for p in verdicts(ok)["tensorrt-llm"].problems)


# -- 5: TensorRT-LLM splits Mamba groups as n_groups // tp ---------------------------------------------------------
def test_tensorrt_llm_never_replicates_a_mamba_group(tmp_path):
    d = child(tmp_path, "g1", (mamba(groups=1), moe(), attention(), moe()))
    v = verdicts(d, layout=Layout.parse("tp2"))
    assert v["vllm"].loads and v["sglang"].loads  # one group replicated over tp2 (unquantized)
    assert any("1 Mamba groups over tp2" in p and "n_groups // tp" in p for p in v["tensorrt-llm"].problems)
    assert PROFILES["tensorrt-llm"].unsplit(mamba(groups=1), Layout.parse("tp2"))
    assert PROFILES["all"].unsplit(mamba(groups=1), Layout.parse("tp2"))
    assert not PROFILES["vllm"].unsplit(mamba(groups=1), Layout.parse("tp2"))


# -- 6: the top-k > 8 refusal belongs to trtllm-gen only --------------------------------------------------------------
def test_tensorrt_llm_routing_limit_is_the_trtllm_gen_backends_and_a_note(tmp_path):
    d = child(tmp_path, "topk", (mamba(), moe(experts=16, top_k=10), attention(), moe()))
    trt = verdicts(d, engines=("tensorrt-llm",))["tensorrt-llm"]
    assert trt.loads, trt.problems  # CUTLASS, the default MoE backend, falls back
    assert any("backbone.layers.1" in n and "trtllm-gen" in n and "CUTLASS" in n for n in trt.notes)
    assert "trtllm-gen" in PROFILES["tensorrt-llm"].describe()


# -- 7: vLLM's batched tokens ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch,drafts,want", [(64, 0, 8192), (3000, 0, 8192), (3000, 3, 12000)])
def test_vllm_gets_batched_tokens_for_every_priced_sequence(tmp_path, batch, drafts, want):
    d = child(tmp_path, "b", PLAIN)
    argv = serving(d, d, "tp1", get_scenario("chat"), batch, drafts=drafts).vllm()
    seqs, tokens = (int(argv[argv.index(f) + 1]) for f in ("--max-num-seqs", "--max-num-batched-tokens"))
    assert (seqs, tokens) == (batch, want) and tokens >= seqs


# -- 8: the dt clamp -------------------------------------------------------------------------------------------------
def test_time_step_limit_is_written_only_where_it_is_not_the_default(tmp_path):
    plain = json.loads((child(tmp_path, "plain", PLAIN) / "config.json").read_text())
    assert "time_step_limit" not in plain
    d = child(tmp_path, "clamped", (mamba(dt_min=0.01), moe(), attention(), moe()))
    assert json.loads((d / "config.json").read_text())["time_step_limit"][0] == 0.01
    assert ir.load(d).node("backbone.layers.0").op.dt_min == 0.01


# -- check-serving's exit status; the remote code's config class --------------------------------------------
def test_check_serving_exits_2_on_usage_errors_and_1_only_for_does_not_load(tmp_path, capsys):
    d = child(tmp_path, "c", PLAIN)
    assert main(["check-serving", str(d), "--layout", "tp3.ep7"]) == 2
    assert "ep=7 must divide" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["check-serving", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert "config.json" in err and "unexpected" not in err and len(err.strip().splitlines()) == 1
    assert main(["check-serving", str(d)]) == 0
    grouped = child(tmp_path, "g1", (mamba(groups=1), moe(), attention(), moe()))
    assert main(["check-serving", str(grouped), "--layout", "tp2"]) == 1  # TensorRT-LLM does not load it


def test_check_serving_reads_a_null_num_nextn_predict_layers(tmp_path, capsys):
    d = child(tmp_path, "nextn", PLAIN, edit=lambda c: c.update(num_nextn_predict_layers=None))
    assert main(["check-serving", str(d)]) == 0
    assert "unexpected" not in capsys.readouterr().err


def test_the_childs_config_class_refuses_block_configs_that_contradict_the_layer_types(tmp_path):
    transformers = pytest.importorskip("transformers")
    swap = lambda c: c.update(layers_block_type=["mamba", "moe", "moe", "attention"],
                              hybrid_override_pattern="MEE*")
    d = child(tmp_path, "swap", PLAIN, edit=swap)
    with pytest.raises(CheckpointError, match="disagrees"):
        ir.load(d)  # puzzlekit's own reader
    with pytest.raises(ValueError, match="layer 2 is 'moe' in layers_block_type but 'attention' in block_configs"):
        transformers.AutoConfig.from_pretrained(d, trust_remote_code=True)
