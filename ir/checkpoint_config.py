"""Checkpoint configs -> Programs: the checkpoint forms puzzlekit reads and writes (published
`nemotron_h_puzzle`, Hugging Face `nemotron_h`, puzzlekit's extended and first forms), op specs to and from
their JSON objects, sanity bounds on sizes, and Model Optimizer quantization configs. Reading
(`checkpoint_read`) and writing (`checkpoint_write`) both build on it; `hf_fields` maps the
NemotronHConfig fields themselves."""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import torch

from ..errors import CheckpointError
from .ops import MTP, OPS, Embed, LMHead, Norm, OpSpec
from .program import Node, Program
from .hf_fields import (MAX_LAYERS, check_fields, check_supported, kinds_of, need, short, spec_of,
                        too_many_layers)
from . import nemotron_h_puzzle as puzzle
from .quant import modelopt
from .quant.formats import meta_quantized
from .weights import WeightStore

#: puzzlekit's extended form: every block kind, our attribute names (no serving engine reads it)
EXTENDED = "puzzlekit_nemotron_h"
EXTENDED_ARCHITECTURE = "PuzzlekitNemotronHForCausalLM"
INDEX = "model.safetensors.index.json"


# -- building a trunk ------------------------------------------------------------------------------
def assemble(embed: Embed, blocks: list[OpSpec], norm: Norm, head: LMHead, mtp: MTP | None = None,
             weights: WeightStore | None = None, meta: dict | None = None) -> Program:
    """The standard Nemotron-H layout: embed -> blocks -> norm -> lm_head (+ mtp on the pre-norm hidden)."""
    nodes = [Node("x0", embed, ("input_ids",), "backbone.embeddings")]
    for i, b in enumerate(blocks):
        nodes.append(Node(f"x{i + 1}", b, (f"x{i}",), f"backbone.layers.{i}"))
    last = f"x{len(blocks)}"
    nodes += [Node("h", norm, (last,), "backbone.norm_f"), Node("logits", head, ("h",), "lm_head")]
    outputs = ("logits",)
    if mtp is not None:
        nodes.append(Node("mtp_logits", mtp, (last, "input_ids"), "mtp"))
        outputs += ("mtp_logits",)
    return Program(nodes, weights or WeightStore(), ("input_ids",), outputs, dict(meta or {}))


# -- config -> specs ---------------------------------------------------------------------------------
#: Sanity bounds, checked before anything is allocated, so that a wrong size field fails in milliseconds.
#: Nemotron-3 Super: ~42k tensors, 1.2e11 parameters, largest tensor 5.4e8 elements.
MAX_TENSORS = 1_000_000
MAX_TENSOR_ELEMENTS = 2**40
MAX_PARAMS = 10**13

BLOCK_KINDS = tuple(sorted(k for k, c in OPS.items() if c.is_block))


def spec_from_dict(d, where: str, kinds=BLOCK_KINDS) -> OpSpec:
    """One op spec from its JSON object; `kinds` are the block types allowed at this place."""
    if not isinstance(d, dict):
        raise CheckpointError(f"{where} must be an object with a block_type, got {short(d)}")
    d = dict(d)
    kind = d.pop("block_type", None)
    if not isinstance(kind, str) or kind not in kinds:
        raise CheckpointError(f"{where}: unknown block_type {short(kind)}; known here: {list(kinds)}")
    if kind == "mtp":
        blocks = d.get("blocks", [])
        if not isinstance(blocks, list):
            raise CheckpointError(f"{where}.blocks must be a list of block objects, got {short(blocks)}")
        if len(blocks) > MAX_LAYERS:
            raise too_many_layers(where, "blocks", len(blocks))
        d["blocks"] = tuple(spec_from_dict(b, f"{where}.blocks[{i}]") for i, b in enumerate(blocks))
    try:
        return OPS[kind](**d)
    except (TypeError, ValueError, OverflowError) as e:
        raise CheckpointError(f"{where}: bad attributes for {kind}: {e}") from None


def spec_to_dict(op: OpSpec) -> dict:
    d = {"block_type": op.kind}
    for k, v in op.attrs().items():
        if (k == "quant" and not v) or (k == "dt_max" and v == math.inf):  # defaults JSON cannot (or need not) say
            continue
        d[k] = [spec_to_dict(b) for b in v] if k == "blocks" else v
    return d


