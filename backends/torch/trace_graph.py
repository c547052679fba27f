"""The exported graph -> Program: call_function nodes partitioned by nn_module_stack into recognised blocks
and opaque nodes (each its own fx subgraph), identity glue dropped and values named as checkpoint programs
name them. `tracing` exports the module and hands the graph here."""
from __future__ import annotations

import re

import torch
from torch import fx, nn

from ...errors import TraceError
from ...ir.ops import Opaque, OpSpec
from ...ir.program import Node, Program
from ...ir.weights import WeightStore
from .trace_registry import ROOT_RENAMES, Converted


# -- partitioning the exported graph --------------------------------------------------------------------
def _stack_paths(node: fx.Node) -> list[str]:
    return [v[0] for v in (node.meta.get("nn_module_stack") or {}).values()]


def _owner(node: fx.Node, blocks: set[str]) -> tuple[str, str]:
    paths = _stack_paths(node)
    for p in paths:
        if p in blocks:
            return "block", p
    for p in paths:  # the outermost module that holds no recognised block is an opaque node of its own
        if p and not any(b.startswith(p + ".") for b in blocks):
            return "opaque", p
    return "opaque", "glue"


def _val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _pick(role: str, candidates: list[fx.Node], op: OpSpec) -> fx.Node | None:
    def fits(n):
        v = _val(n)
        if not isinstance(v, torch.Tensor):
            return False
        if role == "ids":
            return not v.dtype.is_floating_point and v.dim() == 2
        return v.dtype.is_floating_point and v.dim() == 3 and v.shape[-1] == getattr(op, "hidden", v.shape[-1])
    hits = [n for n in candidates if fits(n)]
    return hits[0] if len(hits) == 1 else None


def _drop_noop_casts(graph: fx.Graph) -> None:
    """`x.float()` on a float32 x returns x itself, and export then routes later uses of x through the
    cast, across module boundaries. Casts to the same dtype are no-ops: bypass them."""
    for n in list(graph.nodes):
        if n.op == "call_function" and str(n.target) in ("aten.to.dtype", "aten._to_copy.default"):
            src, vi, vo = n.args[0], _val(n.args[0]), _val(n)
            if isinstance(vi, torch.Tensor) and isinstance(vo, torch.Tensor) and vi.dtype == vo.dtype:
                n.replace_all_uses_with(src)
                graph.erase_node(n)


def _build(gm: fx.GraphModule, found: dict[str, Converted], root: nn.Module) -> Program:
    graph = gm.graph
    _drop_noop_casts(graph)
    blocks = set(found)
    # 1. partition call_function nodes, contiguous runs of one owner form one partition
    part_of: dict[fx.Node, int] = {}
    parts: list[tuple[str, str]] = []
    last = None
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        key = _owner(n, blocks)
        if key != last:
            parts.append(key)
            last = key
        part_of[n] = len(parts) - 1
    members: dict[int, list[fx.Node]] = {}
    for n, i in part_of.items():
        members.setdefault(i, []).append(n)

    def ext_inputs(i):
        seen = []
        for n in members[i]:
            for a in n.all_input_nodes:
                if part_of.get(a) != i and a.op != "get_attr" and a not in seen:
                    seen.append(a)
        return seen

    # 2. block partitions read only their role inputs; a block that cannot be matched becomes opaque
    reads: dict[int, list[fx.Node]] = {}
    for i, (kind, path) in enumerate(parts):
        if kind == "block":
            op = found[path].op
            picked = [_pick(r, ext_inputs(i), op) for r in op.inputs]
            if all(p is not None for p in picked):
                reads[i] = picked
                continue
            parts[i] = ("opaque", path)
    # 3. liveness from the graph outputs backwards
    out_node = next(n for n in graph.nodes if n.op == "output")
    outs = list(_flatten(out_node.args))
    live: set[fx.Node] = set()
    stack = [o for o in outs if isinstance(o, fx.Node)]
    while stack:
        n = stack.pop()
        if n in live:
            continue
        live.add(n)
        i = part_of.get(n)
        if i is not None and i in reads:
            stack += [m for m in members[i] if m not in live] + reads[i]
        else:
            stack += [a for a in n.all_input_nodes]
    # 4. program nodes, in graph order
    value_of: dict[fx.Node, str] = {}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    user_inputs = [p for p in placeholders if p in live]
    if len(user_inputs) != 1:
        raise TraceError(f"the traced module reads {len(user_inputs)} tensor inputs; Programs take one (token ids)")
    names = ["input_ids"]
    for p, nm in zip(user_inputs, names):
        value_of[p] = nm
    weights, nodes = WeightStore(), []
    renames = ROOT_RENAMES.get(type(root).__name__, [])
    canon = lambda p: _rename(p, renames)
    counter = {"n": 0}

    def fresh():
        counter["n"] += 1
        return f"v{counter['n']}"

    def consumed(m: fx.Node) -> bool:
        """Is `m` read by something outside its partition that is kept?"""
        for u in m.users:
            j = part_of.get(u)
            if u.op == "output" or (j is None and u in live):
                return True
            if j is not None and j != part_of[m] and (m in reads[j] if j in reads else u in live):
                return True
        return False

    done: set[int] = set()
    for n in graph.nodes:
        i = part_of.get(n)
        if i is None or i in done or not (set(members[i]) & live):
            continue
        done.add(i)
        kind, path = parts[i]
        if i in reads:
            c = found[path]
            outs_i = [m for m in members[i] if consumed(m)]
            if len(outs_i) != 1:
                raise TraceError(f"{path}: a recognised block must produce exactly one value, got {len(outs_i)}")
            npath = c.path or canon(path)
            node = Node(fresh(), c.op, tuple(value_of[r] for r in reads[i]), npath)
            for k, t in c.weights.items():
                weights.set(f"{npath}.{k}", t.detach().clone())
            nodes.append(node)
            value_of[outs_i[0]] = node.name
        else:
            for out in [m for m in members[i] if m in live and consumed(m)]:
                cls = "glue" if path == "glue" else type(root.get_submodule(path)).__name__
                node, params = _opaque(gm, members[i], out, value_of, canon(path) if path != "glue" else None,
                                       cls, len(nodes))
                nodes.append(node)
                for k, t in params.items():
                    weights.set(f"{node.path}.{k}", t)
                value_of[out] = node.name
    for o in outs:
        if isinstance(o, fx.Node) and o not in value_of:
            raise TraceError(f"output {o.name} is not produced by any traced node")
    prog = Program(nodes, weights, tuple(names), tuple(value_of[o] for o in outs if isinstance(o, fx.Node)),
                   {"dtype": str(next((v.dtype for v in root.parameters()), torch.float32)).replace("torch.", "")})
    return _simplify(prog)


