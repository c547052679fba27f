"""FP8 / NVFP4: bit-exact against independent oracles, edge cases, recipes, the pass, export and streaming."""
import json

import ml_dtypes
import numpy as np
import pytest
import torch
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator
from safetensors import safe_open

from puzzlekit import ir
from puzzlekit.backends.targets import TARGETS
from puzzlekit.backends.torch import materialize, random_weights
from puzzlekit.passes import PassError, PassManager
from puzzlekit.passes.quant import (QuantError, get_recipe, quantize_checkpoint, quantize_fp8, quantize_nvfp4,
                                    quantize_weight)
from puzzlekit.ir.quant.formats import E2M1_VALUES, e2m1_codes, pack_fp4, unpack_fp4
from puzzlekit.tools.default_model import DEFAULT_MODEL, default_architecture

modelopt = pytest.importorskip("modelopt.torch.quantization.qtensor")


def _onnx_cast(x: np.ndarray, to: int) -> np.ndarray:
    node = helper.make_node("Cast", ["x"], ["y"], to=to, saturate=1)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
                              [helper.make_tensor_value_info("y", to, list(x.shape))])
    return ReferenceEvaluator(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])).run(None, {"x": x})[0]


# -- element formats against ml_dtypes and onnx.reference -------------------------------------------------------
def _probe_values():
    g = torch.Generator().manual_seed(0)
    return torch.cat([torch.randn(4000, generator=g) * 50, torch.randn(4000, generator=g) * 1e-3,
                      torch.tensor([0.0, -0.0, 448.0, -448.0, 464.0, 1e-9, 2.0**-9, 2.0**-10, 240.0, 0.0625])])


def test_fp8_cast_matches_ml_dtypes_and_onnx_reference():
    x = _probe_values()
    ours = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    in_range = (x.abs() <= 448).numpy()  # ml_dtypes does not saturate
    ml = x.numpy().astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert np.array_equal(ours[in_range], ml[in_range])
    ref = _onnx_cast(x.numpy(), TensorProto.FLOAT8E4M3FN)  # saturating, everywhere
    assert np.array_equal(ours, np.asarray(ref).view(np.uint8))


def test_e2m1_rounding_matches_ml_dtypes_and_onnx_reference():
    x = torch.cat([torch.linspace(-7, 7, 2801), torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0])])
    ours = E2M1_VALUES[e2m1_codes(x).long()].numpy()
    inside = (x.abs() <= 6).numpy()
    ml = x.numpy().astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    assert np.array_equal(ours[inside], ml[inside])
    ref = np.asarray(_onnx_cast(x.numpy(), TensorProto.FLOAT4E2M1)).astype(np.float32)
    assert np.array_equal(ours, ref)


def test_pack_unpack_low_nibble_first():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0x0F]] and torch.equal(unpack_fp4(packed), codes)


# -- bit-exact against NVIDIA Model Optimizer -----------------------------------------------------------------------
def _assert_nvfp4_like_modelopt(w):
    q = quantize_nvfp4(w)
    mq, msb, ms2 = modelopt.NVFP4QTensor.quantize(w.clone(), 16)
    assert torch.equal(q.data, mq._quantized_data)
    assert torch.equal(q.block_scale.view(torch.uint8), msb.view(torch.uint8))
    assert torch.equal(q.global_scale.reshape(()), ms2.float().reshape(()))
    assert torch.equal(q.dequantize(torch.float32),
                       mq.dequantize(dtype=torch.float32, scale=msb, double_scale=ms2, block_sizes={-1: 16}))


def _assert_fp8_like_modelopt(w, axis):
    q = quantize_fp8(w, axis=axis)
    mq, ms = modelopt.FP8QTensor.quantize(w.clone(), axis=axis)
    assert torch.equal(q.data.view(torch.uint8), mq._quantized_data.view(torch.uint8))
    assert torch.equal(q.scale, ms.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(16, 64), (128, 256), (3, 5, 48)])
