"""The published `nemotron_h_puzzle` schema and Model Optimizer's quantization config.

Oracles: transformers' own NemotronH blocks, built per layer from our config the way vLLM builds a layer's
config (`get_nemotron_h_config_for_layer`: the top level without the fields any block overrides, updated
with the layer's block), load each layer's tensors from our safetensors by name and must compute what our
block computes; Model Optimizer's own export functions, fed the same per-module formats, must write the
quantization config we write."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from puzzlekit import ir
from puzzlekit.backends.torch import materialize
from puzzlekit.errors import CheckpointError
from puzzlekit.ir.nemotron_h_puzzle import Unpublishable
from puzzlekit.ir.ops import MTP, Linear, Mamba2, Noop
from puzzlekit.passes.quant.calibrate import quantize_weight

DEFAULT = Path(__file__).resolve().parents[1] / "tools" / "default-model"
OLD = Path(__file__).resolve().parent / "golden" / "old_format_checkpoint"
FIELDS = Path(__file__).resolve().parent / "golden" / "modelopt_quant_config_fields.json"
TOL = 1e-5


def _rel(got, want) -> float:
    return (got - want).abs().max().item() / max(1.0, want.abs().max().item())


@pytest.fixture(scope="module")
def child(heterogeneous_child) -> ir.Program:
    """The trained default model, pruned as Puzzle prunes (see conftest's `heterogeneous_child`)."""
    return heterogeneous_child()


@pytest.fixture(scope="module")
def saved(child, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("published") / "child"
    ir.save(child, d)
    return d


# -- the schema ---------------------------------------------------------------------------------------------------
def test_config_is_the_published_schema(saved, child):
    cfg = json.loads((saved / "config.json").read_text())
    assert cfg["model_type"] == "nemotron_h_puzzle" and cfg["architectures"] == ["NemotronHPuzzleForCausalLM"]
    assert cfg["layers_block_type"] == ["mamba", "moe", "mamba", "attention", "moe", "mamba", "mlp", "mamba", "moe",
                                        "mamba", "attention", "moe"]
    assert cfg["hybrid_override_pattern"] == "MEM*EM-MEM*E" and cfg["mtp_hybrid_override_pattern"] == "*E"
    assert cfg["mtp_layers_block_type"] == ["attention", "moe"] and cfg["num_nextn_predict_layers"] == 1
    # the Mamba geometry is uniform: top level only, as the published child (ssm_state_size 96 everywhere)
    assert (cfg["ssm_state_size"], cfg["mamba_num_heads"]) == (24, 6)
    assert cfg["block_configs"][0] == {"block_type": "mamba"}
    # MoE blocks carry their geometry; top-k and d_ff differ per layer
    assert cfg["block_configs"][1] == {"block_type": "moe", "n_routed_experts": 6, "num_experts_per_tok": 1,
                                       "moe_intermediate_size": 128, "moe_shared_expert_intermediate_size": 128,
                                       "moe_latent_size": 64}
    assert cfg["block_configs"][8]["n_routed_experts"] == 4 and cfg["block_configs"][4]["moe_intermediate_size"] == 64
    assert cfg["mtp_block_configs"][1]["num_experts_per_tok"] == 1
    # TensorRT-LLM builds the MTP head's layers from the top level: there it finds the head's own fields
    assert all(cfg[k] == v for b in cfg["mtp_block_configs"] for k, v in b.items() if k != "block_type")
    assert cfg["num_experts_per_tok"] == 1 and cfg["n_routed_experts"] == 8
    # attention layers differ (one pruned to one KV group), so every attention block carries its heads
    assert cfg["block_configs"][3] == {"block_type": "attention", "num_attention_heads": 2, "num_key_value_heads": 1}
    assert cfg["head_dim"] == 32  # the same in every attention layer: top level only
    assert cfg["mtp_block_configs"][0]["num_key_value_heads"] == 2
    for b in cfg["block_configs"] + cfg["mtp_block_configs"]:  # only NemotronHConfig field names
        assert set(b) <= {"block_type", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                          "moe_shared_expert_intermediate_size", "moe_latent_size", "num_attention_heads",
                          "num_key_value_heads", "head_dim", "intermediate_size"}
    assert "mtp" not in cfg and not (saved / "hf_quant_config.json").exists()


def _hf_state(tensors: dict, prefix: str) -> dict:
    """A layer's tensors by our names, with the experts stacked as transformers holds them."""
    local = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    for k in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight"):
        local.pop(k, None)
    out = {k: v for k, v in local.items() if not k.startswith("mixer.experts.")}
    n = sum(1 for k in local if k.startswith("mixer.experts.") and k.endswith(".up_proj.weight"))
    if n:
        for side in ("up_proj", "down_proj"):
            out[f"mixer.experts.{side}"] = torch.stack([local[f"mixer.experts.{j}.{side}.weight"] for j in range(n)])
    return out


def test_every_layer_matches_transformers_block_built_from_the_config(saved, served_layers):
    cfg = json.loads((saved / "config.json").read_text())
    tensors = load_file(str(saved / "model.safetensors"))
    ours = materialize(ir.load(saved))
    g = torch.Generator().manual_seed(0)
    b, t, h = 2, 11, cfg["hidden_size"]
    causal = torch.full((t, t), float("-inf")).triu(1)[None, None].expand(b, 1, t, t)
    checked = 0
    for prefix, block, blk in served_layers(cfg):
        blk.load_state_dict(_hf_state(tensors, prefix), strict=True)
        x = torch.randn(b, t, h, generator=g)
        with torch.no_grad():
            want = blk(x, attention_mask=causal) if block["block_type"] == "attention" else blk(x)
            got, _ = ours.get_submodule(prefix[:-1])(x)
        assert (got - x).abs().max() > 1e-3, prefix  # the block does something
        assert _rel(got, want) < TOL, prefix
        checked += 1
    assert checked == 14


def test_round_trip_is_byte_identical(saved, tmp_path):
    again = ir.load(saved)
    ir.save(again, tmp_path / "again")
    for f in sorted(p.name for p in saved.iterdir()):
        assert (saved / f).read_bytes() == (tmp_path / "again" / f).read_bytes(), f
    assert sorted(p.name for p in saved.iterdir()) == sorted(p.name for p in (tmp_path / "again").iterdir())


def test_loads_back_to_the_same_program(saved, child):
    back = ir.load(saved)
    assert [n.op for n in back.nodes] == [n.op for n in child.nodes]
    ids = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, b = materialize(child)(ids), materialize(back)(ids)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


# -- what the schema cannot express ----------------------------------------------------------------------------------
def _swap(prog, path, op):
    out = prog.copy()
    node = out.node(path)
    w = {k: torch.zeros(s) for k, s in op.params().items()}
    out.rewrite(node, op=op, weights=w)
    return out


@pytest.mark.parametrize("case,words", [
    ("noop", ["backbone.layers.6", "'noop'", "extended=True"]),
    ("linear", ["backbone.layers.6", "'linear'", "extended=True"]),
    ("mamba", ["backbone.layers.5", "ssm_state_size=16", "top level"]),
    ("mtp-mamba", ["mtp has blocks", "'mamba2'", "one attention and one MoE layer"]),
    ("eps", ["backbone.layers.6", "epsilon"]),
])
def test_unexpressible_programs_are_refused_naming_the_layer(child, shrink, tmp_path, case, words):
    h = 128
    if case == "noop":
        prog = _swap(child, "backbone.layers.6", Noop(h))
    elif case == "linear":
        prog = _swap(child, "backbone.layers.6", Linear(h))
    elif case == "mamba":
        prog = child.copy()
        shrink(prog, "backbone.layers.5", ("state", list(range(16)) + list(range(24, 40))))
    elif case == "mtp-mamba":
        prog = child.copy()
        m = prog.node("mtp")
        blocks = (Mamba2(h, 6, 32, 24, 2, chunk=32), m.op.blocks[1])
        spec = MTP(h, blocks, m.op.eps)
        prog.rewrite(m, op=spec, weights={k: torch.zeros(s) for k, s in spec.params().items()})
    else:
        prog = child.copy()
        n = prog.node("backbone.layers.6")
        prog.rewrite(n, op=n.op.replace(eps=1e-6))
    with pytest.raises(Unpublishable) as e:
        ir.save(prog, tmp_path / "x")
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert not (tmp_path / "x").exists()
    ir.save(prog, tmp_path / "ext", extended=True)  # the extended form writes it, and reads it back
    cfg = json.loads((tmp_path / "ext" / "config.json").read_text())
    assert cfg["model_type"] == "puzzlekit_nemotron_h"
    assert [n.op for n in ir.load(tmp_path / "ext").nodes] == [n.op for n in prog.nodes]


# -- reading published configs written by others ----------------------------------------------------------------
def _edited(saved, tmp_path, edit) -> Path:
    d = tmp_path / "edited"
    shutil.copytree(saved, d)
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_a_field_one_block_overrides_is_needed_in_every_block_of_its_kind(saved, tmp_path):
    """As vLLM reads it, a field one Mamba block carries is gone from the top level for the others: an
    error naming the block that lacks it, not a silent default."""
    d = _edited(saved, tmp_path, lambda c: c["block_configs"][0].update(ssm_state_size=24))
    with pytest.raises(CheckpointError, match=r"block_configs\[2\].*'ssm_state_size' is missing"):
        ir.load(d)


def test_published_config_with_bad_block_is_refused(saved, tmp_path):
    d = _edited(saved, tmp_path, lambda c: c["block_configs"][3].update(block_type="transformer"))
    with pytest.raises(CheckpointError, match=r"block_configs\[3\].*unknown block_type 'transformer'"):
        ir.load(d)
    d = _edited(saved, tmp_path / "b", lambda c: c["block_configs"][1].update(num_experts_per_tok="2"))
    with pytest.raises(CheckpointError, match=r"block_configs\[1\].*'num_experts_per_tok' must be"):
        ir.load(d)
    d = _edited(saved, tmp_path / "c", lambda c: c.update(layers_block_type=["mamba"] * 12))
    with pytest.raises(CheckpointError, match="layers_block_type.*disagrees"):
        ir.load(d)


# -- files written before the published schema ----------------------------------------------------------------------
def test_first_form_files_still_load(make_small_program, tmp_path):
    """A checkpoint written by the first heterogeneous form (kept as a fixture) loads to the same program and
    weights; the default model ships in that form too."""
    cfg = json.loads((OLD / "config.json").read_text())
    assert cfg["model_type"] == "nemotron_h_puzzle" and "hidden" in cfg["block_configs"][0] and "mtp" in cfg
    old, want = ir.load(OLD), make_small_program()
    assert [n.op for n in old.nodes] == [n.op for n in want.nodes]
    for k in want.weights.names():
        assert torch.equal(old.weights.get(k), want.weights.get(k)), k
    ir.save(old, tmp_path / "ext", extended=True)
    assert load_file(str(tmp_path / "ext" / "model.safetensors")).keys() == load_file(str(OLD / "model.safetensors")).keys()
    assert [n.op.kind for n in ir.load(DEFAULT).blocks()][:4] == ["mamba2", "moe", "mamba2", "attention"]


# -- quantization ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mixed(child, quantized_with, tmp_path_factory) -> tuple[ir.Program, Path]:
    """The child quantised as NVIDIA's NVFP4 release: routed experts NVFP4, shared experts and Mamba
    projections FP8, the rest (attention, router, MTP head, LM head) BF16."""
    prog = quantized_with(child, "nvfp4-hybrid")
    d = tmp_path_factory.mktemp("mixed") / "q"
    ir.save(prog, d)
    return prog, d


def test_mixed_quant_config_lists_exactly_the_quantised_modules(mixed):
    prog, d = mixed
    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    hf = json.loads((d / "hf_quant_config.json").read_text())
    want = {}
    for n in prog.nodes:
        for local, fmt in n.op.quant:
            want[f"{n.path}.{local.removesuffix('.weight')}"] = \
                {"quant_algo": "NVFP4", "group_size": 16} if fmt == "nvfp4" else {"quant_algo": "FP8"}
    assert len(want) == 2 * (6 + 8 + 4 + 8) + 2 * 4 + 2 * 5  # routed experts (up, down), shared, Mamba in/out
    assert qc["quantized_layers"] == want == hf["quantization"]["quantized_layers"]
    assert qc["quant_algo"] == hf["quantization"]["quant_algo"] == "MIXED_PRECISION"
    assert qc["quant_method"] == "modelopt" and qc["ignore"] == []
    assert all(".experts." in m for m, e in want.items() if e["quant_algo"] == "NVFP4")
    assert not any(m.startswith(("mtp.", "lm_head")) or m.endswith((".gate", "q_proj", "k_proj", "v_proj", "o_proj",
                                                                      "latent_proj")) for m in want)
    fields = json.loads(FIELDS.read_text())
    assert set(hf) == set(fields["hf_quant_config.json"]["top"])
    assert set(hf["producer"]) == set(fields["hf_quant_config.json"]["producer"])
    assert set(hf["quantization"]) == set(fields["hf_quant_config.json"]["quantization"]["MIXED_PRECISION"])
    assert set(qc) == set(fields["quantization_config"]["MIXED_PRECISION"])
    for e in want.values():
        assert set(e) == set(fields["quantized_layers_entry"][e["quant_algo"]])


def test_quantized_round_trip_is_byte_identical(mixed, tmp_path):
    _, d = mixed
    ir.save(ir.load(d), tmp_path / "again")
    assert sorted(p.name for p in d.iterdir()) == sorted(p.name for p in (tmp_path / "again").iterdir())
    for f in d.iterdir():
        assert f.read_bytes() == (tmp_path / "again" / f.name).read_bytes(), f.name


def test_quantized_tensors_have_nvidias_names_and_dtypes(mixed):
    _, d = mixed
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        e, m = "backbone.layers.1.mixer.experts.0.up_proj", "backbone.layers.0.mixer.in_proj"
        assert f.get_tensor(f"{e}.weight").dtype == torch.uint8 and f.get_tensor(f"{e}.weight").shape == (128, 32)
        assert f.get_tensor(f"{e}.weight_scale").dtype == torch.float8_e4m3fn
        assert f.get_tensor(f"{e}.weight_scale").shape == (128, 4)
        assert f.get_tensor(f"{e}.weight_scale_2").dtype == torch.float32 and f.get_tensor(f"{e}.weight_scale_2").shape == ()
        assert f.get_tensor(f"{e}.input_scale").dtype == torch.float32 and f.get_tensor(f"{e}.input_scale").shape == ()
        assert f.get_tensor(f"{m}.weight").dtype == torch.float8_e4m3fn
        assert f.get_tensor(f"{m}.weight_scale").shape == () and f.get_tensor(f"{m}.input_scale").shape == ()
        assert f.get_tensor("backbone.layers.3.mixer.q_proj.weight").dtype == torch.float32


def _modelopt_layer_dict(prog) -> dict:
    """The per-module formats as Model Optimizer's get_quant_config collects them from a quantised model."""
    from puzzlekit.ir.quant.modelopt import formats

    names = {"fp8": "fp8", "nvfp4": "nvfp4", "nvfp4-weight": "w4a16_nvfp4", None: None}
    out = {}
    for module, fmt in sorted(formats(prog).items()):
        out[f"{module}.quantization"] = names[fmt]
        out[f"{module}.awq_block_size"] = 16 if fmt and fmt.startswith("nvfp4") else 0
    return out


@pytest.mark.parametrize("recipe", ["nvfp4-hybrid", "fp8", "nvfp4-weight"])
def test_quant_config_is_what_model_optimizer_writes(child, quantized_with, recipe, tmp_path):
    pytest.importorskip("modelopt")
    from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format
    from modelopt.torch.export.quant_utils import process_layer_quant_config

    prog = quantized_with(child, recipe)
    ir.save(prog, tmp_path / "q")
    hf = json.loads((tmp_path / "q" / "hf_quant_config.json").read_text())
    theirs = {"producer": hf["producer"], "quantization": {"quant_algo": None, "kv_cache_quant_algo": None}}
    theirs["quantization"].update(process_layer_quant_config(_modelopt_layer_dict(prog)))
    assert hf == theirs
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc == convert_hf_quant_config_format(theirs)
    back = ir.load(tmp_path / "q")  # the formats read back from the config, not from the tensors
    assert [n.op for n in back.nodes] == [n.op for n in prog.nodes]
    if recipe == "fp8":
        assert hf["quantization"]["quant_algo"] == "FP8" and "lm_head" in hf["quantization"]["exclude_modules"]


def test_fp8_weight_only_has_no_model_optimizer_algorithm(child, tmp_path):
    prog = child.copy()
    node = prog.node("backbone.layers.6")
    w = quantize_weight(prog.weights.get("backbone.layers.6.mixer.up_proj.weight"), "fp8")
    prog.rewrite(node, op=node.op.replace(quant={"mixer.up_proj.weight": "fp8-weight"}),
                 weights={"mixer.up_proj.weight": w})
    with pytest.raises(CheckpointError, match=r"backbone.layers.6.mixer.up_proj.*'fp8-weight'.*extended=True"):
        ir.save(prog, tmp_path / "x")
    ir.save(prog, tmp_path / "ext", extended=True)
    assert dict(ir.load(tmp_path / "ext").node("backbone.layers.6").op.quant) == {"mixer.up_proj.weight": "fp8-weight"}


def test_quant_config_naming_a_missing_module_is_refused(mixed, tmp_path):
    _, d = mixed
    e = _edited(d, tmp_path, lambda c: c["quantization_config"]["quantized_layers"].update(
        {"backbone.layers.0.mixer.nope": {"quant_algo": "FP8"}}))
    with pytest.raises(CheckpointError, match="backbone.layers.0.mixer.nope"):
        ir.load(e)
