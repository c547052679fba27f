"""Quantized weights in ONNX, in the patterns TensorRT expects.

FP8: a float8 initializer -> DequantizeLinear(scale). NVFP4: an FP4 initializer -> DequantizeLinear
(block_size=16, axis=-1) whose scale is DequantizeLinear(E4M3 block scales, FP32 tensor scale).
The exported graph first holds each quantised weight as its dequantised float initializer; lowering
replaces that initializer by the pattern producing the same values. A layer's routed experts are one stacked
initializer [experts, ...] (the export form's batched MatMuls); their scales stack along the experts' axis.
"""
from __future__ import annotations

import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from ...ir import Program
from ...ir.ops.routed import expert_names, is_stacked


def _initializer(name: str, t: torch.Tensor, onnx_type: int | None = None) -> onnx.TensorProto:
    """A float32 initializer, or one of `onnx_type` holding t's raw bytes (float8, packed FP4)."""
    if onnx_type is None:
        return numpy_helper.from_array(t.detach().float().numpy(), name)
    return helper.make_tensor(name, onnx_type, list(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes(),
                              raw=True)


def _stacked_parts(prog: Program, param: str, experts: int):
    """A stacked side of routed experts whose experts are quantised: (format, values, scales) stacked over
    the experts (the per-expert weights of the checkpoint, in one initializer each); None if not quantised."""
    prefix, side = param.rsplit(".", 1)
    names = expert_names(prefix, side, experts)
    if not all(n in prog.weights and prog.weights.is_quantized(n) for n in names):
        return None
    qs = prog.weights.get_many(names)
    if len({q.format for q in qs}) != 1:
        raise ValueError(f"{param}: its experts are quantised in different formats; one format per layer side")
    return qs


def _dq(base: str, q, scale, **attrs) -> list:
    return [helper.make_node("DequantizeLinear", [q, scale], [base], name=f"{base}.dq", **attrs)]


def lower_quantized(model: onnx.ModelProto, prog: Program, module) -> None:
    """Replaces the float initializers of quantised weights with their Q/DQ patterns, in place. A layer's
    routed experts are one stacked initializer [experts, ...]: their per-expert scales stack along axis 0."""
    quantized = {f"{n.path}.{k}": fmt for n in prog.nodes for k, fmt in n.op.quant}
    if not quantized:
        return
    graph = model.graph
    keep, new_nodes = [], []
    for init in graph.initializer:
        param = init.name.removeprefix("m.")
        base = init.name
        if is_stacked(param) and (qs := _stacked_parts(prog, param, init.dims[0])) is not None:
            if qs[0].format == "fp8":
                data, scale = torch.stack([q.data for q in qs]), torch.stack([q.scale for q in qs])
                keep.append(_initializer(f"{base}.q", data, TensorProto.FLOAT8E4M3FN))
                if scale[0].numel() == 1:  # a scale per expert
                    keep.append(_initializer(f"{base}.scale", scale.reshape(-1)))
                    new_nodes += _dq(base, f"{base}.q", f"{base}.scale", axis=0)
                else:  # a scale per expert and row: blocks of a whole row
                    keep.append(_initializer(f"{base}.scale", scale.reshape(*data.shape[:2], 1)))
                    new_nodes += _dq(base, f"{base}.q", f"{base}.scale", axis=2, block_size=data.shape[2])
            else:
                shape = [len(qs), *qs[0].shape]
                data = torch.stack([q.data for q in qs])
                keep += [helper.make_tensor(f"{base}.q", TensorProto.FLOAT4E2M1, shape, data.numpy().tobytes(),
                                            raw=True),
                         _initializer(f"{base}.block_scale", torch.stack([q.block_scale for q in qs]),
                                      TensorProto.FLOAT8E4M3FN),
                         _initializer(f"{base}.global_scale", torch.stack([q.global_scale.reshape(()) for q in qs]))]
                new_nodes += [helper.make_node("DequantizeLinear", [f"{base}.block_scale", f"{base}.global_scale"],
                                               [f"{base}.scale"], name=f"{base}.dq_scale", axis=0)]
                new_nodes += _dq(base, f"{base}.q", f"{base}.scale", axis=-1, block_size=16)
            continue
        if param not in quantized:
            keep.append(init)
            continue
        q = prog.weights.get(param)
        if q.format == "fp8":
            keep += [_initializer(f"{base}.q", q.data, TensorProto.FLOAT8E4M3FN),
                     _initializer(f"{base}.scale", q.scale.reshape(-1) if q.scale.numel() > 1 else q.scale.reshape(()))]
            new_nodes += _dq(base, f"{base}.q", f"{base}.scale", **({"axis": 0} if q.scale.numel() > 1 else {}))
        else:
            fp4 = helper.make_tensor(f"{base}.q", TensorProto.FLOAT4E2M1, list(q.shape),  # our packing is ONNX's:
                                     q.data.numpy().tobytes(), raw=True)  # two codes a byte, low nibble first
            keep += [fp4, _initializer(f"{base}.block_scale", q.block_scale, TensorProto.FLOAT8E4M3FN),
                     _initializer(f"{base}.global_scale", q.global_scale.reshape(()))]
            new_nodes += [helper.make_node("DequantizeLinear", [f"{base}.block_scale", f"{base}.global_scale"],
                                           [f"{base}.scale"], name=f"{base}.dq_scale")]
            new_nodes += _dq(base, f"{base}.q", f"{base}.scale", axis=-1, block_size=16)
    graph.ClearField("initializer")
    graph.initializer.extend(keep)
    nodes = list(graph.node)
    graph.ClearField("node")
    graph.node.extend(new_nodes + nodes)


def activation_qdq(model: onnx.ModelProto) -> int:
    """Rewrites each FP8 activation fake-quantization, as exported (Div(x, s) -> Clip(-448, 448) ->
    Cast(FLOAT8E4M3FN) -> Cast(FLOAT) -> Mul(., s)), into QuantizeLinear -> DequantizeLinear with a zero
    point of 0, the pattern TensorRT fuses. Same arithmetic (saturating, round to nearest even).
    Returns the number of rewrites."""
    g = model.graph
    producer = {o: n for n in g.node for o in n.output}
    users: dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            users.setdefault(i, []).append(n)
    drop, add, count = set(), {}, 0
    for cast in g.node:
        attrs = {a.name: a.i for a in cast.attribute}
        if cast.op_type != "Cast" or attrs.get("to") != TensorProto.FLOAT8E4M3FN:
            continue
        clip = producer.get(cast.input[0])
        div = producer.get(clip.input[0]) if clip is not None and clip.op_type == "Clip" else None
        back = users.get(cast.output[0], [])
        mul = users.get(back[0].output[0], []) if len(back) == 1 and back[0].op_type == "Cast" else []
        if div is None or div.op_type != "Div" or len(mul) != 1 or mul[0].op_type != "Mul":
            continue
        x, s = div.input
        mul = mul[0]
        if s not in mul.input or len(users[div.output[0]]) != 1 or len(users[clip.output[0]]) != 1:
            continue
        zp, base = f"{s}.zero_point", div.output[0]
        if zp not in {i.name for i in g.initializer}:
            g.initializer.append(helper.make_tensor(zp, TensorProto.FLOAT8E4M3FN, [], [0.0]))
        add[id(div)] = [helper.make_node("QuantizeLinear", [x, s, zp], [f"{base}.q"], name=f"{base}.quantize"),
                        helper.make_node("DequantizeLinear", [f"{base}.q", s, zp], [mul.output[0]],
                                         name=f"{base}.dequantize")]
        drop.update(id(n) for n in (div, clip, cast, back[0], mul))
        count += 1
    if count:
        nodes = []
        for n in g.node:
            if id(n) in add:
                nodes += add[id(n)]
            elif id(n) not in drop:
                nodes.append(n)
        g.ClearField("node")
        g.node.extend(nodes)
    return count
