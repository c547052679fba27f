"""A lint of ONNX graphs against TensorRT's published ONNX support (onnx-tensorrt docs/operators.md).

Findings name the graph, the node, its operator and the reason; `error` ones stop an export for a
GPU target. The support table is backends/onnx/trt_support.json.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import onnx
from onnx import numpy_helper

from .trt_ops import DOMAIN as TRT_DOMAIN
from .trt_ops import OP as TRT_FP4_QUANTIZE

SUPPORT_FILE = Path(__file__).with_name("trt_support.json")


@dataclass(frozen=True)
class Finding:
    severity: str  # "error" or "warning"
    node: str
    op: str
    reason: str
    graph: str = ""

    def where(self, graph: str) -> Finding:
        return replace(self, graph=graph)

    def __str__(self) -> str:
        return f"{self.severity}: {self.graph + ': ' if self.graph else ''}node {self.node!r} ({self.op}): {self.reason}"

    def to_json(self) -> dict:
        return {"severity": self.severity, "graph": self.graph, "node": self.node, "op": self.op, "reason": self.reason}


@lru_cache(maxsize=1)
def support() -> dict:
    return json.loads(SUPPORT_FILE.read_text())


_TYPE_NAMES = {v: k for k, v in onnx.TensorProto.DataType.items()}


def _tensor_types(model: onnx.ModelProto) -> dict[str, int]:
    types = {}
    for vi in [*model.graph.input, *model.graph.output, *model.graph.value_info]:
        types[vi.name] = vi.type.tensor_type.elem_type
    for init in model.graph.initializer:
        types[init.name] = init.data_type
    return types


def lint(model: onnx.ModelProto, target) -> list[Finding]:
    """Everything in `model` that TensorRT's ONNX parser would refuse or restrict, for `target`."""
    sup = support()
    out: list[Finding] = []
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if not sup["opset_min"] <= opset <= sup["opset_max"]:
        out.append(Finding("error", "(model)", "opset", f"opset {opset} is outside TensorRT's "
                                                        f"{sup['opset_min']}-{sup['opset_max']}"))
    blackwell = target is not None and target.supports("nvfp4")
    allowed = set(sup["data_types"])
    types = _tensor_types(model)
    inits = {i.name: i for i in model.graph.initializer}
    for node in model.graph.node:
        name = node.name or f"{node.op_type}@{node.output[0]}"
        if (node.domain, node.op_type) == (TRT_DOMAIN, TRT_FP4_QUANTIZE):
            entry = {"supported": True}  # TensorRT's own dynamic quantizer; its FP4 output is checked below
        elif node.domain not in ("", "ai.onnx"):
            out.append(Finding("error", name, node.op_type, f"custom domain {node.domain!r} needs a TensorRT plugin"))
            continue
        else:
            entry = sup["operators"].get(node.op_type)
        if entry is None or not entry["supported"]:
            out.append(Finding("error", name, node.op_type, "not supported by TensorRT's ONNX parser"))
        elif entry.get("restrictions"):
            out.append(Finding("warning", name, node.op_type, f"TensorRT restriction: {entry['restrictions']}"))
        for t in [*node.input, *node.output]:
            ty = _TYPE_NAMES.get(types.get(t, 0), "")
            if ty == "FLOAT4E2M1" and not blackwell:
                out.append(Finding("error", name, node.op_type, f"{t!r} is FP4 (FLOAT4E2M1), which needs a Blackwell "
                                                                f"GPU (sm_100); {getattr(target, 'name', 'cpu')} has none"))
            elif ty and ty not in allowed and ty != "UNDEFINED":
                out.append(Finding("error", name, node.op_type, f"{t!r} has data type {ty}, which TensorRT does not take"))
        if node.op_type in ("QuantizeLinear", "DequantizeLinear") and len(node.input) > 2 and node.input[2]:
            zp = inits.get(node.input[2])
            if zp is None or numpy_helper.to_array(zp).astype("float64").any():
                out.append(Finding("error", name, node.op_type, "zero point must be a constant 0 for TensorRT"))
    return _dedupe(out)


def _dedupe(findings: list[Finding]) -> list[Finding]:
    seen, out = set(), []
    for f in findings:
        key = (f.severity, f.node, f.reason)
        if key not in seen:
            seen.add(key)
            out.append(f)
    return out