def _flatten(x):
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _flatten(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _flatten(y)
    else:
        yield x


def _rename(path: str, renames) -> str:
    for pat, rep in renames:
        path = re.sub(pat, rep, path)
    return path


def _opaque(gm, members, out, value_of, path, cls, index) -> tuple[Node, dict]:
    """An opaque node computing `out` from the values it needs, as its own GraphModule."""
    needed, stack = [], [out]
    mset = set(members)
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        needed.append(n)
        stack += [a for a in n.all_input_nodes if a in mset or a.op == "get_attr"]
    order = [n for n in gm.graph.nodes if n in needed]
    g = fx.Graph()
    env, inputs, attrs = {}, [], {}
    path = path or f"glue.{index}"
    for n in order:
        for a in n.all_input_nodes:
            if a not in env and a not in mset and a.op != "get_attr":
                if a not in value_of:
                    raise TraceError(f"{path}: input {a.name} comes from a part of the graph that was not kept")
                env[a] = g.placeholder(f"in{len(inputs)}")
                env[a].meta = dict(a.meta)
                inputs.append(a)
        if n.op == "get_attr":
            local = n.target[len(path) + 1:] if n.target.startswith(path + ".") else n.target
            attrs[local] = _fetch(gm, n.target)
            env[n] = g.get_attr(local)
        else:
            env[n] = g.node_copy(n, lambda a: env[a])
    g.output(env[out])
    sub = fx.GraphModule({k: v for k, v in attrs.items()}, g)
    roles = tuple("ids" if not _val(a).dtype.is_floating_point else "hidden" for a in inputs)
    op = Opaque(cls, roles, sub)
    return Node(f"o{index}", op, tuple(value_of[a] for a in inputs), path), {
        k: v.detach() for k, v in sub.state_dict().items()}


def _fetch(gm, target):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


_IDENTITY_OPS = {"slice.Tensor", "alias.default", "clone.default", "detach.default", "contiguous.default",
                 "to.dtype", "_to_copy.default", "view.default", "reshape.default", "_assert_tensor_metadata.default"}


def _is_identity(op: Opaque) -> bool:
    """Glue that returns its single input unchanged (e.g. a full slice, a cast to the same dtype)."""
    g = op.graph.graph
    ph = [n for n in g.nodes if n.op == "placeholder"]
    out = next(n for n in g.nodes if n.op == "output").args[0]
    if len(ph) != 1 or not isinstance(out, fx.Node) or op.graph.state_dict():
        return False
    vi, vo = _val(ph[0]), _val(out)
    if vi is None or vo is None or vi.dtype != vo.dtype or list(vi.shape) != list(vo.shape):
        return False
    return all(str(n.target).removeprefix("aten.") in _IDENTITY_OPS for n in g.nodes if n.op == "call_function")


def _simplify(prog: Program) -> Program:
    """Drops identity glue and names values the way checkpoint programs do."""
    alias: dict[str, str] = {}
    kept = []
    for n in prog.nodes:
        args = tuple(alias.get(a, a) for a in n.args)
        if n.op.kind == "opaque" and _is_identity(n.op):
            alias[n.name] = args[0]
            continue
        kept.append(Node(n.name, n.op, args, n.path))
    outputs = tuple(alias.get(o, o) for o in prog.outputs)
    # canonical value names
    rename, b = {}, 0
    for n in kept:
        k = n.op.kind
        if k == "embed":
            rename[n.name] = "x0"
        elif n.op.is_block:
            b += 1
            rename[n.name] = f"x{b}"
        elif k in ("norm", "lm_head", "mtp"):
            rename[n.name] = {"norm": "h", "lm_head": "logits", "mtp": "mtp_logits"}[k]
    if len(set(rename.values())) != len(rename):
        rename = {}
    r = lambda v: rename.get(v, v)
    nodes = [Node(r(n.name), n.op, tuple(r(a) for a in n.args), n.path) for n in kept]
    return Program(nodes, prog.weights, prog.inputs, tuple(r(o) for o in outputs), prog.meta)
