"""Checkpoint IO: Hugging Face `nemotron_h` (uniform, with `mtp.*`) and the published heterogeneous
`nemotron_h_puzzle` in and out (with Model Optimizer's quantization config), puzzlekit's extended form
in and out, and the first form puzzlekit wrote in."""
from __future__ import annotations

import json
import math
import warnings
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..errors import CheckpointError
from ..outputs import staged_dir
from .ops import MTP, OPS, Embed, LMHead, Norm, OpSpec
from .ops.base import QUANT_FORMATS
from .program import Node, Program
from .hf_fields import (MAX_LAYERS, check_fields, check_supported, kinds_of, need, short, spec_of,
                        too_many_layers)
from . import nemotron_h_puzzle as puzzle
from .companions import copy_companions, has_tokenizer
from .quant import modelopt
from .verifier import problems
from .weights import WeightStore, lazy_tensors, loads_strict, stored_tensors

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
        if k == "quant" and not v:
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
    _check_size(prog, src)
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
    """Gives every parameter a meta tensor (shape and dtype only, no memory)."""
    for n in prog.nodes:
        for local, shape in n.op.params().items():
            fp32 = local in n.op.fp32_params()
            prog.weights.set_meta(f"{n.path}.{local}", shape, torch.float32 if fp32 else dtype)
    return prog


# -- load ------------------------------------------------------------------------------------------------
class CheckpointWarning(UserWarning):
    """A checkpoint loaded, but not exactly as stored (tensors cast to the dtype the model computes in)."""


def _read_json(file: Path):
    try:
        return loads_strict(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{file} is not UTF-8 text (byte {e.start}); is it really a JSON config?") from None
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{file} is not usable JSON ({e}); fix the file") from None
    except OSError as e:
        raise CheckpointError(f"{file}: cannot read ({e.strerror})") from None


def _inside(f: Path, d: Path) -> bool:
    """Whether `f` resolves into `d`, or, for a Hugging Face hub cache snapshot (whose files are symlinks),
    into the blobs/ folder of its repository."""
    real, root = f.resolve(), d.resolve()
    hub_blobs = root.parent.parent / "blobs" if root.parent.name == "snapshots" else None
    return real.is_relative_to(root) or real.parent == hub_blobs


def _shard(d: Path, name: str, where) -> Path:
    """Shard `name` (from the index or the listing `where`), checked to be a visible regular file inside `d`."""
    rel = Path(name)
    if rel.is_absolute() or not rel.parts or any(p.startswith(".") for p in rel.parts):
        raise CheckpointError(f"{where}: shard path {name!r} must be relative to the checkpoint directory, with no "
                              "'..' and no hidden (dot) names; fix the index")
    f = d / rel
    if not f.is_file():
        raise CheckpointError(f"{where} names shard {name!r}, which is not a file in {d}")
    if not _inside(f, d):
        raise CheckpointError(f"{where}: shard {name!r} resolves to {f.resolve()}, outside {d}; copy the file into "
                              "the checkpoint directory")
    return f


def _index_map(d: Path) -> dict[str, Path] | None:
    """The index's tensor -> shard file map (the index is authoritative); None when there is no index."""
    if not (d / INDEX).exists():
        return None
    index = _read_json(d / INDEX)
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict):
        raise CheckpointError(f"{d / INDEX}: has no `weight_map` object")
    bad = next((k for k, v in wm.items() if not isinstance(v, str)), None)
    if bad is not None:
        raise CheckpointError(f"{d / INDEX}: weight_map[{bad!r}] must be a file name, got {short(wm[bad])}")
    files = {v: _shard(d, v, d / INDEX) for v in sorted(set(wm.values()))}
    return {k: files[v] for k, v in wm.items()}


def _listed_shards(d: Path) -> list[Path]:
    """The `*.safetensors` files of an unindexed checkpoint; hidden ones (staging files) are not shards."""
    return [_shard(d, f.name, d) for f in sorted(d.glob("*.safetensors")) if not f.name.startswith(".") and f.is_file()]


