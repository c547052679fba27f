"""ONNX lowering: onnxruntime against torch, greedy generation, checker, TensorRT lint, quantized patterns."""
import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from puzzlekit import ir
from puzzlekit.backends.onnx import DECODE, PREFILL, ExportError, OnnxModel, export_onnx, lint
from puzzlekit.backends.targets import TARGETS
from puzzlekit.backends.torch import materialize, random_weights
from puzzlekit.ir.ops import MLP, MTP, Attention, Embed, Linear, LMHead, Mamba2, MoE, Noop, Norm
from puzzlekit.passes import PassManager
from puzzlekit.tools.default_model import load_default


def every_kind_program():
    h = 32
    blocks = [Mamba2(h, 4, 8, 8, 2, chunk=4), MoE(h, 4, 2, 16, 16, latent=16, scaling=2.0), Attention(h, 4, 2, 8),
              MLP(h, 48), Noop(h), Linear(h), MoE(h, 4, 1, 16, 0)]
    mtp = MTP(h, (Attention(h, 4, 2, 8), MoE(h, 4, 2, 16, 16)))
    prog = ir.assemble(Embed(64, h), blocks, Norm(h), LMHead(64, h), mtp, meta={"dtype": "float32"})
    return random_weights(prog, seed=2, std=0.2)


def repeated_program():
    """The kinds of layer the built-in model lacks, twice (the export traces one of each and copies it): a MoE
    without a latent projection, a noop, a linear replacement; a tied LM head beside an MTP head. The built-in
    model's graphs (the `default` case) stitch copies of its Mamba-2, latent MoE and attention layers and hold
    its MLP and MTP head; tracing them again here would only add time."""
    h = 32
    blocks = [MoE(h, 4, 2, 16, 16), Noop(h), Linear(h)] * 2
    mtp = MTP(h, (Attention(h, 4, 2, 8),))
    prog = ir.assemble(Embed(64, h), blocks, Norm(h), LMHead(64, h, tied=True), mtp, meta={"dtype": "float32"})
    return random_weights(prog, seed=3, std=0.2)


#: every-kind (each kind once, Mamba-2 included) under slow: the built-in model's graphs (Mamba-2, latent MoE,
#: attention, MLP, an MTP head) are those of its bundle (tests/conftest.py: one export for the ONNX and TensorRT
#: tests), and repeated adds the kinds and the tied head they lack
@pytest.fixture(scope="module", params=["default", pytest.param("every-kind", marks=pytest.mark.slow), "repeated"])
def exported(request, tmp_path_factory):
    if request.param == "default":
        return request.getfixturevalue("default_bundle")[:3]
    prog = {"every-kind": every_kind_program, "repeated": repeated_program}[request.param]()
    out = tmp_path_factory.mktemp("onnx") / request.param
    report = export_onnx(prog, out, target="cpu")
    return prog, out, report


def test_export_layout_and_checker(exported):
    prog, out, report = exported
    assert {PREFILL, DECODE, PREFILL + ".data", DECODE + ".data"} <= set(report.files)
    for name in (PREFILL, DECODE):
        onnx.checker.check_model(str(out / name), full_check=True)
        m = onnx.load(str(out / name), load_external_data=False)
        meta = {p.key: p.value for p in m.metadata_props}
        assert meta["puzzlekit.program"] == ir.print_program(prog)
        assert all(i.data_location == TensorProto.EXTERNAL for i in m.graph.initializer if i.name.endswith(".weight")
                   and np.prod(i.dims) * 4 > 1024)
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
            for i in onnx.load(str(out / DECODE), load_external_data=False).graph.input}
    assert dims["input_ids"] == ["batch", 1]
    k = next(n for n in dims if n.endswith(".k"))
    assert dims[k][0] == "batch" and dims[k][2] == "past_sequence"


