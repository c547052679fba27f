"""What each serving engine builds from a published checkpoint, read from its config and tensor headers only.

Each engine reads a `nemotron_h_puzzle` config its own way (docs/engines.md names the code each reading comes
from):
- vLLM (with `--trust-remote-code`, since it has no config class of its own for the form) takes attention, MoE
  and MLP layers from the checkpoint's `get_nemotron_h_config_for_layer(i)`, MTP layers from the same call with
  `i = num_hidden_layers + j`, and Mamba layers and their state caches from the top level; it sizes its expert
  weight map by the top-level `n_routed_experts` (the largest block's when that is null; trunk experts load per
  layer, so only its MTP head, `nemotron_h_mtp.py`, the model type its speculative config renames to, is bound
  by it) and loads an MTP head of one attention and one MoE layer (`num_nextn_predict_layers` 1).
- SGLang replaces the checkpoint's config class by its own, which overlays each block on the top level for MoE and
  attention layers only: MLP widths come from the top level, Mamba layers take their groups from
  `mamba_n_groups` (8 when absent) while the state cache takes `n_groups`; it keeps one KV pool shape
  (`MHATokenToKVPool`: KV heads and head size of the top level) for every attention layer, the MTP head's included.
- TensorRT-LLM takes per layer only five MoE fields (`_get_layer_moe_param`), everything else from the top level;
  `_normalize_puzzle_config` first fills a null top-level MoE field from the MTP head's MoE block (else the first
  trunk MoE block), which trunk layers without their own then inherit; it builds its MTP head from the top level,
  runs it unquantised, splits over TP 1, 2, 4 or 8 and splits Mamba groups as `n_groups // tp`.
- The context: vLLM and SGLang refuse a longer context than `max_position_embeddings` (4,096 when unset).
Every layer's reading is compared with what the checkpoint holds (the config as the schema means it, checked
against the tensor headers by `ir.load`, which reads no weights): a field that differs is a layer the engine
builds wrong, and one that changes a parameter's shape is a tensor it would not load.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CheckpointError, PuzzlekitError, UsageError
from ..ir import load
from ..ir.hf_fields import DEFAULT_CONTEXT, INFINITY, LAYER_TYPES, fields_of, served_context, spec_of
from ..ir.nemotron_h_puzzle import MODEL_TYPE, MTP_KINDS
from ..ir.quant import modelopt
from .layout import Layout, split_refusal

ENGINES = ("vllm", "sglang", "tensorrt-llm")
NAMES = {"vllm": "vLLM", "sglang": "SGLang", "tensorrt-llm": "TensorRT-LLM"}
#: the MoE fields TensorRT-LLM reads per layer (`_get_layer_moe_param`); every other field from the top level
TRTLLM_PER_LAYER = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                    "moe_shared_expert_intermediate_size", "moe_latent_size")
#: the tensor-parallel sizes TensorRT-LLM's NemotronH accepts (without attention data parallel)
TRTLLM_TP = (1, 2, 4, 8)


def trtllm_routing_refusal(op) -> str:
    """TensorRT-LLM's trtllm-gen MoE routing kernel (its `TRTLLM` MoE backend) takes top-k <= 8 at 384 experts or
    fewer; other backends fall back with a warning: why `op` breaks that, or ""."""
    if op.kind == "moe" and op.experts <= 384 and op.top_k > 8:
        return (f"top-k {op.top_k} of {op.experts} experts (TensorRT-LLM's trtllm-gen routing, moe_config.backend "
                "TRTLLM, takes top-k <= 8 below 385; CUTLASS, the default, falls back)")
    return ""


@dataclass
class Verdict:
    """One engine's reading of a checkpoint: the layers it builds and what it would get wrong."""

    engine: str
    layers: list[dict] = field(default_factory=list)  # {"layer", "kind", "from", "fields"}
    problems: list[str] = field(default_factory=list)  # each a reason it does not load (or not as asked)
    notes: list[str] = field(default_factory=list)  # it loads, but with a setting or default worth knowing

    @property
    def loads(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        return {"engine": self.engine, "loads": self.loads, "layers": self.layers, "problems": self.problems,
                "notes": self.notes}


class ServingCheckError(PuzzlekitError):
    """The checkpoint cannot be loaded by any engine (not the published form, tensors that contradict it)."""


class NotACheckpoint(ServingCheckError, UsageError):
    """What was named is no checkpoint at all (no readable config.json): a usage error, exit 2."""


def _top(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k not in ("block_configs", "mtp_block_configs")}


def _overlay(top: dict, block: dict) -> dict:
    return top | {k: v for k, v in block.items() if k != "block_type"}


def _trtllm_top(top: dict, blocks: list, mtp: list) -> dict:
    """The top level after TensorRT-LLM's `_normalize_puzzle_config`: each null MoE field filled from the MTP head's
    MoE block, else the first trunk MoE block."""
    moe = lambda rows: next((b for b in rows if b.get("block_type") == "moe"), None)
    fallback = moe(mtp) or moe(blocks)
    if fallback is None:
        return top
    return top | {k: fallback.get(k) for k in TRTLLM_PER_LAYER if top.get(k) is None}


def _readings(engine: str, cfg: dict) -> list[tuple[str, str, str, dict]]:
    """(layer path, kind, where its fields come from, the config the engine builds it from) per layer."""
    top, blocks, mtp = _top(cfg), cfg.get("block_configs") or [], cfg.get("mtp_block_configs") or []
    trt_top = _trtllm_top(top, blocks, mtp)
    out = []
    for i, b in enumerate(blocks):
        kind = LAYER_TYPES[b["block_type"]]
        if engine == "tensorrt-llm":
            per = {k: v for k, v in b.items() if k in TRTLLM_PER_LAYER and v is not None} if kind == "moe" else {}
            src, c = (f"block_configs[{i}] (MoE fields)" if per else "top level"), trt_top | per
        elif kind == "mamba2" or (engine == "sglang" and kind == "mlp"):
            src, c = "top level", top
            if engine == "sglang" and kind == "mamba2":
                c = top | {"n_groups": top.get("mamba_n_groups", 8)}
                src = "top level (mamba_n_groups)"
        else:
            src, c = f"block_configs[{i}]", _overlay(top, b)
        out.append((f"backbone.layers.{i}", kind, src, c))
    for j, b in enumerate(mtp):
        kind = LAYER_TYPES[b["block_type"]]
        if engine == "tensorrt-llm":
            src, c = "top level", trt_top
        else:
            src, c = f"mtp_block_configs[{j}]", _overlay(top, b)
        out.append((f"mtp.layers.{j}", kind, src, c))
    return out


def _shape_problems(built, held) -> list[str]:
    want, have = held.params(), built.params()
    return [f"{k}: builds {list(have.get(k, ()))}, the checkpoint has {list(s)}" for k, s in want.items()
            if tuple(have.get(k, ())) != tuple(s)]


def _layer_problem(name: str, path: str, kind: str, src: str, built, held) -> str:
    a, b = fields_of(built), fields_of(held)
    diff = [k for k in b if a.get(k) != b[k]]
    if not diff:
        return ""
    says = ", ".join(f"{k}={a.get(k)!r} (holds {b[k]!r})" for k in diff)
    shapes = _shape_problems(built, held)
    tail = (f": {len(shapes)} tensor(s) would not load, e.g. {path}.{shapes[0]}" if shapes
            else ": the tensors load, but the layer computes something else")
    return f"{path} ({kind}): {name} builds it from the {src} with {says}{tail}"


def _quant_problems(engine: str, fmts: dict) -> list[str]:
    """`fmts`: each quantised linear module's format."""
    out = []
    for layer in {m.split(".mixer.")[0] for m in fmts}:
        groups = {"routed experts": [m for m in fmts if m.startswith(layer + ".mixer.experts.")],
                  "q/k/v projections": [m for m in fmts if m.startswith(layer + ".mixer.")
                                        and m.endswith(("q_proj", "k_proj", "v_proj"))]}
        for what, mods in groups.items():
            if len({fmts[m] for m in mods}) > 1:
                out.append(f"{layer}: its {what} mix quantization formats {sorted({fmts[m] for m in mods})}; "
                           f"{NAMES[engine]} fuses them into one kernel with one format")
    if engine == "tensorrt-llm":
        mtp = sorted(m for m in fmts if m.startswith("mtp."))
        if mtp:
            out.append(f"the MTP head is quantised ({mtp[0]}: {fmts[mtp[0]]}); TensorRT-LLM builds it unquantised, "
                       "so its tensors would not load: keep the MTP head in BF16 (the recipes do)")
    return out


def _layout_problems(engine: str, prog, layout: Layout, fmts: dict) -> list[str]:
    recipes = " ".join(sorted(set(fmts.values())))
    trt = engine == "tensorrt-llm"
    out = [f"{n.path}: {why}" for n in [*prog.blocks(), *prog.find("mtp")]
           if (why := split_refusal(n.op, layout, recipes, replicated_groups=not trt))]
    if trt and layout.tp not in TRTLLM_TP and layout.dp == 1:
        out.append(f"layout {layout}: TensorRT-LLM's NemotronH takes TP 1, 2, 4 or 8, not {layout.tp}")
    return [f"{NAMES[engine]} on {layout}: {p}" for p in out]


def _attention(prog):
    mtp = prog.find("mtp")
    return [(n.path, n.op) for n in prog.blocks("attention")] + \
        [(f"mtp.layers.{j}", b) for m in mtp for j, b in enumerate(m.op.blocks) if b.kind == "attention"]


def _head_problems(engine: str, cfg: dict, prog) -> list[str]:
    out = []
    mtp = prog.find("mtp")
    if mtp and tuple(b.kind for b in mtp[0].op.blocks) != MTP_KINDS:
        out.append(f"the MTP head has blocks {[b.kind for b in mtp[0].op.blocks]}; {NAMES[engine]} loads one of "
                   f"{list(MTP_KINDS)}")
    if engine == "vllm" and (nextn := cfg.get("num_nextn_predict_layers") or 0) > 1:
        out.append(f"num_nextn_predict_layers is {nextn}; vLLM's NemotronH MTP takes one")
    head_experts = max((b.experts for m in mtp for b in m.op.blocks if b.kind == "moe"), default=None)
    sized = cfg.get("n_routed_experts")
    if engine == "vllm" and head_experts is not None and (sized is None or sized < head_experts):
        out.append(f"the top-level n_routed_experts is {sized} but the MTP head's MoE layer has {head_experts} "
                   "experts; vLLM's speculative config renames the model nemotron_h_mtp, whose expert map "
                   "(NemotronHMTP.load_weights) is sized by the top level, so the head's experts past it would not load")
    if engine == "sglang":  # MHATokenToKVPool: one head_num and head_dim, from the top level
        heads = cfg.get("num_attention_heads") or 0
        pool = (cfg.get("num_key_value_heads") or heads, cfg.get("head_dim") or cfg["hidden_size"] // max(heads, 1))
        out += [f"{where}: {op.kv_heads} KV heads of {op.head_dim}, but SGLang keeps one KV pool for every attention "
                f"layer shaped by the top level ({pool[0]} of {pool[1]}; kv_cache_configurator's "
                "_init_unified_mamba_pools): search with --engine sglang, which keeps them equal"
                for where, op in _attention(prog) if (op.kv_heads, op.head_dim) != pool]
    if engine == "tensorrt-llm":
        head = next((op for where, op in _attention(prog) if where.startswith("mtp.")), None)
        geometry = lambda op: (op.q_heads, op.kv_heads, op.head_dim)
        other = next((n for n in prog.blocks("attention") if head and geometry(n.op) != geometry(head)), None)
        if other is not None:
            out.append(f"the trunk's attention ({other.path}: heads/KV heads/head size {geometry(other.op)}) and "
                       f"the MTP head's {geometry(head)} differ; TensorRT-LLM builds both from the same top-level "
                       "fields, so one of them does not load: serve with vLLM or SGLang, or search with --engine "
                       "tensorrt-llm, which keeps them equal")
    return out


def _notes(engine: str, cfg: dict, prog) -> list[str]:
    """What loads, but only with a setting or a default the user should know of."""
    out = []
    if engine == "tensorrt-llm":
        layers = [(n.path, n.op) for n in prog.blocks("moe")]
        layers += [(f"mtp.layers.{j}", b) for m in prog.find("mtp") for j, b in enumerate(m.op.blocks)]
        out += [f"{where}: {why}" for where, op in layers if (why := trtllm_routing_refusal(op))]
    if cfg.get("max_position_embeddings") is None:
        assumes = "reads it for every attention layer (TransformerLayer)" if engine == "tensorrt-llm" else \
            f"assumes {DEFAULT_CONTEXT:,} tokens of context"
        out.append(f"the config states no max_position_embeddings: {NAMES[engine]} {assumes}; state the model's own")
    return out


def _context_problem(engine: str, cfg: dict, context: int) -> str:
    """vLLM's `ModelConfig._get_and_verify_max_len` and SGLang's `ModelConfig._derive_context_length` refuse a
    context past `max_position_embeddings` unless an override variable is set (TensorRT-LLM reads the field for
    its attention layers, which have no positional encoding here: no refusal found in its code)."""
    held = served_context(cfg)
    if context <= held or engine == "tensorrt-llm":
        return ""
    why = {"vllm": "ModelConfig._get_and_verify_max_len refuses it without VLLM_ALLOW_LONG_MAX_MODEL_LEN=1",
           "sglang": "ModelConfig refuses it without SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1"}[engine]
    return (f"a {context:,}-token context is asked for, but the checkpoint holds {held:,} (max_position_embeddings"
            f"{'' if cfg.get('max_position_embeddings') else ', unset'}): {NAMES[engine]}'s {why}")


def _read_config(path: Path) -> dict:
    f = path / "config.json" if path.is_dir() else path
    try:
        cfg = json.loads(f.read_text(), object_hook=lambda d: float("inf") if d == INFINITY else d)
    except (OSError, ValueError) as e:
        raise NotACheckpoint(f"{f}: cannot read a config ({e.strerror if isinstance(e, OSError) else e}); pass a "
                             "checkpoint directory (one holding config.json)") from None
    if not isinstance(cfg, dict):
        raise NotACheckpoint(f"{f}: the config is a JSON {type(cfg).__name__}, not an object; pass a checkpoint "
                             "directory")
    if cfg.get("model_type") != MODEL_TYPE or not cfg.get("block_configs"):
        form = cfg.get("model_type")
        raise ServingCheckError(f"{f}: model_type {form!r} is not the published {MODEL_TYPE} form with "
                                "block_configs that the engines load; save the model without --extended")
    return cfg


def check_serving(path, engines=ENGINES, layout: Layout | None = None, context: int | None = None) -> list[Verdict]:
    """Per engine, what it builds from the checkpoint at `path` and every way that differs from what it holds;
    with `context`, also whether it serves that many tokens (a serve command's --max-model-len)."""
    path = Path(path)
    cfg = _read_config(path)
    try:
        prog = load(path)  # the tensors' headers against the config; no weight is read
    except CheckpointError as e:
        raise ServingCheckError(f"{path}: the checkpoint does not match its own config, so no engine loads it: "
                                f"{e}") from None
    held = {n.path: n.op for n in prog.blocks()}
    mtp = prog.find("mtp")
    held |= {f"mtp.layers.{j}": b for j, b in enumerate(mtp[0].op.blocks)} if mtp else {}
    fmts = {m: f for m, f in modelopt.formats(prog).items() if f}
    out = []
    for engine in engines:
        v = Verdict(engine)
        for where, kind, src, c in _readings(engine, cfg):
            try:
                built = spec_of(kind, c, f"{NAMES[engine]}'s reading of {where}")
            except CheckpointError as e:
                v.problems.append(str(e))
                continue
            v.layers.append({"layer": where, "kind": kind, "from": src, "fields": fields_of(built)})
            if (why := _layer_problem(NAMES[engine], where, kind, src, built, held[where])):
                v.problems.append(why)
        v.problems += _head_problems(engine, cfg, prog) + _quant_problems(engine, fmts)
        if layout is not None:
            v.problems += _layout_problems(engine, prog, layout, fmts)
        if context is not None and (why := _context_problem(engine, cfg, context)):
            v.problems.append(why)
        v.notes += _notes(engine, cfg, prog)
        out.append(v)
    return out
