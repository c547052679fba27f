"""The published `nemotron_h_puzzle` schema (NVIDIA's Puzzle children), as vLLM and TensorRT-LLM read it.

The top level is an ordinary `nemotron_h` config. `block_configs` has one object per layer and
`mtp_block_configs` one per layer of the MTP head: a `block_type` (mamba, moe, attention, mlp) plus
NemotronHConfig fields that override the top level for that layer. vLLM builds a layer's config from the
top level without the fields any block overrides, updated with that block's fields
(`get_nemotron_h_config_for_layer`), so a field one block of a kind overrides, every block of that kind
carries; MoE blocks always carry their expert geometry, as the published children do. TensorRT-LLM builds
the MTP head's layers from the top level, so the top level holds the head's fields.

What engines read from the top level only is refused when layers differ in it: the Mamba geometry (vLLM
builds Mamba layers and their state caches from the top level) and the norms' epsilon. vLLM's MTP head
is one attention and one MoE layer, and no loader knows `noop` or `linear` blocks. `layers_config` names
the first such layer; puzzlekit's extended form (`ir.save(..., extended=True)`) writes every program.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from ..errors import CheckpointError
from .hf_fields import (BLOCK_TYPE, FIXED, LAYER_TYPES, MAX_LAYERS, check_fields, check_supported, fields_of, short,
                        spec_of, too_many_layers)
from .ops import LETTER_OF, MTP

MODEL_TYPE = "nemotron_h_puzzle"
ARCHITECTURE = "NemotronHPuzzleForCausalLM"
#: the code a published checkpoint carries for `trust_remote_code=True` (transformers, the engines' config loaders)
REMOTE_CODE_DIR = Path(__file__).parent / "remote_code"
REMOTE_CODE = ("configuration_nemotron_h_puzzle.py", "modeling_nemotron_h_puzzle.py")
AUTO_MAP = {"AutoConfig": "configuration_nemotron_h_puzzle.NemotronHPuzzleConfig",
            "AutoModel": "modeling_nemotron_h_puzzle.NemotronHPuzzleModel",
            "AutoModelForCausalLM": "modeling_nemotron_h_puzzle.NemotronHPuzzleForCausalLM"}
#: fields every MoE block carries (the published children's MoE entries)
MOE_ALWAYS = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
              "moe_shared_expert_intermediate_size", "moe_latent_size")
#: the MTP head vLLM's nemotron_h_puzzle config accepts (the published children's): one attention, one MoE layer
MTP_KINDS = ("attention", "moe")


class Unpublishable(CheckpointError):
    """The program has a layer the published schema (or the engines reading it) cannot express."""


def _refuse(where: str, why: str) -> Unpublishable:
    return Unpublishable(f"save: {where} {why}; save with extended=True (CLI: --extended) to write puzzlekit's "
                         "extended form, which no serving engine loads")


def layers_config(blocks: list, mtp: MTP | None, eps: float) -> dict:
    """The layer part of a published config: top-level fields, `layers_block_type`, `block_configs`,
    `mtp_block_configs` (and their MTP counterparts). Raises `Unpublishable` naming the first layer
    the schema cannot express."""
    layers = [(f"backbone.layers.{i}", b) for i, b in enumerate(blocks)]
    layers += [(f"mtp.layers.{i}", b) for i, b in enumerate(mtp.blocks if mtp else ())]
    if mtp is not None and tuple(b.kind for b in mtp.blocks) != MTP_KINDS:
        raise _refuse("mtp", f"has blocks {[b.kind for b in mtp.blocks]}; vLLM's nemotron_h_puzzle config accepts "
                             "an MTP head of one attention and one MoE layer")
    for where, op in layers:
        if op.kind not in BLOCK_TYPE:
            raise _refuse(where, f"is a {op.kind!r} block; the published schema has "
                                 f"{', '.join(BLOCK_TYPE.values())} blocks only")
        if op.eps != eps:
            raise _refuse(where, f"has norm epsilon {op.eps}, the model {eps}; engines read one epsilon for "
                                 "every norm")
    top, per_kind = {}, {}
    for where, op in layers:
        per_kind.setdefault(op.kind, []).append((where, fields_of(op)))
    blockwise = set()
    for kind, rows in per_kind.items():
        first_where, first = rows[0]
        top.update(first)
        for where, f in rows[1:]:
            for k, v in f.items():
                if v != first[k]:
                    if kind == "mamba2":
                        raise _refuse(where, f"has {k}={v}, but {first_where} has {first[k]}; vLLM builds Mamba "
                                             "layers and their state caches from the top level, so every Mamba "
                                             "layer must share them")
                    blockwise.add(k)
    for where, op in layers[len(blocks):]:  # TensorRT-LLM builds the MTP head's layers from the top level
        top.update(fields_of(op))
    if "n_groups" in top:  # SGLang builds Mamba layers from `mamba_n_groups` (8 when absent), transformers too
        top["mamba_n_groups"] = top["n_groups"]
    if "moe_latent_size" in blockwise:  # a block without one must not fall back to another's (TensorRT-LLM does)
        top["moe_latent_size"] = None
    blockwise |= set(MOE_ALWAYS) if "moe" in per_kind else set()

    def entry(op) -> dict:
        return {"block_type": BLOCK_TYPE[op.kind], **{k: v for k, v in fields_of(op).items() if k in blockwise}}

    # the layout both ways: transformers reads the list, TensorRT-LLM's MTP head the pattern
    out = {"layers_block_type": [BLOCK_TYPE[b.kind] for b in blocks],
           "hybrid_override_pattern": "".join(LETTER_OF[b.kind] for b in blocks), **FIXED, **top,
           "num_nextn_predict_layers": int(mtp is not None)}
    if mtp is not None:
        out["mtp_layers_block_type"] = [BLOCK_TYPE[b.kind] for b in mtp.blocks]
        out["mtp_hybrid_override_pattern"] = mtp.pattern
    out["block_configs"] = [entry(b) for b in blocks]
    out["mtp_block_configs"] = [entry(b) for b in mtp.blocks] if mtp else []
    return out


def write_remote_code(dst: Path) -> None:
    """Copies the configuration and modeling code `AUTO_MAP` names into a checkpoint directory."""
    for name in REMOTE_CODE:
        shutil.copyfile(REMOTE_CODE_DIR / name, Path(dst) / name)


def _entries(cfg: dict, src) -> list[tuple[str, dict]]:
    found = []
    for field in ("block_configs", "mtp_block_configs"):
        rows = cfg.get(field) or []
        if len(rows) > MAX_LAYERS:
            raise too_many_layers(src, field, len(rows))
        for i, b in enumerate(rows):
            where = f"{src}: {field}[{i}]"
            if not isinstance(b, dict):
                raise CheckpointError(f"{where} must be an object with a block_type, got {short(b)}")
            t = b.get("block_type")
            if not isinstance(t, str) or t not in LAYER_TYPES or len(t) == 1:
                known = sorted({k for k in LAYER_TYPES if len(k) > 1})
                raise CheckpointError(f"{where}: unknown block_type {short(t)}; known: {known}")
            found.append((where, b))
    return found


def read_layers(cfg: dict, src) -> tuple[list, MTP | None]:
    """Per-layer specs of a published config, each from the top level updated with its block's fields
    (without the fields any block overrides, as vLLM builds them): a field a block needs and neither gives
    is an error naming the block, not a silent default."""
    entries = _entries(cfg, src)
    overridden = {k for _, b in entries for k, v in b.items() if v is not None} - {"block_type"}
    base = {k: v for k, v in cfg.items() if k not in overridden and v is not None}
    specs = []
    for where, b in entries:
        merged = base | {k: v for k, v in b.items() if v is not None}
        check_fields(merged, where)
        check_supported(merged, where)
        specs.append(spec_of(LAYER_TYPES[b["block_type"]], merged, where))
    n_trunk = len(cfg.get("block_configs") or [])
    blocks, mtp_blocks = specs[:n_trunk], specs[n_trunk:]
    for field in ("layers_block_type", "hybrid_override_pattern"):
        declared = cfg.get(field)
        if declared is not None and [LAYER_TYPES.get(t) for t in declared] != [b.kind for b in blocks]:
            raise CheckpointError(f"{src}: {field} {short(declared)} disagrees with the block_types of "
                                  "block_configs; make them agree")
    n = cfg.get("num_nextn_predict_layers")
    if n is not None and n != int(bool(mtp_blocks)):
        raise CheckpointError(f"{src}: num_nextn_predict_layers is {n} but mtp_block_configs has "
                              f"{len(mtp_blocks)} layers; make them agree (one MTP head, or none)")
    eps = cfg.get("layer_norm_epsilon", 1e-5)
    return blocks, MTP(cfg["hidden_size"], tuple(mtp_blocks), eps) if mtp_blocks else None