def _our_layers(cfg: dict, src: Path) -> tuple[list[OpSpec], OpSpec | None]:
    """Per-layer specs from our `block_configs` (and `mtp`) objects."""
    if len(cfg["block_configs"]) > MAX_LAYERS:
        raise too_many_layers(src, "block_configs", len(cfg["block_configs"]))
    blocks = [spec_from_dict(d, f"{src}: block_configs[{i}]") for i, d in enumerate(cfg["block_configs"])]
    mtp = spec_from_dict(cfg["mtp"], f"{src}: mtp", ("mtp",)) if "mtp" in cfg else None
    n = cfg.get("num_nextn_predict_layers")
    if n is not None and n != int(mtp is not None):
        raise CheckpointError(f"{src}: num_nextn_predict_layers is {n} but the config has "
                              f"{'an' if mtp else 'no'} `mtp` object; make them agree")
    return blocks, mtp


def _hf_layers(cfg: dict, src: Path) -> tuple[list[OpSpec], OpSpec | None]:
    """Uniform specs (one per layer kind) from a Hugging Face `nemotron_h` layout and its MTP fields."""
    if cfg.get("layers_block_type") is not None:
        kinds = kinds_of(cfg["layers_block_type"], "layers_block_type", src)
    elif cfg.get("hybrid_override_pattern") is not None:
        kinds = kinds_of(cfg["hybrid_override_pattern"], "hybrid_override_pattern", src)
    else:
        raise CheckpointError(f"{src}: config needs `layers_block_type` or `hybrid_override_pattern`")
    cache: dict[str, OpSpec] = {}
    blocks = [cache.setdefault(k, spec_of(k, cfg, src)) for k in kinds]
    n_mtp = cfg.get("num_nextn_predict_layers", 0)
    if n_mtp > 1:
        raise CheckpointError(f"{src}: num_nextn_predict_layers={n_mtp}: only one MTP head is supported")
    if n_mtp == 0:
        return blocks, None
    pattern = cfg.get("mtp_hybrid_override_pattern") or cfg.get("mtp_layers_block_type") or "*E"
    field = "mtp_hybrid_override_pattern" if isinstance(pattern, str) else "mtp_layers_block_type"
    mblocks = [spec_of(k, cfg, src) for k in kinds_of(pattern, field, src)]
    return blocks, MTP(cfg["hidden_size"], tuple(mblocks), cfg.get("layer_norm_epsilon", 1e-5))


def _model_dtype(cfg: dict, src: Path) -> str:
    field = "dtype" if cfg.get("dtype") else "torch_dtype"
    name = cfg.get(field) or "bfloat16"
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point or dt.itemsize < 2:
        raise CheckpointError(f"{src}: config field {field!r} is {name!r}; the model dtype must be float32, "
                              "bfloat16, float16 or float64")
    return name


def _tensor_bound(op: OpSpec) -> int:
    """An upper bound on len(op.params()) that does not build it (a MoE lists two tensors per expert)."""
    return 16 + 2 * max(getattr(op, "experts", 0), 0) + sum(_tensor_bound(b) for b in getattr(op, "blocks", ()))


def _node_elements(node: Node, src: Path) -> int:
    total = 0
    for local, shape in node.op.params().items():
        n = math.prod(max(d, 0) for d in shape)
        if n > MAX_TENSOR_ELEMENTS:
            raise CheckpointError(f"{src}: tensor {node.path}.{local} would have shape {list(shape)}, {n:.3g} "
                                  f"elements, more than the 2^40 puzzlekit accepts; check the config's size fields")
        total += n
    return total


