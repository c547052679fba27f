"""Materialises a Program into a runnable nn.Module built from each op's reference implementation."""
from __future__ import annotations

import math

import torch
from torch import nn

from ...ir.ops.base import QUANT_FORMATS, use_export_form
from ...ir.ops.io import TiedHead
from ...ir.ops.routed import RoutedExperts, expert_names, split_experts
from ...ir.program import Program
from ...ir.weights import WeightStore
from .device import CPU, Compute


def _place(root: nn.Module, path: str, module: nn.Module) -> None:
    """Registers `module` at a dotted path, creating plain containers on the way."""
    *parents, leaf = path.split(".")
    m = root
    for p in parents:
        if not hasattr(m, p):
            m.add_module(p, nn.Module())
        m = getattr(m, p)
    m.add_module(leaf, module)


class ProgramModule(nn.Module):
    """Runs a Program. `forward(input_ids)` gives the program's outputs (logits, MTP logits).

    `prefill(input_ids, state=None)` and `decode(token_ids, state)` also return the decode state: a flat
    tuple of tensors in the order of `state_names` (conv/SSM state per Mamba block, K/V per attention
    block, the MTP head's own). Its state_dict keys are the checkpoint's tensor names, but for the routed
    experts, held stacked (`checkpoint_state` gives the checkpoint's per-expert names).
    """

    def __init__(self, prog: Program, device: str | torch.device = "cpu"):
        super().__init__()
        self.program = prog
        #: where inputs go and the forward's precision (autocast); see backends.torch.device
        self.compute = CPU if str(device) == "meta" else Compute(torch.device(device))
        self._nodes = []
        for n in prog.nodes:
            with torch.device(device):
                m = n.op.build()
            _place(self, n.path, m)
            self._nodes.append((n, m))
        by_kind = {n.op.kind: m for n, m in self._nodes}
        for n, m in self._nodes:
            if isinstance(m, TiedHead):
                m.bind(by_kind["embed"])
            if n.op.kind == "mtp":
                m.bind(by_kind["embed"], by_kind["lm_head"])
        self.state_names = [f"{n.path}.{k}" for n, _ in self._nodes for k in n.op.state_shapes()]
        #: return states in one memory layout whatever the prompt length (torch.export guards on strides);
        #: the ONNX exporter turns it off (layouts do not exist there and it cannot lower stride queries)
        self.contiguous_state = True

    def use_export_form(self) -> ProgramModule:
        """Every op in its export form (see ir.ops.base.use_export_form): for torch.export and ONNX."""
        use_export_form(self)
        return self

    def _run(self, ids, state, decode, keep=(), project=True):
        if ids.device != self.compute.device:
            ids = ids.to(self.compute.device)
        with self.compute.autocast():
            return self._run_nodes(ids, state, decode, keep, project)

    def _run_nodes(self, ids, state, decode, keep, project=True):
        return run_nodes(self.program, self._nodes, ids, state, decode, keep, self.contiguous_state, project)

    def forward(self, input_ids, project: bool = True):
        """The program's outputs. `project` false: each output's hidden state before the vocabulary projection
        (the trunk's after its final norm, the MTP head's after its own), then the projection's matrix (a view,
        so that a data-parallel wrapper sees it used): the losses over the vocabulary build the logits a chunk
        of tokens at a time from them (evaluation.vocab)."""
        outs, _ = self._run(input_ids, None, False, project=project)
        if not project:
            return (*outs, self.head_weight().view_as(self.head_weight()))
        return outs if len(outs) > 1 else outs[0]

    def head_module(self) -> nn.Module:
        return next(m for n, m in self._nodes if n.op.kind == "lm_head")

    def head_weight(self) -> torch.Tensor:
        return head_matrix(self.head_module())

    def values(self, input_ids, *names):
        """Intermediate SSA values (e.g. the trunk's last hidden state) of a fresh prefill, by name."""
        got = self._run(input_ids, None, False, keep=names)
        return got if len(names) > 1 else got[0]

    def prefill(self, input_ids, state=None):
        return self._run(input_ids, state, False)

    def decode(self, token_ids, state):
        """One token per sequence: token_ids [B] or [B, 1]."""
        return self._run(token_ids.reshape(-1, 1), state, True)


def head_matrix(head: nn.Module) -> torch.Tensor:
    """An LM head module's [vocab, hidden] matrix (the embedding's, when tied)."""
    return head.embedding.weight if isinstance(head, TiedHead) else head.weight


