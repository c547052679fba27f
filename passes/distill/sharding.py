"""How the student and the teacher are built for a run and spread over the processes: FSDP2 sharding
(`shard_model`, its availability check), activation checkpointing (`checkpoint_blocks`), the model
building (`_build`) and gathering whole tensors back (`full_state`). Kept apart from the run: the only
module that knows about FSDP."""
from __future__ import annotations

from collections.abc import Iterator

import torch

from ...backends.torch.device import Compute
from ...ir import Program
from ...ir.ops.routed import RoutedExperts, split_experts
from ..core import PassError

# -- sharding, activation checkpointing ------------------------------------------------------------------------
SHARDS = ("auto", "ddp", "fsdp")


def _reshard(*models) -> None:
    """Frees the unsharded parameters FSDP keeps after a forward without a backward (an evaluation)."""
    for m in models:
        if m is not None and hasattr(m, "reshard"):
            m.reshard()


def _mtp_layers(model) -> list:
    return [layer for n in model.program.nodes if n.op.kind == "mtp" for layer in model.get_submodule(n.path).layers]


def checkpoint_blocks(model) -> None:
    """Activation checkpointing: each residual block (the trunk's and the MTP head's) keeps only its input
    in the forward and recomputes the rest in the backward (`torch.utils.checkpoint`, non-reentrant: the
    same numbers, the RNG and autocast state replayed). Forward hooks (`_capture`) see each output once."""
    from torch.utils.checkpoint import checkpoint

    for m in [model.get_submodule(n.path) for n in model.program.blocks()] + _mtp_layers(model):
        def run(*args, _forward=m.forward, **kw):
            if not torch.is_grad_enabled():  # evaluation, the teacher: nothing to save for
                return _forward(*args, **kw)
            return checkpoint(_forward, *args, use_reentrant=False, **kw)
        m.forward = run


def shard_model(model, mesh) -> None:
    """FSDP2 over `mesh`: one group per trunk block and per MTP-head block's mixer, then the root group
    with everything else. Shared parameters stay whole in the root group: the embedding (which a tied LM
    head and the MTP head use by reference), the LM head (the MTP head's too), the final norm, and the MTP
    head's own fusion norms, projection and final norm, which its forward calls outside its blocks.
    Parameters become this process's float32 shards (copies: the weight store is never written); a frozen
    model's (the teacher's) matmul weights are held in the compute dtype (`hold_frozen`). A model
    built on the meta device is loaded one group at a time, each group sharded before the next is read, so
    a process never holds more than its shards and one block in full.

    Below float32 the student's block groups gather their parameters in the compute dtype and reduce the
    gradients in float32 (`block_policy`); the root group stays float32 (the embedding starts the float32
    residual stream). A model whose `offload` is set keeps its shards (and so their gradients and optimizer
    state) in host memory (FSDP2's CPUOffloadPolicy; pinned where CUDA is)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard, register_fsdp_forward_method

    has = lambda m: any(True for _ in m.parameters())
    train = any(p.requires_grad for p in model.parameters())
    offload = {"offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available())} \
        if getattr(model, "offload", False) else {}
    policy = {**(block_policy(model.compute) if train else {}), **offload}
    for n in model.program.blocks():
        m = _loaded(model, n)
        if has(m):
            fully_shard(m, mesh=mesh, **policy)
    for n in model.program.find("mtp"):
        _loaded(model, n)
    for layer in _mtp_layers(model):
        if hasattr(layer, "mixer") and has(layer.mixer):
            fully_shard(layer.mixer, mesh=mesh, **policy)
    for n in model.program.nodes:
        _loaded(model, n)
    fully_shard(model, mesh=mesh, **offload)
    # routed experts no token chose on some rank get no gradient there: every rank reduce-scatters a zero
    # gradient for them instead, so the collectives match (as DDP's find_unused_parameters)
    model.set_reduce_scatter_unused_params(True)
    for name in ("values", "prefill", "decode"):  # called without forward(): FSDP must still gather the root
        register_fsdp_forward_method(model, name)


def block_policy(compute: Compute) -> dict:
    """fully_shard's keywords for a trained block group: below float32, parameters gathered (and the block
    computed) in the compute dtype, gradients reduced in float32 into the float32 master shards. The
    block's inputs are not cast: the residual stream stays float32, as without FSDP."""
    if compute.dtype == torch.float32:
        return {}
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return {"mp_policy": MixedPrecisionPolicy(param_dtype=compute.dtype, reduce_dtype=torch.float32,
                                              cast_forward_inputs=False)}


