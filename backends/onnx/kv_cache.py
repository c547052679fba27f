"""An FP8 KV cache in the exported graphs: the attention state crosses the graph boundary as FLOAT8E4M3FN.

Each `past.<layer>.k|v` input becomes FP8 and is dequantized right after entering; each `present.<layer>.k|v`
output is quantized right before leaving, with one per-tensor scale per state (amax / 448 from calibration),
shared by the past and present of that state. Q/DQ with a zero point of 0, the pattern TensorRT runs in FP8,
and onnxruntime on CPU too. Half the cache memory of BF16; the math stays in the graph's float type.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

FP8_MAX = 448.0
ZERO = "kv_cache.zero_point"


def is_kv(state: str) -> bool:
    return state.endswith((".k", ".v"))


def kv_scales(amax: dict[str, float]) -> dict[str, float]:
    """Per-state scales from calibrated amax (1.0 where a state was all zero)."""
    return {s: (a / FP8_MAX if a > 0 else 1.0) for s, a in amax.items()}


def fp8_kv_cache(model: onnx.ModelProto, scales: dict[str, float]) -> int:
    """Rewrites `model` in place; returns the number of KV tensors now crossing the boundary in FP8."""
    g = model.graph
    count, head, tail = 0, [], []
    rename: dict[str, str] = {}
    for vi in g.input:
        state = vi.name.removeprefix("past.")
        if vi.name.startswith("past.") and is_kv(state):
            _scale(g, state, scales)
            rename[vi.name] = f"{vi.name}.dequantized"
            head.append(helper.make_node("DequantizeLinear", [vi.name, f"kv_cache.{state}.scale", ZERO],
                                         [rename[vi.name]], name=f"{vi.name}.dequantize"))
            vi.type.tensor_type.elem_type = TensorProto.FLOAT8E4M3FN
            count += 1
    for vi in g.output:
        state = vi.name.removeprefix("present.")
        if vi.name.startswith("present.") and is_kv(state):
            _scale(g, state, scales)
            rename[vi.name] = f"{vi.name}.float"
            tail.append(helper.make_node("QuantizeLinear", [rename[vi.name], f"kv_cache.{state}.scale", ZERO],
                                         [vi.name], name=f"{vi.name}.quantize"))
            vi.type.tensor_type.elem_type = TensorProto.FLOAT8E4M3FN
            count += 1
    if not count:
        return 0
    for n in g.node:
        n.input[:] = [rename.get(i, i) for i in n.input]
        n.output[:] = [rename.get(o, o) for o in n.output]
    for vi in g.value_info:
        vi.name = rename.get(vi.name, vi.name)
    nodes = head + list(g.node) + tail
    g.ClearField("node")
    g.node.extend(nodes)
    g.initializer.append(helper.make_tensor(ZERO, TensorProto.FLOAT8E4M3FN, [], [0.0]))
    return count


def _scale(g, state: str, scales: dict) -> None:
    name = f"kv_cache.{state}.scale"
    if state not in scales:
        raise KeyError(f"no FP8 KV-cache scale for state {state!r}")
    if not any(i.name == name for i in g.initializer):
        g.initializer.append(numpy_helper.from_array(np.array(scales[state], dtype=np.float32), name))
