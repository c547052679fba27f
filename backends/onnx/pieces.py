"""The export of a program whose layers repeat: each distinct layer traced once, the graph stitched from copies.

torch.export and the ONNX exporter spend tens of milliseconds on every op under dynamic shapes (symbolic sizes
and strides, decomposition, type promotion), so tracing the whole program costs seconds per layer: a minute for
the built-in model, the best part of an hour for 88 layers. Layers with the same spec (and weight dtypes) make
the same graph, with their own weights. So the program's nodes are grouped by spec; one module traces one
representative of each group side by side (`_Pieces`: each called on its own inputs), and the prefill or
decode graph is assembled node by node in the program's order from copies of its representative's subgraph:
values renamed per node, its weights its own (`m.<path>.<param>`, the names the whole-program export gives
them), the constants of the trace shared. Export time then grows with the distinct layers, not with depth.

Static (FP8) activation scales are the modules' own buffers (`input_scale`), weights like the others. NVFP4's
dynamic activation quantization traces into sequence ops that only the whole program's optimisation folds, so
such a program (and one with no repeated layer, which gains nothing) is exported whole (`applies`).
"""
from __future__ import annotations

import re
from typing import NamedTuple

import torch
from onnx import AttributeProto, ModelProto, NodeProto, TensorProto, ValueInfoProto, helper
from torch import nn

from ...ir.quant.formats import QUANT_FORMATS


def _key(node, module: nn.Module):
    """What makes two nodes' graphs the same: the spec and the dtypes of the weights (a spec that cannot be
    compared, e.g. an opaque node's, keys by its own path)."""
    key = (node.op, tuple((k, t.dtype) for k, t in [*module.named_parameters(), *module.named_buffers()]))
    try:
        hash(key)
    except TypeError:
        return node.path
    return key


def groups(module) -> dict:
    """key -> the program's nodes (with their modules) sharing it, in program order."""
    out: dict = {}
    for n, m in module._nodes:
        out.setdefault(_key(n, m), []).append((n, m))
    return out


def applies(prog, module) -> bool:
    """Whether a traced layer may stand for its group: some layer repeats, and no activation is NVFP4."""
    fp4 = any(QUANT_FORMATS.get(fmt, (None, None))[1] == "nvfp4" for n in prog.nodes for _, fmt in n.op.quant)
    return not fp4 and len(groups(module)) < len(module._nodes)


class Unstitchable(Exception):
    """The pieces' graph holds what `stitch` cannot copy (a subgraph, a dropped input): export the program whole."""


def _stateful(node) -> bool:
    return node.op.is_block or node.op.kind == "mtp"


def node_inputs(module, ids, state, decode: bool) -> tuple[dict, tuple]:
    """path -> the tensors the node is called with in one step (its arguments, then its past state when it has
    one in a decode step), recorded from an eager run; and the step's (outputs, state)."""
    got, hooks = {}, []
    for n, m in module._nodes:
        def record(_m, args, n=n):
            past = args[len(n.args)] if _stateful(n) else None
            got[n.path] = (tuple(args[:len(n.args)]), tuple(past) if decode and past else ())
        hooks.append(m.register_forward_pre_hook(record))
    try:
        with torch.no_grad():
            step = module.decode(ids, state) if decode else module.prefill(ids)
    finally:
        for h in hooks:
            h.remove()
    return got, step


class _Pieces(nn.Module):
    """One representative node of each group, each called on its own inputs; its weights keep their program
    names under `m.` (as the whole-program export names them)."""

    def __init__(self, reps: list, decode: bool):
        super().__init__()
        self.reps, self.decode = reps, decode  # [(node, module, argument count, state count)]
        for n, m, _, _ in reps:
            parent = self
            for part in ("m." + n.path).split(".")[:-1]:
                if not hasattr(parent, part):
                    parent.add_module(part, nn.Module())
                parent = getattr(parent, part)
            parent.add_module(n.path.split(".")[-1], m)

    def forward(self, *flat):
        outs, i = [], 0
        for n, m, nargs, nstate in self.reps:
            args, past = flat[i:i + nargs], tuple(flat[i + nargs:i + nargs + nstate])
            i += nargs + nstate
            if _stateful(n):
                out, st = m(*args, past or None, self.decode)
                outs += [out, *st]
            else:
                outs.append(m(*args))
        return tuple(outs)