def _check_size(prog: Program, src: Path) -> None:
    """Refuses absurd sizes (a wrong field: 10^9 experts, hidden_size 10^12) before the verifier or the
    weights list every tensor; each distinct spec's shapes are listed once."""
    tensors = sum(_tensor_bound(n.op) for n in prog.nodes)
    if tensors > MAX_TENSORS:
        raise CheckpointError(f"{src}: the config declares about {tensors:,} weight tensors, more than the "
                              f"{MAX_TENSORS:,} puzzlekit accepts; check the layer and expert counts")
    per_spec: dict[OpSpec, int] = {}
    total = 0
    for n in prog.nodes:
        if n.op not in per_spec:
            per_spec[n.op] = _node_elements(n, src)
        total += per_spec[n.op]
    if total > MAX_PARAMS:
        raise CheckpointError(f"{src}: the config declares {total:.3g} parameters, more than the {MAX_PARAMS:.0e} "
                              "puzzlekit accepts; check the config's size fields")


def _check_layer_count(cfg: dict, blocks: list, src: Path) -> None:
    n = cfg.get("num_hidden_layers")
    if n is not None and n != len(blocks):
        raise CheckpointError(f"{src}: num_hidden_layers is {n:,} but the layer layout has {len(blocks)} layers; "
                              "make them agree")


#: per block kind, the NemotronHConfig field each spec attribute comes from (hf_fields.spec_of), as the config
#: names it (and which part of it): what a problem with the attribute is reported by
CONFIG_FIELDS = {
    "mamba2": {"heads": "mamba_num_heads", "head_dim": "mamba_head_dim", "state": "ssm_state_size",
               "groups": "n_groups", "conv": "conv_kernel", "chunk": "chunk_size",
               "dt_min": "time_step_limit (its low end)", "dt_max": "time_step_limit (its high end)"},
    "moe": {"experts": "n_routed_experts", "top_k": "num_experts_per_tok", "d_ff": "moe_intermediate_size",
            "shared_d_ff": "moe_shared_expert_intermediate_size", "latent": "moe_latent_size",
            "scaling": "routed_scaling_factor"},
    "attention": {"q_heads": "num_attention_heads", "kv_heads": "num_key_value_heads", "head_dim": "head_dim"},
    "mlp": {"d_ff": "intermediate_size"},
}
_SHARED_FIELDS = {"hidden": "hidden_size", "eps": "layer_norm_epsilon"}


def _check_layer_fields(cfg: dict, blocks: list, mtp, src: Path) -> None:
    """A NemotronHConfig value its layers cannot take, said once by the config's own field name
    (`time_step_limit`, not dt_max) however many layers are built from it; the verifier names the rest."""
    import re

    from .hf_fields import BLOCK_TYPE

    layers = [(f"layer {i}", b) for i, b in enumerate(blocks)]
    layers += [(f"MTP layer {j}", b) for j, b in enumerate(mtp.blocks if mtp else ())]
    by_spec: dict = {}
    for where, b in layers:
        by_spec.setdefault(b, []).append(where)
    said: dict = {}  # field -> (its kind, the first message, the layers it holds for)
    for spec, wheres in by_spec.items():
        names = {**_SHARED_FIELDS, **CONFIG_FIELDS.get(spec.kind, {})}
        if spec.kind == "mamba2" and cfg.get("mamba_n_groups") is not None:
            names["groups"] = "mamba_n_groups"
        for attr, msg in spec.check():
            if attr not in names:
                continue
            for a, field in names.items():  # the message in the config's words too
                msg = re.sub(rf"\b{a}=", f"{field.split()[0]}=", msg)
            where = said.setdefault(names[attr], (spec.kind, msg, []))[2]  # a NaN bound breaks two checks of one
            where.extend(w for w in wheres if w not in where)
    problems = []
    for field, (kind, msg, wheres) in said.items():
        key, _, part = field.partition(" ")
        total = sum(b.kind == kind for _, b in layers)
        name = BLOCK_TYPE.get(kind, kind)
        which = f"all {total} {name} layers" if len(wheres) == total and total > 1 else ", ".join(wheres[:4]) + (
            f" and {len(wheres) - 4} more" if len(wheres) > 4 else "")
        problems.append(f"config field {key!r}{' ' + part if part else ''}"
                        f"{' ' if msg.startswith('must') else ': '}{msg}, in {which}")
    if problems:
        raise CheckpointError(f"{src}: {'; '.join(problems)}; fix it in the config")