def run_nodes(program: Program, nodes, ids, state, decode: bool, keep=(), contiguous: bool = True,
              project: bool = True):
    """One step of `program` over `ids` from the decode `state` (None: a fresh sequence): its outputs and new
    state, or the values named in `keep`. `nodes` yields (node, module) in program order (a ProgramModule's
    own, or a stream's, read as they run). `project` false: the LM head and the MTP head's projection are left
    out, the outputs are the hidden states they would project."""
    env = {program.inputs[0]: ids}
    new_state, i = [], 0
    for n, m in nodes:
        args = [env[a] for a in n.args]
        if n.op.is_block or n.op.kind == "mtp":
            cnt = len(n.op.state_shapes())
            past = None if state is None or not cnt else tuple(state[i:i + cnt])
            out, st = m(*args, past, decode) if project or n.op.kind != "mtp" else m(*args, past, decode, False)
            new_state += [t.contiguous() for t in st] if contiguous else list(st)
            i += cnt
        elif not project and n.op.kind == "lm_head":
            out = args[0]
        else:
            out = m(*args)
        env[n.name] = out
    if keep:
        return tuple(env[k] for k in keep)
    return tuple(env[o] for o in program.outputs), tuple(new_state)


def load_weights(module: ProgramModule, weights: WeightStore | None = None) -> ProgramModule:
    """Puts the store's tensors into the module, on its device (on CPU the module shares them). Quantised
    weights are dequantised (fake quantization) and the inputs of weights with an activation format are
    quantised-dequantised at run time."""
    load_into(module, weights or module.program.weights, module.compute.device, module.program.nodes)
    return module


def load_into(root: nn.Module, w: WeightStore, device, nodes, base: str = "") -> None:
    """Loads `root`'s parameters from the store: `base` is the path of `root` in the program ("" for a whole
    ProgramModule, a node's path for that node's module alone); `nodes` are the nodes it holds.

    Every tensor is assigned in place of the module's own (no load_state_dict walk over the module tree);
    a layer's routed experts are read into their stacked tensors a run of experts at a time (`_stacked`), so
    loading them holds one copy of the layer, not its experts twice."""
    wanted = []  # per module: [(attribute, is buffer, checkpoint names)], stacked
    for path, mod in root.named_modules():
        prefix = ".".join(p for p in (base, path) if p)
        stacked = isinstance(mod, RoutedExperts)
        own = [*mod._parameters.items(),
               *((a, t) for a, t in mod._buffers.items() if a not in mod._non_persistent_buffers_set)]
        attrs = [(a, a in mod._buffers, expert_names(prefix, a, t.shape[0]) if stacked else [f"{prefix}.{a}"])
                 for a, t in own if t is not None]
        if attrs:
            wanted.append((mod, attrs, stacked))
    missing = [n for _, attrs, _ in wanted for *_, names in attrs for n in names if n not in w]
    if missing:
        raise KeyError(f"the weight store lacks {sorted(missing)[:3]}")
    for mod, attrs, stacked in wanted:
        got = _stacked(w, attrs, device) if stacked else \
            [_dense(t).to(device) for t in w.get_many([names[0] for *_, names in attrs])]
        for (attr, buffer, names), t in zip(attrs, got):
            old = getattr(mod, attr)
            if tuple(t.shape) != tuple(old.shape):
                raise ValueError(f"{names[0]}: the store holds {tuple(t.shape)}, the module expects "
                                 f"{tuple(old.shape)}")
            if buffer:
                mod._buffers[attr] = t
            else:
                mod._parameters[attr] = nn.Parameter(t, requires_grad=old.requires_grad)
    cut = len(base) + 1 if base else 0
    for n in nodes:
        for local, fmt in n.op.quant:
            act = QUANT_FORMATS[fmt][1]
            if act:
                module = f"{n.path}.{local.rsplit('.', 1)[0]}"
                _quantize_input(root, module[cut:], act, w.get(f"{module}.input_scale").to(device))


#: bytes of a layer's experts read at a time into their stacked tensors (a sixteenth of them, at least 8 MiB)
STACK_CHUNK_BYTES = 64 << 20


