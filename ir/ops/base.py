"""What every op kind provides: typed attributes, parameter shapes, states, checks and a torch module."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from dataclasses import dataclass, fields
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..quant.formats import QUANT_FORMATS


@dataclass(frozen=True)
class OpSpec:
    """An immutable, typed description of one node; subclasses add their attributes as fields.

    `quant` records which 2-D weights are quantised and how: ((parameter, format), ...), sorted.
    """

    quant: tuple = dataclasses.field(default=(), kw_only=True)

    kind: ClassVar[str] = ""
    letter: ClassVar[str] = ""  # the Nemotron-H layer-pattern letter (M, E, *, -); none for the other kinds
    #: roles of the node's inputs: "hidden" ([B, T, hidden] float) or "ids" ([B, T] integer)
    inputs: ClassVar[tuple[str, ...]] = ("hidden",)
    #: True for residual blocks (one per layer, named backbone.layers.{i})
    is_block: ClassVar[bool] = False

    def __post_init__(self):
        """Attributes must have their declared types (ints stay ints, floats accept ints)."""
        object.__setattr__(self, "quant", tuple(sorted((str(k), str(v)) for k, v in dict(self.quant).items())))
        for f in fields(self):
            v, t = getattr(self, f.name), f.type
            if t == "int" and (not isinstance(v, int) or isinstance(v, bool)):
                raise TypeError(f"{self.kind} attribute {f.name} must be an int, got {v!r}")
            if t == "bool" and not isinstance(v, bool):
                raise TypeError(f"{self.kind} attribute {f.name} must be a bool, got {v!r}")
            if t == "float":
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise TypeError(f"{self.kind} attribute {f.name} must be a number, got {v!r}")
                try:
                    object.__setattr__(self, f.name, float(v))
                except OverflowError:
                    raise TypeError(f"{self.kind} attribute {f.name} is too large for a float: {v}") from None

    def replace(self, **changes) -> OpSpec:
        return dataclasses.replace(self, **changes)

    def attrs(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    # -- parameters ---------------------------------------------------------------------------
    def params(self) -> dict[str, tuple[int, ...]]:
        """Local parameter names (relative to the node path) and their shapes."""
        return {}

    def stored_params(self) -> dict[str, tuple[int, ...]]:
        """params() plus the static activation scale (`<module>.input_scale`, a scalar) of every weight
        whose format quantises its input."""
        p = dict(self.params())
        for k, fmt in self.quant:
            if QUANT_FORMATS.get(fmt, (None, None))[1]:
                p[k.rsplit(".", 1)[0] + ".input_scale"] = ()
        return p

    def param_count(self) -> int:
        """All parameters (counted once per spec: a 512-expert MoE lists a thousand tensors)."""
        return _param_count(self)

    def active_params(self) -> int:
        """Parameters touched per token (differs from the total only for routed experts)."""
        return self.param_count()

    def fp32_params(self) -> frozenset[str]:
        """Parameters kept in float32 whatever the model dtype (router weights, biases)."""
        return frozenset()

    # -- per-sequence state ---------------------------------------------------------------------
    def state_shapes(self) -> dict[str, tuple]:
        """Decode state per sequence: name -> shape with "B" for batch and "L" for the context length."""
        return {}

    # -- checks ---------------------------------------------------------------------------------
    def check(self) -> list[tuple[str, str]]:
        """Inconsistencies as (attribute, message); empty when the spec is sound."""
        out = []
        shapes = self.params()
        for k, fmt in self.quant:
            if fmt not in QUANT_FORMATS:
                out.append(("quant", f"{k}: unknown format {fmt!r}; known: {', '.join(QUANT_FORMATS)}"))
            elif k not in shapes or len(shapes[k]) != 2:
                out.append(("quant", f"{k}: not a 2-D parameter of this op"))
            elif fmt.startswith("nvfp4") and shapes[k][1] % 16:
                out.append(("quant", f"{k}: NVFP4 needs its input dimension {shapes[k][1]} to be a multiple of 16"))
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type in ("int",) and isinstance(v, int) and not isinstance(v, bool) and v < 0:
                out.append((f.name, f"must be >= 0, got {v}"))
            if f.type == "float" and not math.isfinite(v) and not (v == math.inf and f.default == math.inf):
                out.append((f.name, f"must be finite, got {v}"))
            elif f.name == "eps" and v <= 0:
                out.append((f.name, f"must be > 0 (an RMSNorm epsilon), got {v}"))
        return out

    def state_bytes(self, kv_bytes: float, ssm_bytes: float, act_bytes: float, context: int) -> float:
        """Decode state per sequence at `context` tokens, in bytes."""
        return 0.0

    def work(self, batch: int, tokens: int, context: int, decode: bool, kv_bytes: float, ssm_bytes: float,
             act_bytes: float, routing=None) -> Work:
        """Work of one step over `batch` sequences of `tokens` new tokens each, `context` tokens before them."""
        raise NotImplementedError(f"op {self.kind!r} does not report its work")

    def build(self) -> nn.Module:
        raise NotImplementedError(f"op {self.kind!r} has no reference module")

    # -- structured pruning -------------------------------------------------------------------------
    def axes(self) -> dict[str, Axis]:
        """The axes the block can shrink along (Puzzle's block library varies them per layer)."""
        return {}

    def shrink(self, axis: str, keep, weights: dict) -> tuple[OpSpec, dict]:
        """The spec and local weights keeping only the `keep` units of `axis`, in that order.

        `keep` lists unit indices (see `Axis`); keeping every unit, in any order the axis allows,
        reproduces the block's function. Implemented per op by `_shrink(axis, keep, weights)`."""
        ax = self.axes().get(axis)
        if ax is None:
            raise ValueError(f"{self.kind} has no axis {axis!r}; its axes: {', '.join(self.axes()) or 'none'}")
        return self._shrink(axis, ax.validate(axis, keep), dict(weights))

    def resized(self, axis: str, n: int) -> OpSpec:
        """The spec keeping `n` units of `axis` (shapes only: what `shrink` gives, without weights)."""
        return self.replace(**{axis: n})

    def _shrink(self, axis: str, keep: torch.Tensor, weights: dict) -> tuple[OpSpec, dict]:
        raise NotImplementedError


@dataclass(frozen=True)
class Axis:
    """A prunable axis: `size` units, kept in equal numbers in each of `groups` consecutive groups and listed
    group by group (Mamba heads share B/C per group; query heads belong to a KV head). `per_unit`
    axes (an expert's d_ff) also take one row of indices per unit of `per_unit`. An unranked axis (top-k,
    merging KV heads) depends only on how many units are kept: keep `range(n)`.
    Axes are listed in the order a variant applies them: inner axes first, so that every keep refers to
    the parent's unit indices."""

    size: int
    groups: int = 1
    per_unit: str = ""
    ranked: bool = True

    def validate(self, name: str, keep) -> torch.Tensor:
        k = torch.as_tensor(keep)
        if k.is_floating_point() or k.dtype == torch.bool or k.dim() not in (1, 2) or k.shape[-1] == 0:
            raise ValueError(f"{name}: keep a non-empty list of unit indices, got {keep!r}")
        if k.dim() == 2 and not self.per_unit:
            raise ValueError(f"{name}: one list of indices is kept for the whole block, got {tuple(k.shape)}")
        k = k.long()
        rows = k if k.dim() == 2 else k[None]
        n = rows.shape[-1]
        if int(rows.min()) < 0 or int(rows.max()) >= self.size:
            raise ValueError(f"{name}: indices must lie in [0, {self.size}), got {rows.min()}..{rows.max()}")
        if any(len(set(r.tolist())) != n for r in rows):
            raise ValueError(f"{name}: indices repeat")
        if n % self.groups:
            raise ValueError(f"{name}: keeps {n} units, not a multiple of its {self.groups} groups")
        if self.groups > 1:
            per = self.size // self.groups
            if not bool((rows // per == torch.arange(n) // (n // self.groups)).all()):
                raise ValueError(f"{name}: keep {n // self.groups} units of each of the {self.groups} groups, "
                                 "listed group by group")
        return k


def positive(spec, *names) -> list[tuple[str, str]]:
    return [(n, f"must be > 0, got {getattr(spec, n)}") for n in names if getattr(spec, n) <= 0]


# -- shared torch pieces -------------------------------------------------------------------------
def full_precision(x: torch.Tensor):
    """Autocast off: a float32 section inside a mixed-precision forward (the SSM scan, MoE routing).
    Nothing at all outside autocast, so that exported graphs stay plain."""
    if not torch.is_autocast_enabled(x.device.type):
        return contextlib.nullcontext()
    return torch.autocast(x.device.type, enabled=False)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, weight applied in float32, cast back (Nemotron-H convention)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


def use_export_form(module: nn.Module) -> nn.Module:
    """Switches every op module under `module` whose eager kernel is not what exporters and engines take
    (routed MoE, fused attention, the sequential scan) to its export form: the same function as plain tensor
    ops without data-dependent shapes, loops or fused-attention ops. For torch.export and ONNX only."""
    for m in module.modules():
        if hasattr(m, "export_form"):
            m.export_form = True
    return module


def relu2(x):
    return F.relu(x).square()


class Block(nn.Module):
    """Pre-norm residual block: x + mixer(norm(x)), threading the mixer's decode state."""

    def __init__(self, spec: OpSpec, norm: nn.Module | None, mixer: nn.Module | None):
        super().__init__()
        self.spec = spec
        if norm is not None:
            self.norm = norm
        if mixer is not None:
            self.mixer = mixer

    def forward(self, x, state=None, decode: bool = False):
        if not hasattr(self, "mixer"):
            return x, ()
        h = self.norm(x) if hasattr(self, "norm") else x
        if getattr(self.mixer, "stateful", False):
            y, state = self.mixer(h, state, decode)
        elif getattr(self.mixer, "mode_aware", False):
            y, state = self.mixer(h, decode), ()
        else:
            y, state = self.mixer(h), ()
        return x + y, state


@dataclass
class Work:
    """Hardware-independent work of one op for one step.

    `weights` maps local parameter names to the elements read (an expert touched with probability p
    counts p times its size); bytes follow from each parameter's precision at costing time.
    `act` counts activation elements read and written; state bytes are per step, all sequences.
    `kernels` is the number of kernel launches a serving engine typically issues for the op.
    """

    flops: float = 0.0
    weights: dict = dataclasses.field(default_factory=dict)
    act: float = 0.0
    state_read: float = 0.0
    state_write: float = 0.0
    kernels: int = 0


@functools.lru_cache(maxsize=1 << 14)
def _param_count(spec) -> int:
    return sum(math.prod(s) for s in spec.params().values())


def dense_weights(spec) -> dict:
    return {k: float(math.prod(s)) for k, s in spec.params().items()}