def program_from_config(cfg: dict, src: Path, quant: dict | None = None) -> Program:
    """The Program a config describes (no weights), every field type- and range-checked first. `quant` is
    an hf_quant_config.json, used when the config carries no quantization_config."""
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{src}: config must be a JSON object")
    check_fields(cfg, src)
    c = {k: v for k, v in cfg.items() if v is not None}
    check_supported(c, src)
    hidden, vocab = need(c, "hidden_size", src), need(c, "vocab_size", src)
    for k, v in (("hidden_size", hidden), ("vocab_size", vocab)):
        if v <= 0:
            raise CheckpointError(f"{src}: config field {k!r} must be a positive integer, got {v!r}")
    form = config_form(c)
    reader = {"extended": _our_layers, "first": _our_layers, "published": puzzle.read_layers, "nemotron_h": _hf_layers}
    blocks, mtp = reader[form](c, src)
    _check_layer_count(c, blocks, src)
    eps = c.get("layer_norm_epsilon", 1e-5)
    prog = assemble(Embed(vocab, hidden), blocks, Norm(hidden, eps),
                    LMHead(vocab, hidden, c.get("tie_word_embeddings", False)), mtp,
                    meta={"dtype": _model_dtype(c, src), "config": cfg})
    _check_size(prog, src)  # first: a spec's own checks list its tensors
    if form in ("published", "nemotron_h"):  # NemotronHConfig fields: their problems by the fields' names
        _check_layer_fields(c, blocks, mtp, src)
    quant = c.get("quantization_config", quant)
    if form in ("published", "nemotron_h") and quant is not None:
        prog = _with_quantization(prog, quant, src)
    return prog


def config_form(cfg: dict) -> str:
    """Which config this is: "published" (`nemotron_h_puzzle` with NemotronHConfig fields per layer),
    "extended" (ours), "first" (the first heterogeneous form puzzlekit wrote: `nemotron_h_puzzle` with our
    attribute names and an `mtp` object) or "nemotron_h" (uniform Hugging Face)."""
    if cfg.get("model_type") == EXTENDED:
        return "extended"
    if "block_configs" not in cfg:
        return "nemotron_h"
    first = "mtp" in cfg or any(isinstance(b, dict) and "hidden" in b for b in cfg["block_configs"])
    return "first" if first else "published"


def _with_quantization(prog: Program, qc, src) -> Program:
    """The program with each linear module's format from a Model Optimizer quantization config."""
    if not isinstance(qc, dict) or not str(qc.get("quant_method", "modelopt")).lower().startswith("modelopt"):
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        raise CheckpointError(f"{src}: quantization method {short(method)} is not supported; puzzlekit reads Model "
                              "Optimizer's (quant_method \"modelopt\")")
    modules = modelopt.linear_modules(prog)
    fmts, kv = modelopt.read(qc, list(modules), src)
    stray = next((m for m in fmts if m not in modules), None)
    if stray is not None:
        raise CheckpointError(f"{src}: the quantization config names module {stray!r}, which the model does not have "
                              "(or which has no 2-D weight); fix the config")
    per_node: dict[str, dict] = {}
    for module, fmt in fmts.items():
        node, local = modules[module]
        per_node.setdefault(node.path, {})[local] = fmt
    nodes = [replace(n, op=n.op.replace(quant=per_node[n.path])) if n.path in per_node else n for n in prog.nodes]
    out = Program(nodes, prog.weights, prog.inputs, prog.outputs, prog.meta)
    if kv:
        out.meta["kv_cache_quant_algo"] = kv
    return out


def meta_weights(prog: Program, dtype: torch.dtype = torch.bfloat16) -> Program:
    """Gives every parameter a meta tensor (shape and dtype only, no memory); a weight its spec quantises, a meta
    quantised weight in that format, and its activation scale (a config declaring its checkpoint's formats)."""
    for n in prog.nodes:
        fp32, quant = n.op.fp32_params(), dict(n.op.quant)
        for local, shape in n.op.stored_params().items():
            if local in quant:
                prog.weights.set(f"{n.path}.{local}", meta_quantized(quant[local], shape, dtype))
            else:
                prog.weights.set_meta(f"{n.path}.{local}", shape, torch.float32 if local in fp32 or
                                      local.endswith(".input_scale") else dtype)
    return prog