def _checkpoint_tensors(d: Path) -> dict:
    """Every tensor of the checkpoint, unread, each from exactly one file: the one the index names or,
    without an index, the only file that holds it."""
    wm = _index_map(d)
    found, where = {}, {}
    for f in sorted(set(wm.values())) if wm is not None else _listed_shards(d):
        for name, t in lazy_tensors(f).items():
            if wm is not None and wm.get(name) != f:
                says = f"assigns it to {wm[name]}" if name in wm else "does not list it"
                raise CheckpointError(f"{f} holds tensor {name!r} but {d / INDEX} {says}; remove the stray tensor "
                                      "or fix the index")
            if name in where:
                raise CheckpointError(f"tensor {name!r} is stored twice, in {where[name]} and in {f}; remove the "
                                      f"stray file (or add a {INDEX} saying which file holds what)")
            found[name], where[name] = t, f
    missing = [k for k in wm or {} if k not in found]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{d / INDEX} assigns tensor {missing[0]!r}{more} to {wm[missing[0]]}, which does "
                              "not hold it; re-download the shard or regenerate the index")
    return found


def _meta_only(d: Path) -> bool:
    """A directory written by `save` for a meta program holds just its config (marked in it)."""
    try:
        return bool(json.loads((d / "config.json").read_text()).get("meta_only"))
    except (OSError, ValueError, AttributeError):
        return False


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _cast_to_model_dtype(prog: Program, dtype: torch.dtype, src: Path) -> None:
    """A tensor stored in another float dtype than its op computes in is cast on read (else the first matmul
    fails): silently when that widens it (a router weight stored in bfloat16, kept in float32), with a
    warning and a note in `prog.meta["notes"]` when it loses precision. 8-bit floats are refused (without
    a quantization config they have no scales); integer tensors are left to the verifier, which refuses them."""
    w, lossy = prog.weights, []
    for n in prog.nodes:
        quantised, fp32 = dict(n.op.quant), n.op.fp32_params()
        for local in n.op.params():
            full = f"{n.path}.{local}"
            if local in quantised or full not in w or w.is_quantized(full):
                continue
            have, want = w.dtype(full), torch.float32 if local in fp32 else dtype
            if have == want or not have.is_floating_point:
                continue
            if have.itemsize == 1:
                raise CheckpointError(f"{w.source(full)}: tensor {full!r} is stored as {_dtype_name(have)}, but the "
                                      f"config does not quantise it and the model computes in {_dtype_name(want)}; "
                                      "add its quantization config (and _scale tensors) or convert it")
            w.cast_on_read(full, want)
            if torch.promote_types(have, want) != want:
                lossy.append(f"{full} {_dtype_name(have)} -> {_dtype_name(want)}")
    if lossy:
        note = (f"{len(lossy)} tensor(s) are stored in another dtype than the model's and are cast on read, losing "
                f"precision (e.g. {lossy[0]}); re-save them in {_dtype_name(dtype)} or change the config's dtype")
        prog.meta.setdefault("notes", []).append(note)
        warnings.warn(f"{src}: {note}", CheckpointWarning, stacklevel=3)


def _drop_tied_head_copy(prog: Program, src: Path) -> None:
    """transformers saves `lm_head.weight` even when the config ties it to the embedding, and its NemotronH
    never ties them: it computes with the stored head. A copy equal to the embedding is dropped (the head
    stays tied); a different one is used, as transformers does, with a warning naming the field."""
    heads, embeds, w = prog.find("lm_head"), prog.find("embed"), prog.weights
    if len(heads) != 1 or len(embeds) != 1 or not heads[0].op.tied:
        return
    head, emb = f"{heads[0].path}.weight", f"{embeds[0].path}.weight"
    if head not in w or emb not in w:
        return
    if not w.equal(head, emb):
        note = (f"the config sets tie_word_embeddings=true, but the stored {head!r} differs from {emb!r}: the "
                f"stored head is used, as transformers' NemotronH does (it never ties them), and the model is "
                f"saved untied; set tie_word_embeddings to false in config.json to say so")
        prog.rewrite(heads[0], op=heads[0].op.replace(tied=False), weights={"weight": w.get(head)})
        prog.meta.setdefault("notes", []).append(note)
        warnings.warn(f"{src}: {note}", CheckpointWarning, stacklevel=3)
        return
    w.delete(head)
    prog.meta.setdefault("notes", []).append(f"{head} equals {emb} (the head is tied) and is not kept")