def test_prefill_and_32_decode_steps_match_torch(exported):
    prog, out, _ = exported
    vocab = prog.find("embed")[0].op.vocab
    m, om = materialize(prog), OnnxModel(out)
    ids = torch.randint(0, vocab, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, state = m.prefill(ids)
    got, ostate = om.prefill(ids.numpy())
    for name, w in zip(prog.outputs, want):
        np.testing.assert_allclose(got[name], w.numpy(), atol=1e-4, rtol=1e-4)
    steps = torch.randint(0, vocab, (32, 2), generator=torch.Generator().manual_seed(1))
    for tok in steps:
        with torch.no_grad():
            want, state = m.decode(tok, state)
        got, ostate = om.decode(tok.numpy(), ostate)
        for name, w in zip(prog.outputs, want):
            np.testing.assert_allclose(got[name], w.numpy(), atol=1e-4, rtol=1e-4)


def test_greedy_generation_is_identical(exported):
    prog, out, _ = exported
    vocab = prog.find("embed")[0].op.vocab
    prompt = torch.randint(0, vocab, (2, 6), generator=torch.Generator().manual_seed(3))
    m = materialize(prog)
    seq = prompt
    with torch.no_grad():
        (logits, *_), state = m.prefill(seq)
        for _ in range(64):
            nxt = logits[:, -1].argmax(-1)
            seq = torch.cat([seq, nxt[:, None]], dim=1)
            (logits, *_), state = m.decode(nxt, state)
    got = OnnxModel(out).generate(prompt.numpy(), 64)
    assert np.array_equal(got, seq.numpy())


# -- the TensorRT lint -----------------------------------------------------------------------------------------------
def _model(nodes, inputs, outputs, opset=23, inits=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _vi(name, ty=TensorProto.FLOAT, shape=(2, 2)):
    return helper.make_tensor_value_info(name, ty, list(shape))


def test_lint_reports_precise_findings():
    h100, b200 = TARGETS["h100"], TARGETS["b200"]
    ok = _model([helper.make_node("Relu", ["x"], ["y"], name="r")], [_vi("x")], [_vi("y")])
    assert [f for f in lint(ok, h100) if f.severity == "error"] == []
    old = _model([helper.make_node("Relu", ["x"], ["y"])], [_vi("x")], [_vi("y")], opset=8)
    assert any(f.op == "opset" and "outside TensorRT" in f.reason for f in lint(old, h100))
    custom = _model([helper.make_node("Foo", ["x"], ["y"], name="foo", domain="my.ops")], [_vi("x")], [_vi("y")])
    f = lint(custom, h100)[0]
    assert (f.severity, f.node, f.op) == ("error", "foo", "Foo") and "plugin" in f.reason
    zp = helper.make_tensor("zp", TensorProto.INT8, [], [3])
    q = _model([helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["y"], name="q")],
               [_vi("x"), _vi("s", shape=())], [_vi("y", TensorProto.INT8)], inits=[zp])
    assert any(f.node == "q" and "zero point" in f.reason for f in lint(q, h100))
    fp4 = _model([helper.make_node("DequantizeLinear", ["w", "s"], ["y"], name="dq4", axis=-1, block_size=16)],
                 [_vi("w", TensorProto.FLOAT4E2M1, (2, 16)), _vi("s", shape=(2, 1))], [_vi("y", shape=(2, 16))])
    assert any(f.node == "dq4" and "Blackwell" in f.reason and f.severity == "error" for f in lint(fp4, h100))
    assert not [f for f in lint(fp4, b200) if f.severity == "error"]
    dbl = _model([helper.make_node("Relu", ["x"], ["y"], name="d")], [_vi("x", TensorProto.UINT64)],
                 [_vi("y", TensorProto.UINT64)])
    assert any("UINT64" in f.reason for f in lint(dbl, b200))


# -- quantized lowering ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small():
    h = 32
    blocks = [Mamba2(h, 4, 8, 8, 2, chunk=4), MoE(h, 4, 2, 16, 16), Attention(h, 4, 2, 8), MLP(h, 32)]
    return random_weights(ir.assemble(Embed(256, h), blocks, Norm(h), LMHead(256, h), meta={"dtype": "float32"}),
                          seed=5, std=0.2)


def test_fp8_export_runs_in_ort_and_matches_fake_quant(small, tmp_path):
    prog = small.copy()
    PassManager("quantize{recipe=fp8,samples=2,seq=32}").run(prog)
    export_onnx(prog, tmp_path / "fp8", target="h100")
    m = onnx.load(str(tmp_path / "fp8" / PREFILL), load_external_data=False)
    dq = [n for n in m.graph.node if n.op_type == "DequantizeLinear"]
    fp8 = {i.name for i in m.graph.initializer if i.data_type == TensorProto.FLOAT8E4M3FN}
    weights = [n for n in dq if n.input[0] in fp8 and n.input[0].endswith(".q")]
    quant = [n for n in m.graph.node if n.op_type == "QuantizeLinear"]
    # weights: Mamba in/out 2, the routed experts' two stacks (one initializer and one DequantizeLinear for all
    # of a layer's experts, a scale per expert along axis 0), shared expert 2, attention q/k/v/o 4, MLP 2;
    # activations: one QuantizeLinear per distinct linear input: Mamba 2, routed experts 2 (their shared input,
    # and their hidden rows, one scale for all), shared expert 2, attention 2 (q, k and v read the same input
    # with the same scale, so they share one), MLP 2
    assert len(weights) == 12 and len(quant) == 10
    stacked = next(n for n in dq if n.output[0] == "m.backbone.layers.1.mixer.experts.up_proj")
    assert {a.name: a.i for a in stacked.attribute} == {"axis": 0}
    assert not [n for n in m.graph.node if n.op_type == "Cast" and n.attribute[0].i == TensorProto.FLOAT8E4M3FN]
    assert all(str(f.reason).find("zero point") < 0 for f in lint(m, TARGETS["h100"]))
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        want = materialize(prog)(ids)
    got, _ = OnnxModel(tmp_path / "fp8").prefill(ids.numpy())
    np.testing.assert_allclose(got["logits"], want.numpy(), atol=2e-3, rtol=2e-3)


@pytest.mark.slow  # heavy: runs with pytest -m slow
def test_nvfp4_export_is_exact_under_the_reference_evaluator(small, tmp_path):
    prog = small.copy()
    PassManager("quantize{recipe=nvfp4-weight,samples=2,seq=32}").run(prog)
    with pytest.raises(ExportError, match="Blackwell"):
        export_onnx(prog, tmp_path / "h100", target="h100")
    export_onnx(prog, tmp_path / "b200", target="b200")
    m = onnx.load(str(tmp_path / "b200" / PREFILL))
    w = "m.backbone.layers.1.mixer.experts.up_proj"  # the layer's 4 experts, stacked
    chain = [n for n in m.graph.node if n.output[0] in (w, w + ".scale")]
    assert [n.op_type for n in chain] == ["DequantizeLinear", "DequantizeLinear"]
    assert next(i for i in m.graph.initializer if i.name == w + ".q").data_type == TensorProto.FLOAT4E2M1
    # evaluate just the dequantisation chain and compare with our dequantised weight
    inits = [i for i in m.graph.initializer if i.name.startswith(w + ".")]
    sub = helper.make_model(helper.make_graph(chain[::-1] if chain[0].output[0] == w else chain, "dq", [],
                                              [_vi(w, shape=(4, 16, 32))], inits),
                            opset_imports=[helper.make_opsetid("", 23)])
    got = ReferenceEvaluator(sub).run(None, {})[0]
    want = torch.stack([prog.weights.get(f"backbone.layers.1.mixer.experts.{j}.up_proj.weight").dequantize(
        torch.float32) for j in range(4)])
    assert np.array_equal(got, want.numpy())
    # and the whole prefill graph, FP4 initializers included, against the fake-quantized torch model
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(4))
    logits = ReferenceEvaluator(m).run(["logits"], {"input_ids": ids.numpy()})[0]
    with torch.no_grad():
        np.testing.assert_allclose(logits, materialize(prog)(ids).numpy(), atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def exported_twice(tmp_path_factory):
    """A program without decode state (a linear layer, a tied head) exported twice in this process, torch.onnx's
    reads of onnxscript's torchlib counted: (program, folder of the exports a and b, the reads, the registries
    kept, the name of the registry reader seen after the exports)."""
    import puzzlekit.backends.onnx.export as export
    from torch.onnx._internal.exporter._registration import ONNXRegistry

    prog = random_weights(ir.assemble(Embed(256, 32), [Linear(32)], Norm(32), LMHead(256, 32, tied=True),
                                      meta={"dtype": "float32"}), seed=1, std=0.3)
    out, real, reads = tmp_path_factory.mktemp("twice"), ONNXRegistry.__dict__["from_torchlib"], []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(export, "_REGISTRIES", {})
        mp.setattr(ONNXRegistry, "from_torchlib",
                   classmethod(lambda cls, **kw: reads.append(kw) or real.__func__(cls, **kw)))
        for name in ("a", "b"):
            export_onnx(prog, out / name)
        return prog, out, reads, dict(export._REGISTRIES), ONNXRegistry.__dict__["from_torchlib"].__func__.__name__


def test_program_without_decode_state_exports(exported_twice):
    prog, out, *_ = exported_twice
    ids = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(5))
    got = OnnxModel(out / "a").generate(ids.numpy(), 4)
    m = materialize(prog)
    seq = ids
    with torch.no_grad():
        for _ in range(4):
            seq = torch.cat([seq, m(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert np.array_equal(got, seq.numpy())


def test_torchlib_is_read_once_a_process_and_each_export_registers_its_ops_in_a_copy(exported_twice):
    """torch.onnx reads onnxscript's torchlib on every export; two exports read it once, write the same graphs,
    and leave the registry read free of the ops an export registers (the NVFP4 quantizer)."""
    _, out, reads, registries, reader = exported_twice
    assert len(reads) == 1 and len(registries) == 1
    assert reader == "<lambda>"  # put back after each export
    read = next(iter(registries.values()))
    assert read.functions and not any(m.is_custom for v in read.functions.values() for m in v)
    for name in (PREFILL, DECODE, PREFILL + ".data", DECODE + ".data"):
        assert (out / "a" / name).read_bytes() == (out / "b" / name).read_bytes(), name


def test_generate_with_onnx_refuses_an_fp4_model_before_exporting(tmp_path, capsys):
    from puzzlekit.tools.cli import main

    prog = load_default()
    PassManager("quantize{recipe=nvfp4,samples=1,seq=16}").run(prog)
    ir.save(prog, tmp_path / "fp4", extended=True)
    assert main(["generate", str(tmp_path / "fp4"), "--prompt", "x", "--backend", "onnx"]) == 2
    err = capsys.readouterr().err
    assert "onnxruntime has no FP4 kernels" in err and "--backend torch" in err


@pytest.mark.slow  # two full exports: about two minutes on 2 cores
def test_cli_export_and_generate(tmp_path, capsys, monkeypatch):
    import json

    from puzzlekit.tools.cli import main

    monkeypatch.setenv("PUZZLEKIT_CACHE", str(tmp_path / "cache"))
    assert main(["export-onnx", "-o", str(tmp_path / "o"), "--target", "h100", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert PREFILL in rep["files"] and not [f for f in rep["findings"] if f["severity"] == "error"]
    assert main(["export-onnx", "-o", str(tmp_path / "o")]) == 2  # exists, no --overwrite
    assert "overwrite" in capsys.readouterr().err
    outs = {}
    for backend in ("torch", "onnx"):
        assert main(["generate", "--prompt", "def ", "--max-new-tokens", "24", "--backend", backend, "--json"]) == 0
        outs[backend] = json.loads(capsys.readouterr().out)
    assert outs["torch"]["tokens"] == outs["onnx"]["tokens"] and len(outs["torch"]["tokens"]) == 4 + 24
    cached = list((tmp_path / "cache" / "onnx").glob("*/prefill.onnx"))
    assert len(cached) == 1
    stamp = cached[0].stat().st_mtime_ns
    assert main(["generate", "--prompt", "def ", "--max-new-tokens", "4", "--backend", "onnx"]) == 0
    assert cached[0].stat().st_mtime_ns == stamp  # the second call reuses the export


# -- the export's work grows linearly with layers and experts (issue: 65 s for the built-in model; 88 layers of
#    512 experts would have taken hours) ----------------------------------------------------------------------
def _slices_model(k: int) -> onnx.ModelProto:
    """k Slices of one input, summed: the shape that made onnxscript's Slices-to-Split pattern quadratic."""
    inits = [helper.make_tensor("axes", TensorProto.INT64, [1], [1])]
    nodes = []
    for i in range(k):
        inits += [helper.make_tensor(f"s{i}", TensorProto.INT64, [1], [i]),
                  helper.make_tensor(f"e{i}", TensorProto.INT64, [1], [i + 1])]
        nodes.append(helper.make_node("Slice", ["x", f"s{i}", f"e{i}", "axes"], [f"y{i}"]))
    nodes += [helper.make_node("Add", [f"a{i - 1}" if i > 1 else "y0", f"y{i}"], [f"a{i}"]) for i in range(1, k)]
    return _model(nodes, [_vi("x", shape=("n", k))], [_vi(f"a{k - 1}", shape=("n", 1))], inits=inits)


def test_the_export_optimizer_work_grows_linearly_with_the_graph(monkeypatch):
    """The default rule set's multi-output pattern listed the whole graph again for every Slice: node visits
    grew with the square of the graph (x3.8 for twice the Slices)."""
    ll = pytest.importorskip("onnx_ir._linked_list")
    from puzzlekit.backends.onnx.export import _optimize

    visits = [0]
    every = ll.DoublyLinkedSet.__iter__

    def counted(self):
        for x in every(self):
            visits[0] += 1
            yield x
    monkeypatch.setattr(ll.DoublyLinkedSet, "__iter__", counted)
    seen = []
    for k in (50, 100):
        visits[0] = 0
        _optimize(_slices_model(k))
        seen.append(visits[0])
    assert seen[1] < 2.5 * seen[0], seen


def _chained_rewrites_model(adds: int) -> onnx.ModelProto:
    """Max then Min (made a Clip, then fused with the next Clip in the same pass), Casts, Transposes and Reshapes
    that fold, and `adds` Adds no rule matches."""
    c = lambda name, v, ty=TensorProto.FLOAT, dims=(): helper.make_tensor(name, ty, list(dims), v)
    inits = [c("lo", [-1.0]), c("hi", [2.0]), c("lo2", [0.0]), c("hi2", [1.5]),
             c("shape1", [4, 1], TensorProto.INT64, [2]), c("shape2", [2, 2], TensorProto.INT64, [2])]
    nodes = [helper.make_node("Max", ["x", "lo"], ["m1"]), helper.make_node("Min", ["m1", "hi"], ["m2"]),
             helper.make_node("Clip", ["m2", "lo2", "hi2"], ["m3"]),
             helper.make_node("Cast", ["m3"], ["m4"], to=TensorProto.DOUBLE),
             helper.make_node("Cast", ["m4"], ["m5"], to=TensorProto.FLOAT),
             helper.make_node("Transpose", ["m5"], ["m6"], perm=[1, 0]),
             helper.make_node("Transpose", ["m6"], ["m7"], perm=[1, 0]),
             helper.make_node("Reshape", ["m7", "shape1"], ["m8"]), helper.make_node("Reshape", ["m8", "shape2"], ["a0"])]
    nodes += [helper.make_node("Add", [f"a{i}", "x"], [f"a{i + 1}"]) for i in range(adds)]
    return _model(nodes, [_vi("x")], [_vi(f"a{adds}")], inits=inits)


def test_the_export_optimizer_tries_each_rule_on_its_own_op_and_rewrites_as_onnxscript_does(monkeypatch):
    """Rules tried only on nodes of their pattern's root op: the same graph, byte for byte, as onnxscript's own
    optimizer (its rewrites chained within one pass included), with far fewer matcher calls than nodes x rules."""
    from onnxscript import optimizer, rewriter
    from onnxscript.rewriter import _rewrite_rule

    from puzzlekit.backends.onnx.export import _optimize

    model = _chained_rewrites_model(adds=200)
    theirs = optimizer.optimize(model, input_size_limit=1)
    calls, match = [0], _rewrite_rule.RewriteRule.match
    monkeypatch.setattr(_rewrite_rule.RewriteRule, "match", lambda *a, **k: calls.__setitem__(0, calls[0] + 1)
                        or match(*a, **k))
    ours = _optimize(model)
    assert ours.SerializeToString() == theirs.SerializeToString()
    assert [n.op_type for n in ours.graph.node if n.op_type != "Add"] == ["Clip", "Cast", "Cast"]  # rewritten
    tries = len(model.graph.node) * len(rewriter._DEFAULT_REWRITE_RULES)  # every rule on every node: ~18,700
    assert 0 < calls[0] < tries / 5, (calls, tries)  # (the no-op rules rooted at Add still try each Add)


def test_each_distinct_layer_is_traced_once_and_the_graph_stitched_from_copies(default_bundle):
    """Layers with the same spec make the same graph: the default model's 12 layers (5 Mamba, 5 MoE, 2 attention,
    1 MLP of 4 specs) are traced as 4, besides the embedding, norm, head and MTP head; each copy keeps its own
    weights under the names a whole-program export gives them, and the graphs compute what torch does."""
    prog, _, _, traced, stitched = default_bundle
    assert [len(m.reps) for m in traced] == [8, 8], [type(m).__name__ for m in traced]
    weights = materialize(prog).state_dict()
    for model in stitched:
        inits = {i.name: i for i in model.graph.initializer if i.name.startswith("m.")}
        assert set(inits) == {f"m.{k}" for k in weights}
        for k in ("backbone.layers.2.mixer.in_proj.weight", "backbone.layers.11.mixer.experts.down_proj"):
            assert np.array_equal(onnx.numpy_helper.to_array(inits[f"m.{k}"]), weights[k].numpy())
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
            for i in stitched[1].graph.output}
    assert dims["present.backbone.layers.10.k"] == ["batch", 2, "past_sequence + 1", 32]


@pytest.mark.slow  # 15 s; tracing each distinct layer once stays in the default suite
def test_weight_quantized_layers_traced_once_are_lowered_with_their_own_weights(tmp_path):
    """The stitched graph names each layer's weights as the whole-program export does, so the quantized lowering
    finds every layer's own FP4 values and scales."""
    prog = load_default()
    PassManager("quantize{recipe=nvfp4-weight,samples=1,seq=16}").run(prog)
    export_onnx(prog, tmp_path / "b200", target="b200")
    inits = {i.name: i for i in onnx.load(str(tmp_path / "b200" / PREFILL)).graph.initializer}
    for layer in (0, 2, 5, 7, 9):
        q = prog.weights.get(f"backbone.layers.{layer}.mixer.in_proj.weight")
        assert inits[f"m.backbone.layers.{layer}.mixer.in_proj.weight.q"].raw_data == q.data.numpy().tobytes()


@pytest.mark.slow  # 24 s; the FP8 export against onnxruntime stays in the default suite
def test_fp8_layers_traced_once_quantize_their_inputs_by_their_own_scales(tmp_path, monkeypatch):
    """Static activation scales are each module's own tensor, so an FP8 W8A8 program is traced once per distinct
    layer too; every layer's QuantizeLinear reads its own calibrated scale, and onnxruntime computes what torch
    does."""
    import puzzlekit.backends.onnx.export as export

    traced = []
    real_export = export._export
    monkeypatch.setattr(export, "_export", lambda module, *a: traced.append(module) or real_export(module, *a))
    prog = load_default()
    PassManager("quantize{recipe=fp8,samples=1,seq=16}").run(prog)
    export_onnx(prog, tmp_path / "h100", target="h100")
    assert [len(m.reps) for m in traced] == [8, 8]
    m = onnx.load(str(tmp_path / "h100" / PREFILL))
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in m.graph.initializer}
    scales = {n.input[1] for n in m.graph.node if n.op_type == "QuantizeLinear"}
    mamba = [f"backbone.layers.{layer}.mixer.in_proj.input_scale" for layer in (0, 2, 5, 7, 9)]
    assert len({prog.weights.get(k).item() for k in mamba}) == 5  # five scales, each layer's own
    for k in mamba:
        assert f"m.{k}" in scales and inits[f"m.{k}"] == prog.weights.get(k).item()
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = materialize(prog)(ids)[0]
    got, _ = OnnxModel(tmp_path / "h100").prefill(ids.numpy())
    np.testing.assert_allclose(got["logits"], want.numpy(), atol=2e-3, rtol=2e-3)


def test_the_exported_graph_does_not_grow_with_the_routed_experts():
    """Prefill runs every expert in two batched MatMuls over the stacked weights and mixes them in one product:
    the same graph for 4 experts as for 512 (a graph of nodes per expert took minutes and 13 GB to export at
    88 layers of 512 experts)."""
    from puzzlekit.ir.ops.base import use_export_form

    def nodes(experts: int) -> int:
        block = torch.export.export(use_export_form(MoE(16, experts, 2, 8, 8, latent=8).build()),
                                    (torch.randn(2, 3, 16),), strict=False,
                                    dynamic_shapes=({0: torch.export.Dim.DYNAMIC, 1: torch.export.Dim.DYNAMIC},))
        return sum(n.op == "call_function" for n in block.graph.nodes)

    assert nodes(512) == nodes(4)
