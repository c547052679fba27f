"""Lowering: a Program becomes two ONNX graphs with explicit decode state, validated before they are kept.

prefill.onnx: input_ids [batch, sequence] -> logits, (mtp_logits), present.<state>...
decode.onnx:  input_ids [batch, 1], past.<state>... -> logits, (mtp_logits), present.<state>...
States (ProgramModule.state_names): conv and SSM state per Mamba block, K and V per attention block
([batch, kv_heads, past_sequence, head_dim]), the MTP head's own. Weights are external data; the
program text, state names and provenance are in the model metadata.
"""
from __future__ import annotations

import copy
import json
import logging
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import torch
from torch import nn

from ...errors import PuzzlekitError
from ...ir import Program, print_program
from ...outputs import check_output, staged_dir
from ..torch import ProgramModule, materialize
from ..torch.fake_tensors import uncached_fake_tensors
from . import pieces

PREFILL, DECODE = "prefill.onnx", "decode.onnx"


class ExportError(PuzzlekitError):
    """An export failed, or produced a graph that the target cannot build."""


class _Prefill(nn.Module):
    def __init__(self, m: ProgramModule):
        super().__init__()
        self.m = m

    def forward(self, input_ids):
        outs, state = self.m.prefill(input_ids)
        return (*outs, *state)


class _Decode(nn.Module):
    def __init__(self, m: ProgramModule):
        super().__init__()
        self.m = m

    def forward(self, input_ids, *past):
        outs, state = self.m.decode(input_ids, past)
        return (*outs, *state)


@dataclass
class ExportReport:
    directory: Path
    files: list[str]
    findings: list = field(default_factory=list)

    def to_json(self) -> dict:
        return {"directory": str(self.directory), "files": self.files,
                "findings": [f.to_json() for f in self.findings]}


def _is_kv(name: str) -> bool:
    return name.endswith((".k", ".v"))


def _name_dims(model: onnx.ModelProto, names: dict[tuple[str, int], str]) -> None:
    """Gives the dynamic dimensions meaningful names (batch, sequence, past_sequence) everywhere."""
    rename = {}
    for vi in model.graph.input:
        for axis, d in enumerate(vi.type.tensor_type.shape.dim):
            new = names.get((vi.name, axis))
            if new and d.dim_param:
                rename[d.dim_param] = new
    for vi in [*model.graph.input, *model.graph.output, *model.graph.value_info]:
        for d in vi.type.tensor_type.shape.dim:
            if d.dim_param in rename:
                d.dim_param = rename[d.dim_param]


@contextmanager
def _quiet():
    """Silences the exporter's warnings, among them one line per torchvision op when torchvision (an optional
    package this export never needs) is absent."""
    log = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        log.setLevel(level)


def _export(module: nn.Module, args: tuple, input_names, output_names, dynamic, opset: int) -> onnx.ModelProto:
    from ...ir.quant.formats import nvfp4_activations_as
    from .trt_ops import nvfp4_qdq_op, onnxscript_lowering, type_outputs

    qdq = nvfp4_qdq_op()
    with _quiet(), nvfp4_activations_as(qdq), uncached_fake_tensors(), _torchlib_read_once():
        try:
            program = torch.onnx.export(module, args, input_names=input_names, output_names=output_names,
                                        dynamic_shapes=dynamic, dynamo=True, opset_version=opset, verbose=False,
                                        optimize=False,  # keeps parameter names (quantized lowering finds them)
                                        custom_translation_table={qdq: onnxscript_lowering()})
        except Exception as e:  # the exporter raises many types; say which graph failed
            raise ExportError(f"torch.onnx.export failed: {type(e).__name__}: {str(e).splitlines()[0]}") from e
    model = program.model_proto
    type_outputs(model)
    return model


#: (registry class, opset, options) -> torch.onnx's op registry as read from onnxscript's torchlib (see
#: _torchlib_read_once)
_REGISTRIES: dict = {}


