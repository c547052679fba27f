"""`check-serving`: what vLLM, SGLang and TensorRT-LLM build from a published checkpoint, from its config and tensor
headers. Oracle for vLLM's reading: the checkpoint's own configuration class, run by transformers, which is what
vLLM calls under --trust-remote-code (`get_nemotron_h_config_for_layer`, the MTP head's layers past the trunk)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from puzzlekit import ir
from puzzlekit.backends.layout import Layout
from puzzlekit.backends.serving_check import ServingCheckError, check_serving
from puzzlekit.tools.cli import main


@pytest.fixture(scope="module")
def child(heterogeneous_child, tmp_path_factory):
    """The heterogeneous child saved: MoE layers differ (vLLM, SGLang, TensorRT-LLM read them per layer), one
    attention layer has one KV group (TensorRT-LLM reads attention from the top level only)."""
    d = tmp_path_factory.mktemp("serve") / "child"
    ir.save(heterogeneous_child(), d)
    return d


def _verdicts(d, **kw):
    return {v.engine: v for v in check_serving(d, **kw)}


def test_each_engine_reads_the_child_as_its_code_does(child):
    v = _verdicts(child)
    assert v["vllm"].loads, v["vllm"].problems
    # SGLang builds layer 3's attention per layer, but its one KV pool takes the top level's 2 KV heads
    (pool,) = v["sglang"].problems
    assert pool.startswith("backbone.layers.3: 1 KV heads of 32") and "one KV pool" in pool
    assert not v["tensorrt-llm"].loads
    trt, head = v["tensorrt-llm"].problems
    assert trt.startswith("backbone.layers.3 (attention)") and "num_key_value_heads=2 (holds 1)" in trt
    assert "would not load" in trt
    assert "MTP head's (4, 2, 32) differ" in head and "(2, 1, 32)" in head
    layers = {x["layer"]: x for x in v["tensorrt-llm"].layers}
    assert layers["backbone.layers.1"]["from"].startswith("block_configs[1]")  # MoE fields per layer
    assert layers["backbone.layers.1"]["fields"]["num_experts_per_tok"] == 1
    assert layers["backbone.layers.3"]["from"] == "top level"
    assert {x["layer"]: x["from"] for x in v["sglang"].layers}["backbone.layers.6"] == "top level"  # MLP width


def test_vllms_reading_is_what_the_checkpoints_config_class_gives(child):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.from_pretrained(child, trust_remote_code=True)
    (v,) = check_serving(child, engines=("vllm",))
    n = len(cfg.block_configs)
    assert len(v.layers) == n + 2
    for i, x in enumerate(v.layers):
        if x["kind"] == "mamba2":
            continue  # vLLM builds Mamba layers from the top level, not through the call
        layer = cfg.get_nemotron_h_config_for_layer(i)  # past the trunk: the MTP head's layers, as vLLM numbers them
        for k, want in x["fields"].items():
            got = getattr(layer, k)
            assert (list(got) if k == "time_step_limit" else got) == want, (x["layer"], k)
    assert cfg.mtp_n_routed_experts == 8


def _rewrite_config(src, dst, edit, tensors=None):
    """A copy of checkpoint `src` in `dst` with its config edited (and its tensors replaced, if given)."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_a_mamba_layer_that_differs_is_refused_by_every_engine(child, heterogeneous_child, shrink, tmp_path):
    """A config may give one Mamba layer its own heads (transformers reads it so); every engine builds Mamba layers
    and their state caches from the top level."""
    prog = heterogeneous_child()
    shrink(prog, "backbone.layers.0", ("heads", [0, 1, 3, 4]))
    tensors = load_file(str(child / "model.safetensors"))
    tensors.update({f"backbone.layers.0.{k}": prog.weights.get(f"backbone.layers.0.{k}").contiguous()
                    for k in prog.node("backbone.layers.0").op.params()})

    def edit(cfg):  # a field one block overrides, every block of the kind carries (the schema's rule)
        for i, b in enumerate(cfg["block_configs"]):
            if b["block_type"] == "mamba":
                b["mamba_num_heads"] = 4 if i == 0 else 6

    d = _rewrite_config(child, tmp_path / "mamba", edit, tensors)
    assert ir.load(d).node("backbone.layers.0").op.heads == 4  # the checkpoint is consistent as it is written
    for engine, v in _verdicts(d).items():
        assert not v.loads, engine
        assert any(p.startswith("backbone.layers.0 (mamba2)") and "mamba_num_heads=6 (holds 4)" in p
                   for p in v.problems), (engine, v.problems)
    assert main(["check-serving", str(d), "--engine", "vllm"]) == 1


def test_sglang_builds_mamba_groups_from_mamba_n_groups(child, tmp_path):
    d = _rewrite_config(child, tmp_path / "groups", lambda cfg: cfg.pop("mamba_n_groups"))
    v = _verdicts(d)
    assert v["vllm"].loads
    groups = [p for p in v["sglang"].problems if "KV pool" not in p]  # the child's KV pool problem aside
    assert len(groups) == 5 and all("n_groups=8 (holds 2)" in p for p in groups)


@pytest.mark.parametrize("layout,ok", [("tp2", True), ("tp4", False), ("tp8.ep8", False)])
def test_a_layout_whose_tp_does_not_divide_the_heads_is_refused(child, layout, ok):
    v = _verdicts(child, engines=("vllm", "sglang"), layout=Layout.parse(layout))
    for engine, verdict in v.items():
        split = [p for p in verdict.problems if "KV pool" not in p]  # SGLang's KV pool refuses the child anyway
        assert not split == ok, (engine, verdict.problems)
    if not ok:
        assert any("6 Mamba heads over tp" in p for p in v["vllm"].problems)


def test_tensorrt_llm_takes_tp_1_2_4_or_8(child, tmp_path):
    d = _rewrite_config(child, tmp_path / "uniform", lambda cfg: cfg["block_configs"][3].update(num_key_value_heads=2))
    with pytest.raises(ServingCheckError, match="does not match its own config"):
        check_serving(d)  # the tensors still hold one KV group: the config is refused, not the engines
    problems = _verdicts(child, engines=("tensorrt-llm",), layout=Layout.parse("tp3"))["tensorrt-llm"].problems
    assert any("TP 1, 2, 4 or 8, not 3" in p for p in problems)


def test_command_line_exit_status_and_json(child, capsys):
    assert main(["check-serving", str(child), "--engine", "vllm", "--json", "--verbose"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["loads"] and out["engines"][0]["engine"] == "vllm" and len(out["engines"][0]["layers"]) == 14
    assert main(["check-serving", str(child)]) == 1
    text = capsys.readouterr().out
    assert "vLLM: loads it" in text and "TensorRT-LLM: does NOT load it" in text and "backbone.layers.3" in text


def test_a_checkpoint_no_engine_reads_is_refused_with_the_reason(child, heterogeneous_child, tmp_path, capsys):
    ir.save(heterogeneous_child(), tmp_path / "ext", extended=True)
    with pytest.raises(ServingCheckError, match="without --extended"):
        check_serving(tmp_path / "ext")
    assert main(["check-serving", str(tmp_path / "ext")]) == 1
    assert "without --extended" in capsys.readouterr().err
    broken = _rewrite_config(child, tmp_path / "broken", lambda cfg: None,
                             {k: v for k, v in load_file(str(child / "model.safetensors")).items()
                              if "layers.4." not in k} | {"pad": torch.zeros(1)})
    with pytest.raises(ServingCheckError, match="does not match its own config"):
        check_serving(broken)