def test_random_tensors_match_modelopt(dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    w = (torch.randn(shape, generator=g) * torch.rand(shape[:-1] + (1,), generator=g) * 4).to(dtype)
    _assert_nvfp4_like_modelopt(w)
    _assert_fp8_like_modelopt(w, None)
    _assert_fp8_like_modelopt(w, 0)


def test_default_model_weights_match_modelopt():
    prog = ir.load(DEFAULT_MODEL)
    checked = 0
    for name in prog.weights.names():
        w = prog.weights.get(name)
        if w.dim() == 2 and w.shape[1] % 16 == 0:
            _assert_nvfp4_like_modelopt(w)
            _assert_fp8_like_modelopt(w, None)
            checked += 1
    assert checked > 50


# -- edge cases ------------------------------------------------------------------------------------------------------
def test_zeros_and_all_zero_blocks():
    z = quantize_nvfp4(torch.zeros(4, 32))
    assert float(z.global_scale) == 1.0 and bool((z.block_scale.float() == 1.0).all()) and not z.dequantize().any()
    f = quantize_fp8(torch.zeros(3, 3))
    assert float(f.scale) == 1.0 and not f.dequantize().any()
    w = torch.randn(2, 48)
    w[1, 16:32] = 0
    q = quantize_nvfp4(w)
    assert float(q.block_scale[1, 1].float()) == 1.0 and not q.dequantize()[1, 16:32].any()
    _assert_nvfp4_like_modelopt(w)


def test_saturation_above_448_and_tiny_scales():
    q = quantize_fp8(torch.tensor([1000.0, -1000.0, 1.0]), scale=torch.tensor(1.0))
    assert q.dequantize().tolist() == [448.0, -448.0, 1.0]
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 16] = 1.0, 1e-9  # second block's scale underflows E4M3: clamped to 2^-9, not 0
    q = quantize_nvfp4(w)
    assert float(q.block_scale[0, 1].float()) == 2.0**-9
    assert torch.isfinite(q.dequantize()).all()
    _assert_nvfp4_like_modelopt(w)


def test_bad_inputs_name_the_tensor():
    for bad in (float("nan"), float("inf")):
        w = torch.ones(2, 16)
        w[1, 3] = bad
        with pytest.raises(QuantError, match=r"layers\.3\.mixer\.in_proj\.weight: has 1 NaN/inf"):
            quantize_nvfp4(w, name="layers.3.mixer.in_proj.weight")
        with pytest.raises(QuantError, match="NaN/inf"):
            quantize_fp8(w, name="x")
    with pytest.raises(QuantError, match=r"w\.up: its input dimension 40 is not a multiple of 16"):
        quantize_nvfp4(torch.ones(2, 40), name="w.up")
    with pytest.raises(QuantError, match="floating-point"):
        quantize_fp8(torch.ones(2, 2, dtype=torch.int32))


def test_mse_calibration_is_never_worse_than_amax():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g)
    w[0, 0] = 40.0  # an outlier
    for fmt in ("fp8", "nvfp4"):
        err = {m: (quantize_weight(w, fmt, m).dequantize() - w).pow(2).sum().item() for m in ("amax", "mse")}
        assert err["mse"] <= err["amax"]
    assert err["mse"] < 0.95 * err["amax"]  # the NVFP4 block search finds better scales here


# -- recipes ---------------------------------------------------------------------------------------------------------
def test_nvfp4_hybrid_assignment_on_the_super_config():
    from puzzlekit.tools.default_model import config_path

    plan = get_recipe("nvfp4-hybrid").assign(ir.load(config_path("nemotron-3-super-120b-a12b")))
    moe = plan["backbone.layers.1"]
    assert moe["mixer.experts.511.down_proj.weight"] == "nvfp4" and moe["mixer.shared_experts.up_proj.weight"] == "fp8"
    assert "mixer.fc1_latent_proj.weight" not in moe and "mixer.gate.weight" not in moe
    assert plan["backbone.layers.0"] == {"mixer.in_proj.weight": "fp8", "mixer.out_proj.weight": "fp8"}
    assert "backbone.layers.7" not in plan  # attention stays BF16
    assert not any(p in plan for p in ("mtp", "lm_head", "backbone.embeddings"))


def test_last_match_wins_and_target_checks():
    r = get_recipe("fp8")
    assert r.format_of("backbone.layers.2", "mixer.q_proj.weight") == "fp8"
    assert r.format_of("backbone.layers.2", "mixer.gate.weight") == "none"
    assert r.format_of("mtp", "layers.0.mixer.q_proj.weight") == "none"
    with pytest.raises(QuantError, match="h100 cannot.*Use the `fp8` recipe, or weight-only NVFP4"):
        get_recipe("nvfp4-hybrid").check_target(TARGETS["h100"])
    get_recipe("nvfp4-hybrid").check_target(TARGETS["b200"])
    get_recipe("nvfp4-weight").check_target(TARGETS["h200"])
    with pytest.raises(QuantError, match="unknown recipe"):
        get_recipe("int3")


# -- the pass, export, reload, streaming ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base():
    return random_weights(default_architecture(), seed=0, std=0.08)


def test_quantize_pass_fake_quantizes_and_reports_kl(base):
    kls = {}
    for recipe in ("fp8", "nvfp4-hybrid", "nvfp4"):
        prog = base.copy()
        am = PassManager(f"quantize{{recipe={recipe},samples=4,seq=64}}").run(prog)
        ir.verify(prog)
        kls[recipe] = am.reports["quantize"]["kl"]
        m = materialize(prog)
        w = prog.weights.get("backbone.layers.0.mixer.in_proj.weight")
        assert torch.equal(m.get_parameter("backbone.layers.0.mixer.in_proj.weight"), w.dequantize())
    assert 0 < kls["fp8"] < kls["nvfp4-hybrid"] < kls["nvfp4"] < 1.0