def hold_frozen(module: torch.nn.Module, fp32: frozenset[str], dtype: torch.dtype) -> None:
    """Holds a frozen module (the teacher) in the compute `dtype` where autocast would cast anyway: the
    weights of its linear layers and convolutions, except the ops' float32 parameters (`fp32`: routers,
    named relative to `module`); everything else (norms, biases, the embedding, SSM parameters) in float32.
    The forward's numbers under autocast are the float32 model's, in half the memory."""
    low = {f"{name}.{p}" if name else p for name, m in module.named_modules() for p in m._parameters
           if isinstance(m, (torch.nn.Linear, torch.nn.Conv1d, RoutedExperts)) and p != "bias"} - set(fp32)
    for name, p in module.named_parameters():
        want = dtype if name in low else torch.float32
        if p.dtype != want:
            p.data = p.data.to(want)


def block_groups(model, node) -> list[torch.nn.Module]:
    """The modules of `node` that `shard_model` shards as groups of their own: a block, or the MTP head's
    layers' mixers (nothing for the embedding, final norm, LM head and the head's fusion layers)."""
    m = model.get_submodule(node.path)
    if node.op.kind == "mtp":
        return [layer.mixer for layer in m.layers if hasattr(layer, "mixer")]
    return [m] if node.op.is_block else []


def hold_trained(modules, dtype: torch.dtype) -> None:
    """params=bf16: every parameter of `modules` (`block_groups`) held in `dtype` (so are their gradients);
    buffers stay as they are. One dtype per FSDP group, as FSDP2 requires of trained parameters."""
    for m in modules:
        for p in m.parameters():
            if p.dtype != dtype:
                p.data = p.data.to(dtype)


