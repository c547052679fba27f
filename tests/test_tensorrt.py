"""TensorRT bundles: W4A4 NVFP4 graphs under the reference evaluator, FP4 refusal, profiles consistent with the
graphs, validate.py's loop, and real engine builds with TensorRT-RTX (ahead of time, no GPU)."""
import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys

import ml_dtypes
import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from puzzlekit import ir
from puzzlekit.backends.cost import get_scenario
from puzzlekit.backends.onnx import DECODE, PREFILL, export_onnx
from puzzlekit.backends.onnx.trt_ops import TRT_FP4DynamicQuantize
from puzzlekit.backends.targets import TARGETS
from puzzlekit.backends.tensorrt import BundleError, plan_profiles, write_bundle
from puzzlekit.backends.torch import materialize, random_weights
from puzzlekit.ir.ops import MLP, Attention, Embed, LMHead, Mamba2, MoE, Norm
from puzzlekit.ir.quant.formats import nvfp4_qdq
from puzzlekit.passes import PassManager
from puzzlekit.tools.cli import main
from puzzlekit.tools.default_model import load_default

HAVE_RTX = importlib.util.find_spec("tensorrt_rtx_bindings") is not None
needs_rtx = pytest.mark.skipif(not HAVE_RTX, reason="TensorRT-RTX is not installed, so no engine is built: "
                               "pip install -e '.[tensorrt-rtx]' (tensorrt_rtx_cu12_libs + _bindings 1.7.1.116)")


def small_program():
    h = 32
    blocks = [Mamba2(h, 4, 8, 8, 2, chunk=4), MoE(h, 4, 2, 16, 16), Attention(h, 4, 2, 8), MLP(h, 32)]
    return random_weights(ir.assemble(Embed(256, h), blocks, Norm(h), LMHead(256, h), meta={"dtype": "float32"}),
                          seed=5, std=0.2)


