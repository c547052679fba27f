"""Parallel layouts: how one model is spread over a node's GPUs, as serving engines run it.

A layout has four degrees (NVIDIA's AIConfigurator searches the same ones for TensorRT-LLM):

- `tp`, tensor parallel: attention, Mamba, dense layers and the MoE's shared parts split by heads or
  columns over `tp` devices, with an all-reduce of each block's output;
- `dp`, attention data parallel: `dp` groups of `tp` devices each serve their own requests with their own
  copy of the non-expert weights; the routed experts are shared by all `tp x dp` devices;
- `ep`, expert parallel: the routed experts are spread whole over `ep` devices; the other `tp x dp / ep`
  split each expert's width (with `ep = 1` every device holds a slice of every expert);
- `replicas`: independent copies of all of the above, each serving its own requests.

Text form: `tp8`, `tp8.ep8`, `tp1.dp8.ep8`, `tp2.r4` (`str` and `Layout.parse` round-trip).

The layouts follow the model: one serving no routed experts (a dense Nemotron-H) has `ep` and `dp` 1, only
`tp` and replicas (`layouts(gpus, experts=False)`, `no_experts_refusal` for a layout given by hand).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..errors import UsageError

_FORM = re.compile(r"tp(\d+)(?:\.dp(\d+))?(?:\.ep(\d+))?(?:\.r(\d+))?")


class LayoutError(UsageError):
    """A layout written wrong or not a layout at all: the user's input, so exit 2."""


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    dp: int = 1
    ep: int = 1
    replicas: int = 1

    @property
    def group(self) -> int:
        """Devices of one replica: they share the routed experts."""
        return self.tp * self.dp

    @property
    def gpus(self) -> int:
        return self.group * self.replicas

    def __str__(self) -> str:
        return ".".join([f"tp{self.tp}"] + [f"{k}{v}" for k, v in (("dp", self.dp), ("ep", self.ep),
                                                                    ("r", self.replicas)) if v > 1])

    @classmethod
    def parse(cls, text: str) -> Layout:
        m = _FORM.fullmatch(text.strip())
        if not m:
            raise LayoutError(f"layout {text!r}: write tp<N>[.dp<N>][.ep<N>][.r<N>], e.g. tp8, tp8.ep8, "
                                 "tp1.dp8.ep8 or tp2.r4")
        return cls(*(int(g) if g else 1 for g in m.groups())).check()

    def check(self) -> Layout:
        if min(self.tp, self.dp, self.ep, self.replicas) < 1:
            raise LayoutError(f"layout {self}: every degree must be >= 1")
        if self.group % self.ep:
            raise LayoutError(f"layout {self}: ep={self.ep} must divide tp x dp = {self.group}")
        if self.dp > 1 and self.ep != self.group:
            raise LayoutError(f"layout {self}: attention data parallel feeds expert-parallel experts; use "
                                 f"ep{self.group} (tp x dp)")
        return self

    # -- what one device holds ------------------------------------------------------------------------------
    def shards(self, op, param: str) -> int:
        """Over how many devices a parameter of `op` is split (the rest of the replica holds copies): routed
        experts over the whole replica, K/V projections over at most the KV heads, the rest over `tp`."""
        return self.class_shards(shard_class(op, param))

    def class_shards(self, cls: tuple) -> int:
        """Over how many devices the parameters of a `shard_class` are split."""
        op, kind = cls
        return self.group if kind == "experts" else self.kv_shards(op) if kind == "kv" else self.tp

    def kv_shards(self, op) -> int:
        """KV heads cannot be split below one per device: with tp > KV heads each head is replicated."""
        return min(self.tp, op.kv_heads)

    def state_bytes(self, op, kv_bytes: float, ssm_bytes: float, act_bytes: float, context: int,
                    ssm_copies: int = 1) -> float:
        """One request's decode state held by one device of its attention group. With speculative decoding a
        Mamba layer keeps `ssm_copies` states (one per verified position, to resume from the accepted one)."""
        if op.kind == "mtp":
            return op.hidden * act_bytes + sum(self.state_bytes(b, kv_bytes, ssm_bytes, act_bytes, context)
                                               for b in op.blocks)
        total = op.state_bytes(kv_bytes, ssm_bytes, act_bytes, context) * (ssm_copies if op.kind == "mamba2" else 1)
        return total / (self.kv_shards(op) if op.kind == "attention" else self.tp)

    def requests_per_group(self, requests: float) -> int:
        """Requests one attention group serves when a replica serves `requests`."""
        return math.ceil(requests / self.dp)


def shard_class(op, param: str) -> tuple:
    """What decides how a parameter is split, whatever the layout: (the op holding it, "experts" for routed
    experts, "kv" for K/V projections, "tp" for the rest)."""
    op, param = _inner(op, param)
    if param.startswith("mixer.experts."):
        return op, "experts"
    if op.kind == "attention" and param.split(".")[1] in ("k_proj", "v_proj"):
        return op, "kv"
    return op, "tp"