@contextmanager
def _torchlib_read_once():
    """torch.onnx reads onnxscript's torchlib into a fresh op registry on every export (~0.4 s; two an export, two
    more a bundle); it reads the same each time. Read it once per opset and process, and give each export a copy of
    its own (an export registers its custom ops, such as the NVFP4 quantizer, in its copy)."""
    try:
        from torch.onnx._internal.exporter._registration import ONNXRegistry
    except ImportError:  # another exporter layout: read each time
        yield
        return
    real = ONNXRegistry.__dict__.get("from_torchlib")
    if not isinstance(real, classmethod):
        yield
        return

    def from_torchlib(cls, opset_version=None, **kwargs):
        key = (cls, opset_version, tuple(sorted(kwargs.items())))
        if key not in _REGISTRIES:
            args = {} if opset_version is None else {"opset_version": opset_version}
            _REGISTRIES[key] = real.__func__(cls, **args, **kwargs)
        read = _REGISTRIES[key]
        copy = cls.__new__(cls)
        copy.__dict__.update(read.__dict__)
        copy.functions = {k: list(v) for k, v in read.functions.items()}
        return copy

    ONNXRegistry.from_torchlib = classmethod(from_torchlib)
    try:
        yield
    finally:
        ONNXRegistry.from_torchlib = real


@contextmanager
def _linear_rewrites():
    """onnxscript's default rewrite rules less those whose pattern has several output nodes (SlicesSplit: Slices
    of one input into a Split), and each tried only on nodes of its pattern's root op. The multi-output matcher
    lists the whole graph again for every candidate node, so its time grows with the square of the graph: most of
    the optimizer's time on the built-in model (whose graphs come out identical without it), and hours for 88
    layers of hundreds of experts. The others fail on any other op, but only after ~25 us of setup, for each of
    ~45 rules on each node: 330,000 tries on the built-in model."""
    from onnxscript import rewriter

    rules = getattr(rewriter, "_DEFAULT_REWRITE_RULES", None)
    if rules is None:
        yield
        return
    rewriter._DEFAULT_REWRITE_RULES = tuple(_rooted(r) for r in rules if getattr(
        getattr(r, "_target_pattern", None), "has_single_output_node", True))
    try:
        yield
    finally:
        rewriter._DEFAULT_REWRITE_RULES = rules


def _rooted(rule):
    """A copy of a one-output-node rule that returns at once from a node of another op type than its pattern's
    root (the matcher's first check, so nothing it would rewrite is skipped); a rule whose root op is not one
    name is kept as it is."""
    try:
        op = rule._target_pattern.output_node.op_identifier()[1]
    except (AttributeError, TypeError, ValueError):  # another onnxscript layout, a root of several ops
        return rule
    tried = rule.try_rewrite
    rooted = copy.copy(rule)
    rooted.try_rewrite = lambda model, graph, node, **kw: tried(model, graph, node, **kw) \
        if node.op_type == op else None
    return rooted