# -- NVFP4 activations (W4A4) --------------------------------------------------------------------------------------
def test_reference_fp4_quantizer_follows_the_format():
    """The numpy TRT_FP4DynamicQuantize (written from the format's definition) dequantizes to exactly what the
    torch fake quantization computes, ties and an all-zero block included."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 64, generator=g) * 3
    x[0, 0, :16] = 0  # an all-zero block: scale 1
    x[1, 1, :16] = torch.tensor([6.0, 5.0, 3.5, 2.5, 1.75, 1.25, 0.75, 0.25] * 2)  # ties at every midpoint
    x[2, 2, :16] = 1e-9  # a block so small that its scale would round to zero in E4M3: clamped to 2^-9
    s2 = torch.tensor(2.0**-8)  # a block of amax 6 gets scale 256: its values are quantized unscaled
    node = helper.make_node("TRT_FP4DynamicQuantize", ["x", "s"], ["q", "sb"], domain="trt", axis=-1, block_size=16,
                            scale_type=TensorProto.FLOAT8E4M3FN)
    graph = helper.make_graph([node], "q", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5, 64]),
                                            helper.make_tensor_value_info("s", TensorProto.FLOAT, [])],
                              [helper.make_tensor_value_info("q", TensorProto.FLOAT4E2M1, None),
                               helper.make_tensor_value_info("sb", TensorProto.FLOAT8E4M3FN, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("trt", 1)])
    q, sb = ReferenceEvaluator(model, new_ops=[TRT_FP4DynamicQuantize]).run(None, {"x": x.numpy(), "s": s2.numpy()})
    assert q.dtype == ml_dtypes.float4_e2m1fn and sb.dtype == ml_dtypes.float8_e4m3fn and sb.shape == (3, 5, 4)
    deq = q.astype(np.float32) * np.repeat(sb.astype(np.float32) * s2.numpy(), 16, axis=-1)
    assert np.isfinite(deq).all()
    np.testing.assert_array_equal(deq, nvfp4_qdq(x, s2).numpy())
    assert np.all(np.abs(q[1, 1, :8].astype(np.float32)) == [6, 4, 4, 2, 2, 1, 1, 0])


@pytest.mark.slow  # heavy: runs with pytest -m slow
def test_w4a4_export_passes_checker_and_reference_evaluator(tmp_path):
    prog = small_program()
    PassManager("quantize{recipe=nvfp4,samples=2,seq=32}").run(prog)
    export_onnx(prog, tmp_path / "w4a4", target="b200")  # runs onnx.checker (full) on both graphs
    m = onnx.load(str(tmp_path / "w4a4" / PREFILL))
    quantizers = [n for n in m.graph.node if n.op_type == "TRT_FP4DynamicQuantize"]
    users = {i: n for n in m.graph.node for i in n.input}
    assert quantizers and all(n.domain == "trt" for n in quantizers)
    for qn in quantizers:  # FP4 values -> DequantizeLinear(block 16) whose scale is DequantizeLinear(E4M3 scales)
        dq, dq_scale = users[qn.output[0]], users[qn.output[1]]
        assert (dq.op_type, dq_scale.op_type) == ("DequantizeLinear", "DequantizeLinear")
        assert dq.input[1] == dq_scale.output[0]
        assert {a.name: a.i for a in dq.attribute}["block_size"] == 16
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(4))
    ref = {g: ReferenceEvaluator(onnx.load(str(tmp_path / "w4a4" / g)), new_ops=[TRT_FP4DynamicQuantize])
           for g in (PREFILL, DECODE)}
    module = materialize(prog)
    with torch.no_grad():
        want, state = module.prefill(ids)
    names = [o.name for o in ref[PREFILL].proto_.graph.output]
    got = dict(zip(names, ref[PREFILL].run(None, {"input_ids": ids.numpy()})))
    scale = np.abs(want[0].numpy()).max()
    np.testing.assert_allclose(got["logits"], want[0].numpy(), atol=1e-4 * scale, rtol=0)
    for step in range(3):
        tok = torch.randint(0, 256, (2,), generator=torch.Generator().manual_seed(10 + step))
        feeds = {"input_ids": tok.numpy()[:, None],
                 **{"past." + n[8:]: v for n, v in got.items() if n.startswith("present.")}}
        got = dict(zip(names, ref[DECODE].run(None, feeds)))
        with torch.no_grad():
            want, state = module.decode(tok, state)
        np.testing.assert_allclose(got["logits"], want[0].numpy(), atol=1e-4 * scale, rtol=0)


# -- FP4 refusal, profiles -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["rtx-sm89", "h100"])
def test_fp4_is_refused_on_a_target_without_fp4_before_any_work(target, tmp_path, capsys):
    assert main(["build-engine", "--target", target, "--recipe", "nvfp4-weight", "-o", str(tmp_path / "b")]) == 1
    err = capsys.readouterr().err
    assert target in err and "FP4" in err and "`fp8` recipe" in err
    assert not (tmp_path / "b").exists()
    prog = small_program()
    PassManager("quantize{recipe=nvfp4-weight,samples=2,seq=16}").run(prog)
    with pytest.raises(BundleError, match=f"{target}.*nvfp4-weight.*fp8"):
        write_bundle(prog, tmp_path / "c", TARGETS[target], get_scenario("chat"), build="no")


def test_profiles_cover_the_scenario_in_bands():
    pre = {"input_ids": ["batch", "sequence"]}
    dec = {"input_ids": ["batch", 1], "past.l.k": ["batch", 2, "past_sequence", 32], "past.l.ssm": ["batch", 8, 4]}
    p = plan_profiles(pre, dec, max_batch=64, input_len=50000, max_context=52000)
    assert [x["name"] for x in p["prefill"]] == ["short", "medium", "long"]
    seq = [(x["shapes"]["input_ids"]["min"][1], x["shapes"]["input_ids"]["max"][1]) for x in p["prefill"]]
    assert seq == [(1, 512), (513, 8192), (8193, 50000)]  # contiguous, up to the input length
    assert [x["shapes"]["input_ids"]["max"][0] for x in p["prefill"]] == [16, 1, 1]  # 8192 tokens a step
    k = p["decode"][0]["shapes"]["past.l.k"]
    assert k["min"] == [1, 2, 1, 32] and k["max"] == [64, 2, 51999, 32] and k["opt"] == [64, 2, 50000, 32]
    assert p["decode"][0]["shapes"]["past.l.ssm"]["max"] == [64, 8, 4]
    short = plan_profiles(pre, dec, max_batch=4, input_len=300, max_context=400)
    assert [x["name"] for x in short["prefill"]] == ["short"]  # bands beyond the prompt are dropped


# -- FP8 KV cache -------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_fp8_kv_cache_bundle_matches_torch_with_a_quantized_cache(tmp_path):
    """A scenario with an FP8 KV cache: K/V cross the graph boundary as FLOAT8E4M3FN (Q before present, DQ after
    past); onnxruntime's decode loop equals torch's with its cache quantized by the same scales; it builds."""
    from puzzlekit.ir.quant.formats import fake_quantize
    from puzzlekit.backends.onnx import OnnxModel

    prog = small_program()
    scenario = get_scenario("long-1m", input_len=64, output_len=64)
    assert scenario.kv_dtype == "fp8"
    rep = write_bundle(prog, tmp_path / "b", TARGETS["rtx-sm120"], scenario, build="auto")
    out = tmp_path / "b"
    assert rep.build["kv_cache_dtype"] == "float8e4m3fn"
    model = onnx.load(str(out / DECODE), load_external_data=False)
    kinds = {vi.name: vi.type.tensor_type.elem_type for vi in [*model.graph.input, *model.graph.output]}
    assert kinds["past.backbone.layers.2.k"] == kinds["present.backbone.layers.2.v"] == TensorProto.FLOAT8E4M3FN
    assert kinds["past.backbone.layers.0.ssm"] == TensorProto.FLOAT  # Mamba state stays as it was
    scales = {i.name[len("kv_cache."):-len(".scale")]: torch.from_numpy(onnx.numpy_helper.to_array(i).copy())
              for i in model.graph.initializer if i.name.startswith("kv_cache.") and i.name.endswith(".scale")}
    assert set(scales) == {"backbone.layers.2.k", "backbone.layers.2.v"}
    module, om = materialize(prog), OnnxModel(out)
    qdq = lambda state: tuple(fake_quantize(t, "fp8", scales[n]) if n in scales else t
                              for n, t in zip(module.state_names, state))
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, state = module.prefill(ids)
    got, ostate = om.prefill(ids.numpy())
    for step in range(4):
        tok = torch.randint(0, 256, (2,), generator=torch.Generator().manual_seed(20 + step))
        with torch.no_grad():
            want, state = module.decode(tok, qdq(state))
        got, ostate = om.decode(tok.numpy(), ostate)
        np.testing.assert_allclose(got["logits"], want[0].numpy(), atol=1e-4 * np.abs(want[0].numpy()).max())
    r = subprocess.run([sys.executable, "validate.py", "--runtime", "onnxruntime"], cwd=out, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    if HAVE_RTX:
        assert set(rep.engines) == {"prefill", "decode"}


# -- a bundle of the built-in model (fp32) ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fp32_bundle(default_bundle):
    """The built-in model's rtx-sm120 bundle (tests/conftest.py): (directory, report)."""
    return default_bundle[1], default_bundle[2]