class _FP8(torch.nn.Module):
    """A frozen weight held as FP8 E4M3 (the parametrization's `original`, its bytes as uint8: gloo gathers
    no float8 for FSDP) with its float32 scale (per tensor; per expert for stacked experts): each use
    dequantises it (q * scale) in `dtype`, the product's dtype."""

    def __init__(self, scale: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        self.register_buffer("scale", scale)

    def forward(self, q):
        return q.view(torch.float8_e4m3fn).to(self.dtype) * self.scale.to(self.dtype)


def hold_fp8(module: torch.nn.Module, fp32: frozenset[str], dtype: torch.dtype) -> None:
    """teacher_dtype=fp8: the weights of a frozen module's linear layers, convolutions and routed experts
    (as `hold_frozen`, the same exceptions) held in FP8 E4M3 with per-tensor scales (the project's FP8 weight
    format, ir.quant.formats), dequantised to `dtype` at each use: a byte per weight instead of two."""
    from torch.nn.utils import parametrize

    from ...ir.quant.formats import quantize_fp8

    for name, m in list(module.named_modules()):
        if not isinstance(m, (torch.nn.Linear, torch.nn.Conv1d, RoutedExperts)):
            continue
        for attr, p in list(m._parameters.items()):
            if p is None or attr == "bias" or (f"{name}.{attr}" if name else attr) in fp32:
                continue
            q = quantize_fp8(p.detach().float(), axis=0 if isinstance(m, RoutedExperts) else None,
                             name=f"{name}.{attr}")
            parametrize.register_parametrization(m, attr, _FP8(q.scale.to(p.device), dtype), unsafe=True)
            # (a parametrization may not change the dtype when registered: the FP8 tensor replaces it after)
            m.parametrizations[attr].original = torch.nn.Parameter(q.data.view(torch.uint8), requires_grad=False)


def fp32_names(prog: Program) -> frozenset[str]:
    """The ops' float32 parameters (`OpSpec.fp32_params`) by their names in the whole model."""
    return frozenset(f"{n.path}.{local}" for n in prog.nodes for local in n.op.fp32_params())


def _loaded(model, node):
    """The node's module, its weights read from the program's store (in float32; a frozen model's matmul
    weights in the compute dtype, see hold_frozen) if it is still on meta."""
    from ...backends.torch import load_into

    m = model.get_submodule(node.path)
    if any(p.is_meta for p in m.parameters()):
        train = any(p.requires_grad for p in m.parameters())
        load_into(m, model.program.weights, "cpu", [node], node.path)
        m.float().requires_grad_(train)
        if not train and model.compute.dtype != torch.float32:
            hold_frozen(m, node.op.fp32_params(), model.compute.dtype)
        if train and getattr(model, "params", torch.float32) != torch.float32:
            hold_trained(block_groups(model, node), model.params)
        if not train and getattr(model, "fp8", False):
            hold_fp8(m, node.op.fp32_params(), model.compute.dtype)
    return m


def _fsdp_available() -> None:
    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard  # noqa: F401
    except ImportError:
        raise PassError(f"distill: shard=fsdp needs PyTorch's FSDP2 (torch.distributed.fsdp.fully_shard), which "
                        f"torch {torch.__version__} lacks; use shard=ddp or a newer torch") from None
    if not hasattr(FSDPModule, "set_reduce_scatter_unused_params"):
        raise PassError(f"distill: shard=fsdp needs FSDPModule.set_reduce_scatter_unused_params (routed experts "
                        f"without tokens) and torch {torch.__version__} lacks it; use shard=ddp or a newer torch")


def _build(prog: Program, compute: Compute, mesh, train: bool, checkpointing: bool, params: str = "fp32",
           offload: bool = False, teacher_dtype: str = "auto"):
    """The student (`train`: its own float32 copies of the weights; `params` bf16: its blocks' in bfloat16,
    see hold_trained) or the teacher (frozen; below float32 its matmul weights held in the compute dtype;
    `teacher_dtype` fp8: in FP8, see hold_fp8), sharded over `mesh` when there is one (`offload`: the
    shards in host memory)."""
    from ...backends.torch import materialize

    held = {"fp32": torch.float32, "bf16": torch.bfloat16}[params] if train else torch.float32
    if held != torch.float32 and compute.dtype != held:
        name = lambda t: str(t).removeprefix("torch.")
        raise PassError(f"distill: params={params} holds the blocks' weights in {name(held)}, which a "
                        f"{name(compute.dtype)} forward cannot use; run with --dtype bfloat16 (the default on CUDA) "
                        "or params=fp32")
    fp8 = not train and teacher_dtype == "fp8"
    if mesh is None and not train and compute.dtype != torch.float32:
        m = materialize(prog, compute=compute)  # in the store's dtype, then each weight cast once
        hold_frozen(m, fp32_names(prog), compute.dtype)
    elif mesh is None:
        m = materialize(prog, dtype=torch.float32, compute=compute)
        if train:
            for param in m.parameters():  # the store's tensors are shared with the teacher and snapshots:
                param.data = param.data.clone()  # training must update copies
            hold_trained([g for n in prog.nodes for g in block_groups(m, n)], held)
    else:  # on meta: shard_model reads one block at a time, shards it and moves the shards to the device
        from ...backends.torch import ProgramModule

        m = ProgramModule(prog, device="meta")
        m.compute, m.params, m.offload, m.fp8 = compute, held, offload, fp8
    if mesh is None and fp8:
        hold_fp8(m, fp32_names(prog), compute.dtype)
    m.requires_grad_(train)
    if train and checkpointing:
        checkpoint_blocks(m)
    if mesh is not None:
        shard_model(m, mesh)
    return m


def full_state(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, the whole tensor) for the model's state dict, one tensor gathered at a time (sharded ones on
    every process: a collective, so every process must iterate)."""
    for name, t in model.state_dict().items():
        yield from split_experts({name: _on_mesh(t).full_tensor() if hasattr(t, "full_tensor") else t}).items()


def _on_mesh(t):
    """A DTensor whose shard is in host memory (offload) with its shard on the mesh's device, which the
    collectives use."""
    local = t.to_local()
    kind = t.device_mesh.device_type
    if local.device.type == kind:
        return t
    from torch.distributed.tensor import DTensor

    device = torch.device(kind, torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)
    return DTensor.from_local(local.to(device), t.device_mesh, t.placements, run_check=False, shape=t.shape,
                              stride=t.stride())
