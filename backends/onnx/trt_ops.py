"""TensorRT's dynamic NVFP4 activation quantizer in ONNX: `trt::TRT_FP4DynamicQuantize`.

NVFP4 activations (W4A4) are exported as NVIDIA Model Optimizer exports them, the pattern TensorRT builds:

    x -> TRT_FP4DynamicQuantize(x, s2; axis=-1, block_size=16, scale_type=FLOAT8E4M3FN) -> (q FP4, sb E4M3)
    sb -> DequantizeLinear(sb, s2) -> block scales;  q -> DequantizeLinear(q, block scales; axis=-1, block_size=16)

The op has no ONNX schema of its own: `register_schema` declares one so that the exporter, onnx's checker and
shape inference accept it, and `TRT_FP4DynamicQuantize` runs it under onnx.reference, in numpy, from the format's
definition (per block of 16: sb = e4m3(clamp(amax / 6 / s2, 2^-9, 448)), 1 for an all-zero block;
q = nearest E2M1 of x / (sb s2)).
"""
from __future__ import annotations

import functools

import numpy as np
import onnx
import torch
from onnx import TensorProto
from onnx.defs import OpSchema
from onnx.reference.op_run import OpRun

DOMAIN, OP = "trt", "TRT_FP4DynamicQuantize"
BLOCK = 16


def register_schema() -> None:
    """Declares trt::TRT_FP4DynamicQuantize (opset 1) to onnx, once per process."""
    if onnx.defs.has(OP, DOMAIN):
        return
    attr = OpSchema.AttrType.INT
    onnx.defs.register_schema(OpSchema(
        OP, DOMAIN, 1, doc="TensorRT's dynamic FP4 block quantizer (per-block E4M3 scales under a global scale).",
        inputs=[OpSchema.FormalParameter("X", "T1"), OpSchema.FormalParameter("global_scale", "T1")],
        outputs=[OpSchema.FormalParameter("Y", "T2"), OpSchema.FormalParameter("Y_scale", "T3")],
        type_constraints=[("T1", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "input and scale"),
                          ("T2", ["tensor(float4e2m1)"], "FP4 values"),
                          ("T3", ["tensor(float8e4m3fn)"], "per-block scales")],
        attributes=[OpSchema.Attribute("axis", attr, "blocked axis (the last)"),
                    OpSchema.Attribute("block_size", attr, "elements per block (16)"),
                    OpSchema.Attribute("scale_type", attr, "data type of the block scales (FLOAT8E4M3FN)")]))


@functools.cache
def nvfp4_qdq_op() -> torch._ops.OpOverload:
    """`puzzlekit::nvfp4_qdq`, NVFP4 activation quantise-dequantise as one torch op that the exporter lowers
    with `onnxscript_lowering`. Registered on first use, once per process (torch keeps one op per name)."""
    if not hasattr(torch.ops.puzzlekit, "nvfp4_qdq"):
        from ...ir.quant.formats import nvfp4_qdq

        op = torch.library.custom_op("puzzlekit::nvfp4_qdq", nvfp4_qdq, mutates_args=())
        op.register_fake(lambda x, scale: torch.empty_like(x))
    return torch.ops.puzzlekit.nvfp4_qdq.default


def onnxscript_lowering():
    """The exporter's translation of `puzzlekit::nvfp4_qdq(x, global_scale)` into the TensorRT pattern."""
    import onnxscript
    from onnxscript import opset23 as op

    register_schema()
    trt = onnxscript.values.Opset(DOMAIN, 1)

    def nvfp4_qdq(x, global_scale):
        q, sb = trt.TRT_FP4DynamicQuantize(x, global_scale, axis=-1, block_size=BLOCK,
                                           scale_type=TensorProto.FLOAT8E4M3FN)
        return op.DequantizeLinear(q, op.DequantizeLinear(sb, global_scale), axis=-1, block_size=BLOCK)

    return nvfp4_qdq


def type_outputs(model: onnx.ModelProto) -> int:
    """Records the FP4 / E4M3 types of the quantizer's outputs in value_info (the exporter leaves them
    untyped), so that readers such as the TensorRT lint see FP4 where it is. Returns the nodes typed."""
    g, count = model.graph, 0
    typed = {vi.name: vi for vi in g.value_info}
    for n in g.node:
        if (n.domain, n.op_type) != (DOMAIN, OP):
            continue
        for name, ty in zip(n.output, (TensorProto.FLOAT4E2M1, TensorProto.FLOAT8E4M3FN)):
            vi = typed.get(name)
            if vi is None:
                vi = g.value_info.add()
                vi.name = name
            vi.type.tensor_type.elem_type = ty
        count += 1
    return count


_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float32)


def _round_e2m1(x: np.ndarray) -> np.ndarray:
    """Nearest E2M1 value, ties to the even code, saturating at 6."""
    mag = np.minimum(np.abs(x), 6.0)
    dist = np.abs(mag[..., None] - _E2M1)
    best = dist.min(-1, keepdims=True)
    ties = dist == best  # a tie goes to the even code (mantissa bit 0): the values 0, 1, 2 and 4
    code = np.where(ties.sum(-1) > 1, np.argmax(ties & (np.arange(8) % 2 == 0), axis=-1), np.argmin(dist, axis=-1))
    return np.copysign(_E2M1[code], x)


class TRT_FP4DynamicQuantize(OpRun):  # onnx.reference finds a custom op by its class name
    """trt::TRT_FP4DynamicQuantize for onnx.reference.ReferenceEvaluator(model, new_ops=[...])."""

    op_domain = DOMAIN

    def _run(self, x, global_scale, axis=-1, block_size=BLOCK, scale_type=TensorProto.FLOAT8E4M3FN):
        import ml_dtypes

        if axis not in (-1, x.ndim - 1) or block_size != BLOCK or x.shape[-1] % BLOCK:
            raise ValueError(f"{OP}: blocks of {BLOCK} along the last axis, got axis={axis}, block_size={block_size}, "
                             f"shape {x.shape}")
        s2 = np.float32(global_scale)
        blocks = x.astype(np.float32).reshape(*x.shape[:-1], -1, BLOCK)
        sb = np.abs(blocks).max(-1) / np.float32(6.0) / s2
        # clamped to E4M3's range [2^-9, 448] before the cast, so that a tiny block cannot get a zero scale
        sb = np.where(sb == 0, np.float32(1.0), np.clip(sb, 2.0**-9, 448.0)).astype(ml_dtypes.float8_e4m3fn)
        q = _round_e2m1(blocks / (sb.astype(np.float32)[..., None] * s2)).reshape(x.shape)
        return q.astype(ml_dtypes.float4_e2m1fn), sb