def _stacked(w: WeightStore, attrs: list, device) -> list[torch.Tensor]:
    """Each attribute's per-expert tensors stacked, read straight into the stacked tensors a run at a time, each
    run freed before the next is read: the peak is the stacked tensors and a run, where stacking what one read of
    the layer gave held its experts twice. Runs follow the names' order, a checkpoint's (safetensors stores a
    file's tensors by name), so each is one read of its span (`WeightStore.get_many`); what a run holds goes in
    by ranges of consecutive experts (experts 100-109 follow each other by name), one stack each."""
    slot = {n: (k, j) for k, (*_, names) in enumerate(attrs) for j, n in enumerate(names)}
    order = sorted(slot)
    sizes = [w.nbytes(names[0]) for *_, names in attrs]
    run = max(1, min(STACK_CHUNK_BYTES, max(8 << 20, sum(sizes) * len(attrs[0][2]) // 16)) // max(1, max(sizes)))
    out = [None] * len(attrs)
    for a in range(0, len(order), run):
        names, got = order[a:a + run], {}
        for n, t in zip(names, w.get_many(names)):
            got.setdefault(slot[n][0], []).append((slot[n][1], _dense(t)))
        for k, items in got.items():
            items.sort(key=lambda item: item[0])
            if out[k] is None:
                out[k] = torch.empty((len(attrs[k][2]), *items[0][1].shape), dtype=items[0][1].dtype, device=device)
            first = 0
            for e in range(1, len(items) + 1):
                if e < len(items) and items[e][0] == items[e - 1][0] + 1:
                    continue
                into, parts = out[k][items[first][0]:items[e - 1][0] + 1], [t for _, t in items[first:e]]
                if into.device == parts[0].device:
                    torch.stack(parts, out=into)
                else:  # onto the device: one copy of the range
                    into.copy_(torch.stack(parts))
                first = e
        del got, items, parts
    return out


def load_tensors(module: nn.Module, tensors: dict, device=None) -> nn.Module:
    """Loads a module built from a spec from tensors under the checkpoint's names (relative to the module),
    as `load_into` loads from a store; a name the module does not hold is an error too."""
    store = WeightStore()
    store.update(tensors)
    load_into(module, store, device or next((t.device for t in tensors.values()), "cpu"), [])
    extra = set(tensors) - set(checkpoint_state(module))
    if extra:
        raise KeyError(f"the module holds no {sorted(extra)[:3]}")
    return module


def checkpoint_state(module: nn.Module) -> dict:
    """The module's state dict under the checkpoint's names: routed experts one tensor (a view) per expert."""
    return split_experts(module.state_dict())


def _dense(t):
    return t if isinstance(t, torch.Tensor) else t.dequantize()


def _quantize_input(root: nn.Module, path: str, fmt: str, scale: torch.Tensor) -> None:
    """Fake-quantises the input of the module at `path` by its static `scale`, held as the module's buffer
    `input_scale` (not saved: the checkpoint holds it under the same name), so that an export names it as the
    module's own tensor and a layer's graph serves every layer of its kind (backends.onnx.pieces)."""
    from ...ir.quant.formats import fake_quantize

    if ".experts." in path:  # routed experts run inside their mixer: one scale per side, the largest
        mixer_path, rest = path.split(".experts.", 1)
        side = "up" if rest.endswith("up_proj") else "down"
        mixer = root.get_submodule(mixer_path)
        old = getattr(mixer, f"input_scale_{side}", scale)
        mixer.register_buffer(f"input_scale_{side}", torch.maximum(old, scale), persistent=False)
        mixer.__dict__.setdefault("expert_act", {})[side] = fmt
        return
    module = root.get_submodule(path)
    module.register_buffer("input_scale", scale, persistent=False)
    module.register_forward_pre_hook(lambda m, args: (fake_quantize(args[0], fmt, m.input_scale),))


def materialize(prog: Program, dtype: torch.dtype | None = None, compute: Compute | None = None,
                inference: bool = False) -> ProgramModule:
    """A runnable module with the program's weights (meta weights give a meta-device module), on
    `compute`'s device, its forward in `compute`'s precision; `dtype` casts the weights themselves.
    `inference`: the weights autocast would cast are held in the forward's dtype (see `hold_in`)."""
    compute = compute or CPU
    meta = prog.is_meta
    m = ProgramModule(prog, device="meta" if meta else compute.device)
    if not meta:
        m.compute = compute  # its dtype too
        load_weights(m)
    if dtype is not None:
        m.to(dtype)
    elif inference:
        hold_in(m, compute.dtype)
    return m.eval()


def hold_in(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Casts once what autocast casts on every call, the Linear, Conv1d and routed experts' weights, to the
    forward's `dtype`: the same numbers without a cast of every weight in every forward. For inference: an
    optimizer steps float32 master weights. Norms, routers and the embedding stay as stored (autocast leaves
    them too), and so do static activation scales (buffers: the engines quantize by float32 scales)."""
    if dtype != torch.float32:
        for m in module.modules():
            if isinstance(m, (nn.Linear, nn.Conv1d, RoutedExperts)):
                for p in m.parameters(recurse=False):
                    p.data = p.data.to(dtype)
    return module


def random_weights(prog: Program, seed: int = 0, dtype: torch.dtype = torch.float32, std: float = 0.02) -> Program:
    """Fills the program's store with a fresh reference initialisation (as Nemotron-H initialises)."""
    g = torch.Generator().manual_seed(seed)
    for n in prog.nodes:
        for local, shape in n.op.params().items():
            name = f"{n.path}.{local}"
            leaf = local.rsplit(".", 1)[-1]
            if leaf == "A_log":
                t = torch.log(torch.arange(1, shape[0] + 1, dtype=torch.float32))
            elif leaf == "D" or local.endswith("norm.weight") or n.op.kind == "norm":
                t = torch.ones(shape)
            elif leaf == "dt_bias":
                dt = torch.exp(torch.rand(shape, generator=g) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
                t = dt + torch.log(-torch.expm1(-dt))
            elif leaf in ("e_score_correction_bias",) or leaf == "bias":
                t = torch.zeros(shape)
            else:
                t = torch.randn(shape, generator=g) * std
            fp32 = local in n.op.fp32_params()
            prog.weights.set(name, t.to(torch.float32 if fp32 else dtype))
    return prog