def load(path, check_finite: bool = False) -> Program:
    """Reads a checkpoint directory (config.json + safetensors) or a bare config.json (meta weights).

    Tensors stay lazy (read from disk when used). A config alone gives a Program of meta tensors that
    can be printed, verified and costed with no tensor memory allocated.
    """
    path = Path(path)
    if path.is_dir():
        cfg_file, d = path / "config.json", path
    elif path.exists():
        cfg_file, d = path, None
    else:
        raise CheckpointError(f"{path} does not exist; pass a checkpoint directory or a config.json")
    if not cfg_file.exists():
        raise CheckpointError(f"{path} has no config.json; a checkpoint directory needs one")
    hf_quant = d / modelopt.HF_QUANT_CONFIG if d is not None else None
    prog = program_from_config(_read_json(cfg_file), cfg_file,
                               _read_json(hf_quant) if hf_quant is not None and hf_quant.exists() else None)
    spec_problems = [p for p in problems(prog) if "weight" not in p]
    if spec_problems:
        raise CheckpointError(f"{cfg_file} describes an inconsistent model:\n  " + "\n  ".join(spec_problems))
    tensors = _checkpoint_tensors(d) if d is not None else {}
    if d is not None and not tensors and not _meta_only(d):
        raise CheckpointError(f"{d} has a config.json but no tensors in *.safetensors files; to plan on shapes "
                              f"alone, pass {d / 'config.json'} itself")
    prog.meta["source"] = str(path.resolve())
    if has_tokenizer(d or path.parent):
        prog.meta["tokenizer"] = str((d or path.parent).resolve())
    dtype = getattr(torch, prog.meta["dtype"])
    if not tensors:
        return meta_weights(prog, dtype)
    prog.weights.update(tensors)
    for n in prog.nodes:
        for local, fmt in n.op.quant:
            if f"{n.path}.{local}_scale" in prog.weights:
                prog.weights.group_quantized(f"{n.path}.{local}", QUANT_FORMATS.get(fmt, ("?",))[0], dtype)
    _cast_to_model_dtype(prog, dtype, path)
    _drop_tied_head_copy(prog, path)
    found = problems(prog, check_finite)
    if found:
        raise CheckpointError(f"checkpoint {path} does not match its config:\n  " + "\n  ".join(found))
    return prog


# -- save ------------------------------------------------------------------------------------------------
def _producer() -> dict:
    try:
        from importlib.metadata import version
        return {"name": "puzzlekit", "version": version("puzzlekit")}
    except Exception:  # not installed (run from a checkout)
        return {"name": "puzzlekit", "version": "unknown"}