def _dims(tensor: torch.Tensor, name: str, decode: bool) -> dict:
    """Dynamic axes of a piece's input: batch, and the sequence (a prefill's ids and hidden states) or the
    past length (a decode's K and V)."""
    D = torch.export.Dim.DYNAMIC
    if name.endswith((".k", ".v")):
        return {0: D, 2: D}
    return {0: D} if decode or tensor.dim() < 2 else {0: D, 1: D}


def trace(module, inputs: dict, decode: bool, export) -> tuple[ModelProto, list]:
    """The ONNX graph of the representatives side by side (`export(module, args, names, outputs, dynamic)`),
    and per representative (its nodes, its input names, its output names) in that graph."""
    reps, args, names, dynamic, outs, layout = [], [], [], [], [], []
    for members in groups(module).values():
        n, m = members[0]
        a, past = inputs[n.path]
        states = [f"{n.path}.{k}" for k in n.op.state_shapes()]
        ins = [f"{n.path}/in{j}" for j in range(len(a))] + [f"{n.path}/past/{s}" for s in states[:len(past)]]
        reps.append((n, m, len(a), len(past)))
        args += [t.clone() for t in (*a, *past)]  # its own tensors: a value two nodes read is one input of each
        names += ins
        dynamic += [_dims(t, name, decode) for t, name in zip([*a, *past], ins)]
        o = [f"{n.path}/out"] + ([f"{n.path}/present/{s}" for s in states] if _stateful(n) else [])
        outs += o
        layout.append((members, ins, o))
    model = export(_Pieces(reps, decode), tuple(args), names, outs, (tuple(dynamic),))
    got = [[v.name for v in vs] for vs in (model.graph.input, model.graph.output)]
    if [len(x) for x in got] != [len(names), len(outs)]:
        raise Unstitchable("the exporter dropped an input or output")
    # by position: the exporter names an input handed straight back (a noop layer) by its output
    actual = [dict(zip(names, got[0])), dict(zip(outs, got[1]))]
    return model, [(members, [actual[0][i] for i in ins], [actual[1][o] for o in o_]) for members, ins, o_ in layout]


def _slice(graph, wanted: list[str]) -> list:
    """The nodes computing `wanted` (in the graph's order), back to the graph's inputs and initializers."""
    producer = {o: k for k, node in enumerate(graph.node) for o in node.output}
    keep, todo = set(), [w for w in wanted if w in producer]
    while todo:
        k = producer[todo.pop()]
        if k not in keep:
            keep.add(k)
            todo += [i for i in graph.node[k].input if i in producer]
    return [graph.node[k] for k in sorted(keep)]


class _Piece(NamedTuple):
    rep: object  # the representative node
    ins: list  # its inputs' and outputs' names in the pieces' graph
    outs: list
    body: list  # the nodes computing its outputs
    dims: dict  # its symbolic axes -> batch, sequence, past_sequence


def stitch(pieces: ModelProto, layout: list, module, prog, decode: bool) -> ModelProto:
    """The program's graph from the pieces': per node a renamed copy of its representative's subgraph, wired to
    the program's values, its weights from `module`; inputs input_ids and past.<state>, outputs the program's
    outputs and present.<state> (prefill and decode graphs as the whole-program export writes them)."""
    g = pieces.graph
    if any(a.type in (AttributeProto.GRAPH, AttributeProto.GRAPHS) for node in g.node for a in node.attribute):
        raise Unstitchable("a node with a subgraph")
    st = _Stitch(g, module, prog.inputs[0])
    of = {}
    for members, ins, outs in layout:
        piece = _Piece(members[0][0], ins, outs, _slice(g, outs), _dim_names(st.vis, ins, decode))
        of.update({n.path: piece for n, _ in members})
    for n, _ in module._nodes:  # in the program's order
        st.add(n, of[n.path])
    states = module.state_names
    graph = helper.make_graph(st.nodes, g.name,
                              [st.inputs["input_ids"], *(st.inputs[f"past.{s}"] for s in states if decode)],
                              [st.outputs[o] for o in [*prog.outputs, *(f"present.{s}" for s in states)]],
                              list(st.kept.values()))
    model = helper.make_model(graph, opset_imports=list(pieces.opset_import), ir_version=pieces.ir_version,
                              producer_name=pieces.producer_name, producer_version=pieces.producer_version)
    model.functions.extend(pieces.functions)
    return model