def _optimize(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnxscript's optimizer (constant folding, Split instead of sequences), after the quantized lowering
    so that weights keep their names until then; large constants such as dequantized weights stay unfolded."""
    import onnxscript.optimizer

    with _linear_rewrites():
        return onnxscript.optimizer.optimize(model, input_size_limit=1)  # fold shape arithmetic, never weights


def _save(model: onnx.ModelProto, path: Path, threshold: int = 1024) -> None:
    """Writes `path` with initializers of `threshold` bytes or more in `path.data` (small constants such as
    axes and shapes stay inline, where shape inference reads them)."""
    data = path.with_name(path.name + ".data")
    with open(data, "wb") as f:
        for t in model.graph.initializer:
            if t.HasField("raw_data") and len(t.raw_data) >= threshold:
                offset = f.tell()
                f.write(t.raw_data)
                t.ClearField("raw_data")
                t.data_location = onnx.TensorProto.EXTERNAL
                del t.external_data[:]
                for k, v in (("location", data.name), ("offset", str(offset)), ("length", str(f.tell() - offset))):
                    t.external_data.add(key=k, value=v)
    onnx.save_model(model, str(path))


def _by_pieces(prog: Program, module: ProgramModule, ids, opset: int) -> dict | None:
    """Both graphs with each distinct layer traced once (see pieces.py), or None where they cannot be
    stitched (the program is then traced whole)."""
    from torch.fx.experimental import _config as shapes

    def export(m, args, names, outputs, dynamic):
        # no duck shaping: an axis of one piece's input is no other piece's symbol (nor read from its inputs)
        with shapes.patch(use_duck_shape=False):
            return _export(m, args, names, outputs, dynamic, opset)

    inputs, (_, past) = pieces.node_inputs(module, ids, None, False)
    graphs = {}
    try:
        for name, step, decode in ((PREFILL, ids, False), (DECODE, ids[:, :1].clone(), True)):
            if decode:
                inputs, _ = pieces.node_inputs(module, step, past, True)
            traced, layout = pieces.trace(module, inputs, decode, export)
            graphs[name] = pieces.stitch(traced, layout, module, prog, decode)
    except pieces.Unstitchable:
        return None
    return graphs


def export_onnx(prog: Program, out, target="cpu", opset: int = 23, overwrite: bool = False,
                provenance: dict | None = None) -> ExportReport:
    """Writes prefill.onnx and decode.onnx (+ external data) into `out`, atomically.

    Both graphs pass onnx.checker (full check) and the TensorRT lint for `target`; an error-level
    finding fails the export for a GPU target.
    """
    from ..targets import get_target
    from .lint import lint
    from .quant import activation_qdq, lower_quantized

    out = check_output(out, prog.input_paths(), overwrite)  # before the work, not after
    tgt = get_target(target) if isinstance(target, str) else target
    module = materialize(prog).use_export_form()
    module.contiguous_state = False
    states = module.state_names
    outs = list(prog.outputs)
    meta = {"puzzlekit.program": print_program(prog), "puzzlekit.state_names": json.dumps(states),
            "puzzlekit.outputs": json.dumps(outs), "puzzlekit.provenance": json.dumps(provenance or {})}
    D = torch.export.Dim.DYNAMIC
    ids = torch.randint(0, 2, (2, 7))
    graphs = _by_pieces(prog, module, ids, opset) if pieces.applies(prog, module) else None
    if graphs is None:  # the whole program traced at once
        with torch.no_grad():
            _, past = module.prefill(ids)
        graphs = {
            PREFILL: _export(_Prefill(module), (ids,), ["input_ids"], outs + [f"present.{s}" for s in states],
                             ({0: D, 1: D},), opset),
            DECODE: _export(_Decode(module), (ids[:, :1].clone(), *past),
                            ["input_ids"] + [f"past.{s}" for s in states], outs + [f"present.{s}" for s in states],
                            ({0: D}, tuple({0: D, 2: D} if _is_kv(s) else {0: D} for s in states)) if states
                            else ({0: D},), opset),
        }
    _name_dims(graphs[PREFILL], {("input_ids", 0): "batch", ("input_ids", 1): "sequence"})
    _name_dims(graphs[DECODE], {("input_ids", 0): "batch", **{(f"past.{s}", 0): "batch" for s in states},
                                **{(f"past.{s}", 2): "past_sequence" for s in states if _is_kv(s)}})
    findings = []
    with staged_dir(out, overwrite, prog.input_paths()) as tmp:
        for name, model in graphs.items():
            lower_quantized(model, prog, module)
            model = graphs[name] = _optimize(model)
            activation_qdq(model)
            for k, v in meta.items():
                model.metadata_props.add(key=k, value=v)
            path = tmp / name
            _save(model, path)
            try:
                onnx.checker.check_model(str(path), full_check=True)
            except onnx.checker.ValidationError as e:
                raise ExportError(f"{name} fails onnx.checker: {str(e).splitlines()[0]}") from None
            findings += [f.where(name) for f in lint(onnx.load(str(path), load_external_data=False), tgt)]
        errors = [f for f in findings if f.severity == "error"]
        if errors and tgt.kind == "gpu":
            raise ExportError(f"the export cannot be built by TensorRT for {tgt.name}:\n  "
                              + "\n  ".join(str(f) for f in errors))
    return ExportReport(out, sorted(p.name for p in out.iterdir()), findings)