def test_build_json_profiles_match_the_graphs(fp32_bundle):
    out, rep = fp32_bundle
    spec = json.loads((out / "build.json").read_text())
    assert spec == rep.build and spec["compute_capability"] == "sm_120" and spec["precision"] == "fp32"
    golden = np.load(out / "golden.npz")
    for e in spec["engines"]:
        graph = onnx.load(str(out / e["onnx"]), load_external_data=False).graph
        dims = {vi.name: [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in graph.input}
        assert e["profiles"]
        for prof in e["profiles"]:
            assert set(prof["shapes"]) == set(dims), (e["name"], prof["name"])
            for name, s in prof["shapes"].items():
                assert len(s["min"]) == len(s["opt"]) == len(s["max"]) == len(dims[name])
                for d, lo, opt, hi in zip(dims[name], s["min"], s["opt"], s["max"]):
                    assert 1 <= lo <= opt <= hi
                    if isinstance(d, int):  # static dimensions are fixed in every profile
                        assert lo == hi == d
        if e["name"] == "decode":
            k = next(n for n in dims if n.endswith(".k"))
            assert e["profiles"][0]["shapes"][k]["max"][2] == spec["max_context"] - 1
            assert e["profiles"][0]["shapes"]["input_ids"]["max"][0] == spec["memory_plan"]["engine_max_batch"]
    short = spec["engines"][0]["profiles"][0]["shapes"]["input_ids"]
    assert all(lo <= d <= hi for lo, d, hi in zip(short["min"], golden["prefill.input_ids"].shape, short["max"]))


def test_manifest_hashes_every_file(fp32_bundle):
    out, _ = fp32_bundle
    manifest = json.loads((out / "manifest.json").read_text())
    files = {p.name for p in out.iterdir() if p.is_file()} - {"manifest.json"}
    assert set(manifest["files"]) == files
    assert {"build.json", "build_engines.py", "trtexec.sh", "validate.py", "golden.npz", "README.md",
            "serve.sh", "trtllm-llm-api.yaml", PREFILL, DECODE} <= files
    for name, digest in manifest["files"].items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest


def test_validate_script_runs_the_golden_loop_and_catches_a_mismatch(fp32_bundle, tmp_path):
    out, _ = fp32_bundle
    r = subprocess.run([sys.executable, "validate.py", "--runtime", "onnxruntime"], cwd=out, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    assert "decode 5" in r.stdout and "agree" in r.stdout
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    g = dict(np.load(bad / "golden.npz"))
    g["decode.3.logits"] = g["decode.3.logits"] + 0.05 * np.abs(g["decode.3.logits"]).max()
    np.savez(bad / "golden.npz", **g)
    r = subprocess.run([sys.executable, "validate.py", "--runtime", "onnxruntime"], cwd=bad, capture_output=True,
                       text=True)
    assert r.returncode == 1 and "decode 3 logits" in r.stderr


def test_validate_script_off_its_gpu_says_what_to_do_in_one_line(fp32_bundle):
    """This machine has no CUDA GPU: the engines cannot run here, and the script says so (no traceback)."""
    out, _ = fp32_bundle
    r = subprocess.run([sys.executable, "validate.py"], cwd=out, capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "no CUDA GPU here" in r.stderr and "--runtime onnxruntime" in r.stderr and "sm_120" in r.stderr


def test_the_bundle_readme_says_whether_the_engines_are_built(fp32_bundle):
    out, rep = fp32_bundle
    text = (out / "README.md").read_text()
    if rep.engines:  # built here (TensorRT-RTX installed): nothing left to build
        assert "were built when this bundle was written" in text and "nothing to build" in text
    else:
        assert "python build_engines.py" in text and "were built" not in text


def test_build_script_refuses_another_gpu(fp32_bundle):
    out, _ = fp32_bundle
    spec = importlib.util.spec_from_file_location("bundle_build_engines", out / "build_engines.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with pytest.raises(SystemExit):
        mod.check_gpu("sm_100", "sm_90")
    with pytest.raises(SystemExit):
        mod.check_gpu("sm_100", None)
    mod.check_gpu("sm_100", "sm_100")
    text = (out / "trtexec.sh").read_text()
    assert text.count("--minShapes=") == sum(len(e["profiles"]) for e in json.loads((out / "build.json").read_text())
                                             ["engines"])
    assert "--stronglyTyped" in text and "--saveEngine=prefill.engine" in text


@needs_rtx
def test_fp32_engines_are_built_for_sm120(fp32_bundle):
    out, rep = fp32_bundle
    for name in ("prefill", "decode"):
        blob = (out / f"{name}.engine").read_bytes()
        assert len(blob) > 1e6 and rep.engines[name]["bytes"] == len(blob)
    record = json.loads((out / "engines.json").read_text())
    assert record["builder"] == "tensorrt-rtx" and record["compute_capability"] == "sm_120"
    assert (out / "timing.cache").exists()


# -- quantized engines (each exports and builds the built-in model: slow) ------------------------------------------
@needs_rtx
@pytest.mark.slow
@pytest.mark.parametrize("recipe,target", [("fp8", "rtx-sm120"), ("nvfp4-weight", "rtx-sm120"),
                                           ("nvfp4", "rtx-sm120"), ("fp8", "rtx-sm89")])
def test_quantized_engines_build(recipe, target, tmp_path):
    prog = load_default()
    PassManager(f"quantize{{recipe={recipe},samples=2,seq=64}}").run(prog)
    rep = write_bundle(prog, tmp_path / "b", TARGETS[target], get_scenario("chat"), build="yes")
    assert rep.precision == recipe and set(rep.engines) == {"prefill", "decode"}
    assert all((tmp_path / "b" / f"{n}.engine").stat().st_size > 1e5 for n in rep.engines)
    if recipe == "nvfp4":
        names = {n.op_type for n in onnx.load(str(tmp_path / "b" / PREFILL), load_external_data=False).graph.node}
        assert "TRT_FP4DynamicQuantize" in names


@pytest.mark.slow  # two exports of the built-in model (W4A4 and W8A8)
def test_cli_bundles_for_b200_and_h100_differ_where_the_hardware_does(tmp_path, capsys):
    for t in ("b200", "h100"):
        assert main(["build-engine", "--target", t, "--scenario", "long-1m", "-o", str(tmp_path / t),
                     "--calib-samples", "2", "--build", "no", "--json"]) == 0
        rep = json.loads(capsys.readouterr().out)
        assert rep["engines"] == {} and "manifest.json" in rep["files"]
    b, h = [json.loads((tmp_path / t / "build.json").read_text()) for t in ("b200", "h100")]
    assert (b["precision"], h["precision"]) == ("nvfp4", "fp8")
    assert (b["compute_capability"], h["compute_capability"]) == ("sm_100", "sm_90")
    assert (b["min_version"]["tensorrt"], h["min_version"]["tensorrt"]) == ("10.8", "10.0")
    assert b["memory_plan"]["max_concurrency"] > h["memory_plan"]["max_concurrency"]  # 180 GB against 80 GB
    assert b["kv_cache_dtype"] == h["kv_cache_dtype"] == "float8e4m3fn"  # long-1m plans an FP8 cache
    assert [p["name"] for p in b["engines"][0]["profiles"]] == ["short", "medium", "long"]
    assert b["engines"][0]["profiles"][-1]["shapes"]["input_ids"]["max"][1] == 1048576
    for t in ("b200", "h100"):
        r = subprocess.run([sys.executable, "validate.py", "--runtime", "onnxruntime"], cwd=tmp_path / t,
                           capture_output=True, text=True)
        assert r.returncode == (0 if t == "h100" else 2), r.stderr  # onnxruntime cannot run the FP4 graphs
        assert t == "h100" or "cannot run nvfp4" in r.stderr