class _Stitch:
    """The stitched graph as it grows: nodes, the initializers kept, the graph's inputs and outputs."""

    def __init__(self, g, module, ids: str):
        self.inits = {t.name: t for t in g.initializer}
        self.tensors = {f"m.{k}": t for k, t in [*module.named_parameters(), *module.named_buffers()]}
        self.vis = {v.name: v for v in [*g.input, *g.output]}
        self.ids = ids
        self.nodes, self.kept, self.inputs, self.outputs = [], {}, {}, {}

    def add(self, n, piece: _Piece) -> None:
        """A copy of the piece's subgraph computing node `n`: its inputs the program's values (input_ids and
        past.<state> the graph's), its outputs `n`'s value and present.<state>, its weights `n`'s own."""
        states = [f"{n.path}.{k}" for k in n.op.state_shapes()]
        ins = ["input_ids" if a == self.ids else a for a in n.args] + [f"past.{s}" for s in states]
        rename = dict(zip(piece.ins, ins))
        for piece_in, final in rename.items():
            if final == "input_ids" or final.startswith("past."):
                self.inputs.setdefault(final, _value_info(self.vis[piece_in], final, piece.dims))
        extra, out_map = [], {}
        for piece_out, final in zip(piece.outs, [n.name] + [f"present.{s}" for s in states]):
            self.outputs[final] = _value_info(self.vis[piece_out], final, piece.dims)
            if piece_out in out_map or piece_out in rename or piece_out in self.inits:  # no node of its own makes it
                extra.append((piece_out, final))
            else:
                out_map[piece_out] = final

        def name(v: str) -> str:
            if not v or v in rename:
                return rename.get(v, v)
            return out_map.get(v) or (self._initializer(v, n, piece.rep) if v in self.inits else f"{n.path}/{v}")
        for k, node in enumerate(piece.body):
            copy = NodeProto()
            copy.CopyFrom(node)
            copy.name = f"{n.path}/{node.name or k}"
            copy.input[:] = [name(i) for i in node.input]
            copy.output[:] = [name(o) for o in node.output]
            self.nodes.append(copy)
        self.nodes += [helper.make_node("Identity", [name(src)], [final], name=f"{n.path}/{final}")
                       for src, final in extra]

    def _initializer(self, v: str, n, rep) -> str:
        """The name in the stitched graph of the pieces' initializer `v` for node `n` (kept once): the node's own
        weight where `v` is its representative's, another node's weight as it is (the MTP head's embedding),
        a constant of the trace once for every node of the piece."""
        mine = f"m.{rep.path}."
        if v.startswith(mine):
            final = f"m.{n.path}." + v[len(mine):]
            if final not in self.kept:
                self.kept[final] = self.inits[v] if n is rep else _weight(self.inits[v], final, self.tensors[final])
            return final
        final = v if v in self.tensors else f"{rep.path}/{v}"
        if final not in self.kept:
            self.kept[final] = self.inits[v] if final == v else _weight(self.inits[v], final)
        return final


def _dim_names(vis: dict, ins: list[str], decode: bool) -> dict:
    """A piece's symbolic axes -> the names the whole-program export gives them: batch (axis 0), sequence (a
    prefill's ids and hidden states, axis 1), past_sequence (a decode's K and V, axis 2)."""
    out = {}
    for name in ins:
        kv = "/past/" in name and name.endswith((".k", ".v"))
        for axis, d in enumerate(vis[name].type.tensor_type.shape.dim):
            final = "batch" if axis == 0 else "sequence" if axis == 1 and not decode and "/past/" not in name \
                else "past_sequence" if axis == 2 and kv else None
            if d.dim_param and final:
                out.setdefault(d.dim_param, final)
    return out


def _value_info(vi: ValueInfoProto, name: str, dims: dict) -> ValueInfoProto:
    """A graph input's or output's value info under its final name, its axes named by `dims`."""
    out = ValueInfoProto()
    out.CopyFrom(vi)
    out.name = name
    for d in out.type.tensor_type.shape.dim:
        if d.dim_param:  # a symbol, or an expression of them ("s14 + 1")
            d.dim_param = re.sub(r"\b\w+\b", lambda m: dims.get(m.group(), m.group()), d.dim_param)
    return out


def _weight(rep: TensorProto, name: str, tensor: torch.Tensor | None = None) -> TensorProto:
    """An initializer like the representative's: `tensor`'s bytes (a node's own weight) or the same bytes."""
    out = TensorProto()
    out.CopyFrom(rep)
    out.name = name
    if tensor is not None:
        out.ClearField("raw_data")
        for f in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
            out.ClearField(f)
        out.raw_data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return out
