"""Engine profiles: what a child must look like for a serving engine to load it, as rules on the search.

A child no engine loads is no deployment, however good its score. vLLM, TensorRT-LLM and SGLang load
`nemotron_h_puzzle` children, each reading some fields per layer and the rest from the top level only, which
must then agree across layers (docs/engines.md has the code each rule was read from):
- all three build Mamba layers and their state caches from the top level (so Puzzle-75B's SSM state is 96 in
  every layer), know only mamba, moe, attention and mlp blocks (no `noop` or `linear`), and load an MTP head
  of one attention and one MoE layer;
- SGLang reads an MLP's width from the top level only and keeps one KV pool shape (KV heads, head size) for
  every attention layer, the MTP head's included; TensorRT-LLM reads per layer only the MoE fields, so
  attention heads and MLP widths agree across layers, and its trtllm-gen MoE routing kernel (the `TRTLLM`
  backend; CUTLASS, the default, falls back) takes top-k <= 8 below 385 experts: the profile assumes that
  backend, so its children load with every one; both build the MTP head's attention (KV) from the top level,
  so under one rule (`tensorrt-llm`, `sglang` and `all` alike) the search prunes the trunk's attention only to a
  shape `mtp-match-attention` can take the head's to, and that pass, which compress runs before the head's
  recovery, prunes the head's alike;
- all three split heads and widths over the tensor-parallel devices and assert that they divide
  (`split_refusal`; TensorRT-LLM's Mamba groups by tp, never replicated): a search over a multi-GPU target keeps
  to the layouts the parent splits over and to the choices that split over the layout chosen;
- under NVFP4 a MoE latent that is cut must stay a multiple of 512 and an expert's width a multiple of the
  16-value scale block.
`all` (the default) admits what every engine loads; `none` lifts every rule (the child may then need
puzzlekit's extended form, which no engine loads).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ...backends.layout import split_refusal
from ...backends.serving_check import trtllm_routing_refusal
from ...ir.nemotron_h_puzzle import MTP_KINDS
from ...ir.quant.formats import NVFP4_BLOCK
from ..core import PassError

#: a rule on one layer's choice: (spec, the parent layer's spec, the recipes priced) -> why it is refused, or "";
#: its docstring is the rule as the report states it
Rule = Callable[[object, object, str], str]


def _nvfp4_latent(spec, parent, recipes: str) -> str:
    """NVFP4 MoE latent a multiple of 512"""
    if "nvfp4" in recipes and spec.kind == "moe" and spec.latent != parent.latent and spec.latent % 512:
        return f"MoE latent {spec.latent} under NVFP4 (its kernels want a multiple of 512)"
    return ""


def _nvfp4_width(spec, parent, recipes: str) -> str:
    """NVFP4 expert width a multiple of 16"""
    if "nvfp4" in recipes and spec.kind == "moe" and spec.d_ff % NVFP4_BLOCK:
        return f"expert width {spec.d_ff} under NVFP4 (it wants a multiple of {NVFP4_BLOCK}, its scale block)"
    return ""


def _routing_top_k(spec, parent, recipes: str) -> str:
    """top-k <= 8 below 385 experts (TensorRT-LLM's trtllm-gen MoE backend)"""
    if spec.kind == "moe" and (spec.experts, spec.top_k) != (parent.experts, parent.top_k):
        return trtllm_routing_refusal(spec)
    return ""


@dataclass(frozen=True)
class EngineProfile:
    """The rules one engine (or every engine, `all`) puts on a child it loads."""

    name: str
    engines: tuple[str, ...]  # the engines that load what the profile admits
    uniform: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (kind, attributes equal in every layer of that kind)
    blocks: tuple[str, ...] | None = None  # block kinds admitted; None: any
    mtp: tuple[str, ...] | None = None  # the MTP head's block kinds; None: any
    rules: tuple[Rule, ...] = ()  # kernel-shape rules on each layer's choice
    head_from_top: bool = False  # some engine builds the head's attention from the top level: mtp-match-attention

    def uniform_groups(self, kinds) -> tuple[str, ...]:
        """The search's uniform groups ("kind.attr+attr") for the block kinds present."""
        return tuple(f"{k}.{'+'.join(attrs)}" for k, attrs in self.uniform if k in kinds)

    def refusal(self, spec, parent, recipes: str = "", head=None) -> str:
        """Why a layer may not take `spec` in place of `parent` (empty: it may). `head`: the model's MTP head,
        whose attention an engine reading attention from the top level builds from the trunk's fields: one rule
        for every such profile, that mtp-match-attention can take the head's attention to the trunk's."""
        if self.blocks is not None and spec.kind not in self.blocks:
            return f"a {spec.kind} block (the engines load {', '.join(self.blocks)} blocks)"
        if spec.kind == "attention" and (why := self.head_cannot_follow(spec, head)):
            return why
        return next((why for rule in self.rules if spec.kind == parent.kind and (why := rule(spec, parent, recipes))),
                    "")

    def head_attention(self, trunk, block) -> tuple[int, int, int]:
        """The (query heads, KV heads, head size) the MTP head's attention `block` must take when the trunk's
        attention is `trunk`: what these engines read from the top level is the trunk's, the rest stays the head's."""
        top = {a for kind, names in self.uniform if kind == "attention" for a in names}
        return tuple(getattr(trunk if a in top else block, a) for a in ("q_heads", "kv_heads", "head_dim"))

    def head_cannot_follow(self, trunk, head) -> str:
        """Why the MTP head's attention cannot be matched to a trunk attention `trunk` (mtp-match-attention merges
        KV heads or drops whole KV groups, nothing else), where an engine builds the head's from the top level."""
        if not self.head_from_top or head is None:
            return ""
        for b in (b for b in head.blocks if b.kind == "attention"):
            q, kv, d = self.head_attention(trunk, b)
            if (q, kv, d) != (b.q_heads, b.kv_heads, b.head_dim) and not head_match_axis(b, q, kv, d):
                return (f"attention of {trunk.q_heads} query / {trunk.kv_heads} KV heads of {trunk.head_dim}: the "
                        f"MTP head's ({b.q_heads} / {b.kv_heads} of {b.head_dim}) cannot follow it "
                        f"({', '.join(self.engines)} build the head's attention from the top level; only merging KV "
                        "heads or dropping whole KV groups reaches another shape)")
        return ""

    def unsplit(self, op, layout, recipes: str = "") -> str:
        """Why `op` does not split over `layout` in this profile's engines ("" : it does, or no engine)."""
        return split_refusal(op, layout, recipes, replicated_groups="TensorRT-LLM" not in self.engines) \
            if self.engines else ""

    def check_parent(self, prog) -> None:
        """Refuses a parent none of whose children this profile admits: an MTP head of another form."""
        head = prog.find("mtp")
        kinds = tuple(b.kind for b in head[0].op.blocks) if head else None
        if self.mtp is not None and kinds is not None and kinds != self.mtp:
            raise PassError(f"engine {self.name}: the model's MTP head has blocks {list(kinds)}, but "
                            f"{', '.join(self.engines)} load a head of {list(self.mtp)}; no child of it can be "
                            "served: use engine none (CLI: --engine none --extended)")
        why = next((w for n in prog.find("attention") if (w := self.head_cannot_follow(n.op, head[0].op))), "") \
            if head else ""
        if why:
            raise PassError(f"engine {self.name}: the parent's own trunk has {why}; no child of it can be served "
                            "by these engines: use --engine vllm (it reads the head's own fields), or engine none")

    def describe(self) -> str:
        """One line for reports: the profile and its rules."""
        if not self.engines:
            return "none (no engine's rules: the child may need puzzlekit's extended form, which no engine loads)"
        rules = [f"{k} {'/'.join(a)} equal in every layer" for k, a in self.uniform]
        rules += [f"{'/'.join(self.blocks)} blocks only"] if self.blocks is not None else []
        rules += [f"an MTP head of {'+'.join(self.mtp)}"] if self.mtp is not None else []
        rules += [r.__doc__ for r in self.rules] + ["head counts and widths split over the layout's devices"]
        return f"{self.name} (loadable by {', '.join(self.engines)}: {'; '.join(rules)})"


def _every(name: str, profiles: list[EngineProfile]) -> EngineProfile:
    """What every one of `profiles` loads: all their rules together."""
    assert len({(p.blocks, p.mtp) for p in profiles}) == 1, "engines that differ in blocks or MTP form"
    return EngineProfile(name, sum((p.engines for p in profiles), ()),
                         uniform=tuple(dict.fromkeys(u for p in profiles for u in p.uniform)),
                         blocks=profiles[0].blocks, mtp=profiles[0].mtp,
                         rules=tuple(dict.fromkeys(r for p in profiles for r in p.rules)),
                         head_from_top=any(p.head_from_top for p in profiles))


def head_match_axis(block, q: int, kv: int, d: int) -> str:
    """The axis whose shrink takes the MTP head's attention `block` to q query / kv KV heads of size d
    (mtp-match-attention's two ways: "kv_merge" keeps every query head, "kv_heads" drops whole KV groups with
    their query heads), or "" when neither reaches it."""
    if d == block.head_dim and kv <= block.kv_heads:
        if q == block.q_heads and block.kv_heads % kv == 0:
            return "kv_merge"
        if q * block.kv_heads == block.q_heads * kv:
            return "kv_heads"
    return ""


MAMBA = ("mamba2", ("heads", "head_dim", "state", "groups"))
ATTENTION = ("attention", ("q_heads", "kv_heads", "head_dim"))
KV_POOL = ("attention", ("kv_heads", "head_dim"))  # SGLang's one KV pool shape, from the top level
MLP = ("mlp", ("d_ff",))
_PUBLISHED = {"blocks": ("mamba2", "moe", "attention", "mlp"), "mtp": MTP_KINDS}
PROFILES = {
    "vllm": EngineProfile("vllm", ("vLLM",), uniform=(MAMBA,), rules=(_nvfp4_latent, _nvfp4_width), **_PUBLISHED),
    "sglang": EngineProfile("sglang", ("SGLang",), uniform=(MAMBA, MLP, KV_POOL), rules=(_nvfp4_latent, _nvfp4_width),
                            head_from_top=True, **_PUBLISHED),
    "tensorrt-llm": EngineProfile("tensorrt-llm", ("TensorRT-LLM",), uniform=(MAMBA, ATTENTION, MLP),
                                  rules=(_nvfp4_latent, _nvfp4_width, _routing_top_k), head_from_top=True,
                                  **_PUBLISHED),
}
PROFILES["all"] = _every("all", list(PROFILES.values()))
PROFILES["none"] = EngineProfile("none", ())
DEFAULT_ENGINE = "all"


def get_engine(name) -> EngineProfile:
    """A profile by name (an EngineProfile passes through)."""
    if isinstance(name, EngineProfile):
        return name
    if name not in PROFILES:
        raise PassError(f"unknown engine {name!r}; known: {', '.join(PROFILES)} (all: what every engine loads; "
                        "none: no rules)")
    return PROFILES[name]