def _inner(op, param: str):
    """An MTP head's parameter as its block's (layers.{i}.<block param>), else as it is."""
    if op.kind != "mtp" or not param.startswith("layers."):
        return op, param
    _, i, rest = param.split(".", 2)
    i = int(i)
    return (op.blocks[i], rest) if i < len(op.blocks) and rest.startswith("mixer.") else (op, rest)


def layouts(gpus: int, *, experts: bool) -> list[Layout]:
    """Every layout of `gpus` devices for a model that serves routed experts (`experts`) or not: replicas
    dividing the count; per replica, each split of its devices into tp x dp, with experts tensor parallel
    (ep = 1, only without attention data parallel) or spread over the whole replica.

    Without routed experts only tp x replicas: `ep` has nothing to spread, and attention data parallel is there
    in the engines to feed expert-parallel MoE (see `no_experts_refusal`); over dense layers it is replicas."""
    out = []
    for r in _divisors(gpus):
        g = gpus // r
        for tp in reversed(_divisors(g)):
            dp = g // tp
            if not experts:
                out += [Layout(tp, replicas=r)] if dp == 1 else []
                continue
            for ep in sorted({1, g} if dp == 1 else {g}):
                out.append(Layout(tp, dp, ep, r))
    return out


def no_experts_refusal(layout: Layout, none: str = "the model has none") -> str:
    """Why `layout` means nothing for a model that serves no routed experts, or "" (ep and dp 1).

    `ep` spreads routed experts. Attention data parallel exists in the engines to feed expert-parallel MoE;
    over dense layers it is replicas, or a split no layout here prices:
    - vLLM (docs/serving/data_parallel_deployment.md): DP ranks are separate engines, "not completely
      independent" only for MoE (the experts' forward is synchronised); `--enable-expert-parallel` acts on
      `FusedMoE` layers alone;
    - TensorRT-LLM: `enable_attention_dp` gives each rank its own requests with attention at tp 1 (KV cache
      `tp_size = 1 if mapping.enable_attention_dp`) and NemotronH's embedding unsplit with no all-reduce
      (`_torch/models/modeling_nemotron_h.py`: "we cannot do all_reduce since the problem size of different
      ranks are different"); features/parallel-strategy.md gives dense FFNs tensor parallel only, EP to MoE;
    - SGLang: `--enable-dp-attention` gathers the groups' tokens into a dense MLP tensor parallel over all
      ranks (`srt/models/nemotron_h.py`, its `LayerCommunicator`), which `dp` here (a copy per group) is not.
    The fix named is the layout of the same devices without them: its attention groups as replicas."""
    if layout.ep == 1 and layout.dp == 1:
        return ""
    same = Layout(layout.tp, replicas=layout.dp * layout.replicas)
    what = f"spreads routed experts over ep{layout.ep}" + (
        f" and runs {layout.dp} attention data-parallel groups to feed them" if layout.dp > 1 else "")
    return (f"layout {layout} {what}, and {none}; use {same}"
            + (f" (its {layout.dp} attention groups as replicas)" if layout.dp > 1 else "")
            + ", or leave the layout out to price the best one")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def split_refusal(op, layout, recipes: str = "", replicated_groups: bool = True) -> str:
    """Why `op` does not split over `layout` the way the engines split it when they load it (each asserts
    these), or "": Mamba heads by tp, and groups by tp unless one group is replicated (vLLM's `MambaMixer2`,
    unquantized only; `replicated_groups=False` for TensorRT-LLM, whose `Mamba2Mixer` takes `n_groups // tp_size`
    with no replication); attention query heads by tp and KV heads by tp or tp by them (then replicated); dense
    and shared-expert widths by tp; an expert's width by the devices that split it (tp x dp / ep)."""
    tp = layout.tp
    if op.kind == "mtp":
        return next((why for b in op.blocks if (why := split_refusal(b, layout, recipes, replicated_groups))), "")
    quantized = "fp8" in recipes or "nvfp4" in recipes
    if op.kind == "mamba2":
        if op.heads % tp:
            return f"{op.heads} Mamba heads over tp{tp}"
        if op.groups % tp and (op.groups > 1 or quantized or not replicated_groups):
            why = "one group is replicated, unquantized only" if replicated_groups else \
                "TensorRT-LLM splits groups as n_groups // tp, never replicated"
            return f"{op.groups} Mamba groups over tp{tp} ({why})"
    if op.kind == "attention":
        if op.q_heads % tp:
            return f"{op.q_heads} query heads over tp{tp}"
        if op.kv_heads % tp and tp % op.kv_heads:
            return f"{op.kv_heads} KV heads over tp{tp} (neither divides the other)"
    if op.kind == "mlp" and op.d_ff % tp:
        return f"MLP width {op.d_ff} over tp{tp}"
    if op.kind == "moe":
        split = layout.group // layout.ep
        if op.d_ff % split:
            return f"expert width {op.d_ff} over the {split} devices that split each expert"
        if op.shared_d_ff % tp:
            return f"shared expert width {op.shared_d_ff} over tp{tp}"
    return ""