def configs(prog: Program, extended: bool = False) -> tuple[dict, dict | None]:
    """(config.json, hf_quant_config.json or None) of a program.

    The published `nemotron_h_puzzle` schema with Model Optimizer's quantization config, or with
    `extended` puzzlekit's own form (`puzzlekit_nemotron_h`: every block kind, our attribute names, the
    quantization recorded per block), which no serving engine reads."""
    emb, head, norm = prog.find("embed"), prog.find("lm_head"), prog.find("norm")
    if len(emb) != 1 or len(head) != 1 or len(norm) != 1:
        raise CheckpointError("save: only programs with one embed, norm and lm_head can be saved")
    opaque = prog.find("opaque")
    if opaque:
        raise CheckpointError(f"save: node {opaque[0].path} is opaque (traced, unrecognised); "
                              "register its module class with puzzlekit.register_module to save it")
    mtp = prog.find("mtp")
    kept = {k: v for k, v in prog.meta.get("config", {}).items()
            if k in ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")}
    common = {
        **kept,
        "vocab_size": emb[0].op.vocab,
        "hidden_size": emb[0].op.hidden,
        "layer_norm_epsilon": norm[0].op.eps,
        "tie_word_embeddings": head[0].op.tied,
        "dtype": prog.meta.get("dtype", "float32"),
        "num_hidden_layers": len(prog.blocks()),
    }
    provenance = {"provenance": prog.meta["provenance"]} if prog.meta.get("provenance") else {}
    if extended:
        return {"architectures": [EXTENDED_ARCHITECTURE], "model_type": EXTENDED, **common,
                "num_nextn_predict_layers": len(mtp), "block_configs": [spec_to_dict(b.op) for b in prog.blocks()],
                "mtp": spec_to_dict(mtp[0].op) if mtp else None, **provenance}, None
    layers = puzzle.layers_config([b.op for b in prog.blocks()], mtp[0].op if mtp else None, norm[0].op.eps)
    hf_quant = modelopt.hf_quant_config(prog, _producer())
    cfg = {"architectures": [puzzle.ARCHITECTURE], "model_type": puzzle.MODEL_TYPE, **common, **layers,
           **({"quantization_config": modelopt.inline_config(hf_quant)} if hf_quant else {}), **provenance}
    _check_reads_back(prog, cfg)
    return cfg, hf_quant


def _check_reads_back(prog: Program, cfg: dict) -> None:
    """The published config describes exactly this program (specs and quantization), or save refuses."""
    back = program_from_config(json.loads(json.dumps(cfg)), Path("config.json"))
    for a, b in zip(prog.nodes, back.nodes):
        if a.op != b.op:
            raise puzzle.Unpublishable(f"save: {a.path} ({a.op.kind}) does not survive the published schema (it reads "
                                       f"back as {b.op}); save with extended=True (CLI: --extended)")
    if prog.meta.get("kv_cache_quant_algo") != back.meta.get("kv_cache_quant_algo"):
        raise puzzle.Unpublishable("save: the KV cache format does not survive the quantization config")


def config_of(prog: Program, extended: bool = False) -> dict:
    """The config.json `save` writes."""
    return configs(prog, extended)[0]


def save(prog: Program, path, max_shard_bytes: int = 5 * 2**30, overwrite: bool = False,
         extended: bool = False) -> Path:
    """Writes config.json (+ hf_quant_config.json) + safetensors (sharded with an index past
    `max_shard_bytes`), atomically.

    The config follows the published `nemotron_h_puzzle` schema, which vLLM, TensorRT-LLM and llama.cpp
    load; a program it cannot express (noop or linear blocks, Mamba layers that differ, an MTP head with
    other blocks than attention and MoE, FP8 weight-only quantization) is refused, naming the layer,
    unless `extended` asks for puzzlekit's own form. Tensors are written exactly as stored (dtype and
    bytes), so save -> load -> save is byte-identical. Lazy tensors are read one shard at a time, so a
    checkpoint larger than memory streams through.
    """
    path = Path(path)
    cfg, hf_quant = configs(prog, extended)
    found = problems(prog)
    if found:
        raise CheckpointError("save: the program does not verify:\n  " + "\n  ".join(found))
    w = prog.weights
    names = [f"{n.path}.{k}" for n in prog.nodes for k in n.op.stored_params()]
    metas = [k for k in names if w.is_meta(k)]
    if metas and len(metas) != len(names):
        raise CheckpointError(f"save: {len(metas)} tensors are meta (e.g. {metas[0]}) and the rest real; "
                              "materialise or drop them first")
    with staged_dir(path, overwrite, prog.input_paths(), need_bytes=0 if metas else sum(w.nbytes(k) for k in names)) as tmp:
        (tmp / "config.json").write_text(json.dumps({**cfg, **({"meta_only": True} if metas else {})}, indent=2)
                                         + "\n")
        copy_companions(prog, tmp)
        if hf_quant:
            (tmp / modelopt.HF_QUANT_CONFIG).write_text(json.dumps(hf_quant, indent=4) + "\n")
        if not metas:
            shards, cur, size = [], [], 0
            for k in names:
                if cur and size + w.nbytes(k) > max_shard_bytes:
                    shards.append(cur)
                    cur, size = [], 0
                cur.append(k)
                size += w.nbytes(k)
            shards.append(cur)
            fname = (lambda i: "model.safetensors") if len(shards) == 1 else \
                (lambda i: f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors")
            weight_map = {}
            for i, shard in enumerate(shards):
                tensors = {}
                for k in shard:
                    tensors.update(stored_tensors(k, w.get(k)))
                weight_map.update(dict.fromkeys(tensors, fname(i)))
                save_file(tensors, str(tmp / fname(i)), metadata={"format": "pt"})
            if len(shards) > 1:
                index = {"metadata": {"total_size": sum(w.nbytes(k) for k in names)}, "weight_map": weight_map}
                (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return path