def test_quantize_pass_refuses_w4a4_on_hopper(base):
    with pytest.raises(PassError, match="h100 cannot"):
        PassManager("quantize{recipe=nvfp4-hybrid,target=h100}").run(base.copy())


def test_activation_scales_are_calibrated_amax(base):
    from puzzlekit.passes.quant import calibration_windows
    prog = base.copy()
    PassManager("quantize{recipe=fp8,samples=4,seq=64}").run(prog)
    seen = []
    m = materialize(base)
    h = m.get_submodule("backbone.layers.3.mixer.q_proj").register_forward_pre_hook(
        lambda mod, a: seen.append(a[0].abs().max()))
    with torch.no_grad():
        for ids in calibration_windows([], 4, 64, base).split(4):
            m(ids)
    h.remove()
    want = max(seen) / 448
    assert float(prog.weights.get("backbone.layers.3.mixer.q_proj.input_scale")) == pytest.approx(float(want), rel=1e-6)


def test_export_layout_and_exact_reload(base, tmp_path):
    prog = base.copy()
    PassManager("quantize{recipe=nvfp4-hybrid,samples=2,seq=64}").run(prog)
    ir.save(prog, tmp_path / "q")
    f = safe_open(str(tmp_path / "q" / "model.safetensors"), "pt")
    e = "backbone.layers.1.mixer.experts.3.up_proj"
    assert f.get_tensor(f"{e}.weight").dtype == torch.uint8 and f.get_tensor(f"{e}.weight").shape == (128, 32)
    assert f.get_tensor(f"{e}.weight_scale").dtype == torch.float8_e4m3fn
    assert f.get_tensor(f"{e}.weight_scale_2").dtype == torch.float32 and f.get_tensor(f"{e}.input_scale").shape == ()
    assert f.get_tensor("backbone.layers.0.mixer.in_proj.weight").dtype == torch.float8_e4m3fn
    assert f.get_tensor("backbone.layers.3.mixer.q_proj.weight").dtype == torch.float32
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "modelopt" and cfg["quant_algo"] == "MIXED_PRECISION"
    assert cfg["quantized_layers"][e] == {"quant_algo": "NVFP4", "group_size": 16}
    assert cfg["quantized_layers"]["backbone.layers.0.mixer.in_proj"] == {"quant_algo": "FP8"}
    assert "backbone.layers.3.mixer.q_proj" not in cfg["quantized_layers"] and "lm_head" not in cfg["quantized_layers"]
    hf = json.loads((tmp_path / "q" / "hf_quant_config.json").read_text())
    assert hf["quantization"]["quantized_layers"] == cfg["quantized_layers"]
    again = ir.load(tmp_path / "q")
    ir.verify(again)
    ir.save(again, tmp_path / "q2")
    g = safe_open(str(tmp_path / "q2" / "model.safetensors"), "pt")
    assert set(f.keys()) == set(g.keys())
    for k in f.keys():
        assert f.get_tensor(k).reshape(-1).view(torch.uint8).tolist() == g.get_tensor(k).reshape(-1).view(torch.uint8).tolist()
    ids = torch.randint(0, 256, (2, 20))
    with torch.no_grad():
        assert torch.equal(materialize(prog)(ids)[0], materialize(again)(ids)[0])


def test_streamed_checkpoint_quantization_equals_in_memory(base, tmp_path):
    ir.save(base, tmp_path / "src")
    quantize_checkpoint(tmp_path / "src", tmp_path / "dst", "nvfp4-weight", max_shard_bytes=200_000)
    streamed = ir.load(tmp_path / "dst")
    ir.verify(streamed)
    assert len(list((tmp_path / "dst").glob("model-*.safetensors"))) > 3
    mem = base.copy()
    PassManager("quantize{recipe=nvfp4-weight}").run(mem)
    for k in mem.weights.names():
        a, b = mem.weights.get(k), streamed.weights.get(k)
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)
        else:
            assert torch.equal(a.data, b.data) and torch.equal(a.block_scale.view(torch.uint8), b.block_scale.view(torch.uint8))
    with pytest.raises(QuantError, match="pass its activation amax"):
        quantize_checkpoint(tmp_path / "src", tmp_path / "dst2", "nvfp4")


def test_activation_fake_quant_equals_quantize_then_dequantize():
    from puzzlekit.passes.quant import fake_quantize
    x = torch.randn(3, 5, 64) * 3
    x[0, 0, :16] = 0
    s = torch.tensor(0.02)
    assert torch.equal(fake_quantize(x, "fp8", s), quantize_fp8(x, scale=s).dequantize())
    assert torch.equal(fake_quantize(x, "nvfp4", s), quantize_nvfp4(x, global_scale=s).dequantize())
