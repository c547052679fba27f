"""Checkpoint IO: Hugging Face `nemotron_h` (uniform, with `mtp.*`) in, our heterogeneous format in and out."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..errors import CheckpointError
from .ops import MLP, MTP, OPS, Attention, Embed, LMHead, Mamba2, MoE, Norm, OpSpec
from .ops.base import QUANT_FORMATS
from .program import Node, Program
from .verifier import problems
from .weights import WeightStore

#: layers_block_type spellings (old and new transformers) -> op kind
LAYER_TYPES = {"mamba": "mamba2", "linear_attention": "mamba2", "M": "mamba2", "moe": "moe", "E": "moe",
               "attention": "attention", "full_attention": "attention", "*": "attention", "mlp": "mlp", "-": "mlp"}
FORMAT = "nemotron_h_puzzle"
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
def _need(cfg: dict, key: str, src: Path):
    if key not in cfg or cfg[key] is None:
        raise CheckpointError(f"{src}: config field {key!r} is missing; it is required for this model")
    return cfg[key]


def _uniform_spec(kind: str, cfg: dict, src: Path) -> OpSpec:
    try:
        return _uniform(kind, cfg, src)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{src}: config for the {kind} layers: {e}") from None


def _uniform(kind: str, cfg: dict, src: Path) -> OpSpec:
    g = lambda k: _need(cfg, k, src)
    hidden, eps = g("hidden_size"), cfg.get("layer_norm_epsilon", 1e-5)
    if kind == "mamba2":
        return Mamba2(hidden, g("mamba_num_heads"), g("mamba_head_dim"), g("ssm_state_size"), g("n_groups"),
                      cfg.get("conv_kernel", 4), cfg.get("chunk_size", 128), cfg.get("use_conv_bias", True),
                      float(cfg.get("time_step_min", 0.001)), eps)
    if kind == "moe":
        return MoE(hidden, g("n_routed_experts"), g("num_experts_per_tok"), g("moe_intermediate_size"),
                   g("moe_shared_expert_intermediate_size") if cfg.get("n_shared_experts", 1) else 0,
                   cfg.get("moe_latent_size") or 0, float(cfg.get("routed_scaling_factor", 1.0)),
                   bool(cfg.get("norm_topk_prob", True)), eps)
    if kind == "attention":
        return Attention(hidden, g("num_attention_heads"), cfg.get("num_key_value_heads") or g("num_attention_heads"),
                         cfg.get("head_dim") or hidden // g("num_attention_heads"), eps)
    return MLP(hidden, g("intermediate_size"), eps)


def _kinds(seq, field: str, src: Path) -> list[str]:
    if not isinstance(seq, (str, list)):
        raise CheckpointError(f"{src}: {field} must be a string or a list, got {type(seq).__name__}")
    out = []
    for i, t in enumerate(seq):
        if t not in LAYER_TYPES:
            known = ", ".join(f"{k!r}" for k in LAYER_TYPES)
            raise CheckpointError(f"{src}: {field} has unknown layer type {t!r} at position {i}; known: {known}")
        out.append(LAYER_TYPES[t])
    return out


def _unsupported(cfg: dict, src: Path):
    flags = {"attention_bias": False, "mlp_bias": False, "use_bias": False, "mamba_proj_bias": False,
             "n_group": 1, "topk_group": 1, "mamba_hidden_act": "silu", "mlp_hidden_act": "relu2"}
    for k, ok in flags.items():
        if k in cfg and cfg[k] is not None and cfg[k] != ok:
            raise CheckpointError(f"{src}: config {k}={cfg[k]!r} is not supported (only {ok!r}); "
                                  "convert the model or file a feature request")
    if cfg.get("n_shared_experts", 1) not in (0, 1):
        raise CheckpointError(f"{src}: n_shared_experts={cfg['n_shared_experts']} is not supported (0 or 1)")


def _spec_from_dict(d: dict, where: str) -> OpSpec:
    d = dict(d)
    kind = d.pop("block_type", None)
    if kind not in OPS or kind == "opaque":
        raise CheckpointError(f"{where}: unknown block_type {kind!r}; known: {sorted(k for k in OPS if k != 'opaque')}")
    if kind == "mtp":
        d["blocks"] = tuple(_spec_from_dict(b, f"{where}.blocks[{i}]") for i, b in enumerate(d.get("blocks", [])))
    try:
        return OPS[kind](**d)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: bad attributes for {kind}: {e}") from None


def _spec_to_dict(op: OpSpec) -> dict:
    d = {"block_type": op.kind}
    for k, v in op.attrs().items():
        if k == "quant" and not v:
            continue
        d[k] = [_spec_to_dict(b) for b in v] if k == "blocks" else v
    return d


def program_from_config(cfg: dict, src: Path) -> Program:
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{src}: config must be a JSON object")
    _unsupported(cfg, src)
    hidden, vocab = _need(cfg, "hidden_size", src), _need(cfg, "vocab_size", src)
    eps = cfg.get("layer_norm_epsilon", 1e-5)
    for k, v in (("hidden_size", hidden), ("vocab_size", vocab)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise CheckpointError(f"{src}: config field {k!r} must be a positive integer, got {v!r}")
    if "block_configs" in cfg:
        blocks = [_spec_from_dict(d, f"{src}: block_configs[{i}]") for i, d in enumerate(cfg["block_configs"])]
        mtp = _spec_from_dict(cfg["mtp"], f"{src}: mtp") if cfg.get("mtp") else None
    else:
        if cfg.get("layers_block_type") is not None:
            kinds = _kinds(cfg["layers_block_type"], "layers_block_type", src)
        elif cfg.get("hybrid_override_pattern") is not None:
            kinds = _kinds(cfg["hybrid_override_pattern"], "hybrid_override_pattern", src)
        else:
            raise CheckpointError(f"{src}: config needs `layers_block_type` or `hybrid_override_pattern`")
        cache: dict[str, OpSpec] = {}
        blocks = [cache.setdefault(k, _uniform_spec(k, cfg, src)) for k in kinds]
        mtp = None
        n_mtp = cfg.get("num_nextn_predict_layers") or 0
        if not isinstance(n_mtp, int) or isinstance(n_mtp, bool) or n_mtp < 0:
            raise CheckpointError(f"{src}: num_nextn_predict_layers must be a non-negative integer, got {n_mtp!r}")
        if n_mtp > 1:
            raise CheckpointError(f"{src}: num_nextn_predict_layers={n_mtp}: only one MTP head is supported")
        if n_mtp == 1:
            pattern = cfg.get("mtp_hybrid_override_pattern") or cfg.get("mtp_layers_block_type") or "*E"
            field = "mtp_hybrid_override_pattern" if isinstance(pattern, str) else "mtp_layers_block_type"
            mblocks = [_uniform_spec(k, cfg, src) for k in _kinds(pattern, field, src)]
            mtp = MTP(hidden, tuple(mblocks), eps)
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
    if not isinstance(getattr(torch, str(dtype), None), torch.dtype):
        raise CheckpointError(f"{src}: config dtype {dtype!r} is not a torch dtype")
    return assemble(Embed(vocab, hidden), blocks, Norm(hidden, eps),
                    LMHead(vocab, hidden, bool(cfg.get("tie_word_embeddings", False))), mtp,
                    meta={"dtype": str(dtype), "config": cfg})


def meta_weights(prog: Program, dtype: torch.dtype = torch.bfloat16) -> Program:
    """Gives every parameter a meta tensor (shape and dtype only, no memory)."""
    for n in prog.nodes:
        for local, shape in n.op.params().items():
            fp32 = local in n.op.fp32_params()
            prog.weights.set_meta(f"{n.path}.{local}", shape, torch.float32 if fp32 else dtype)
    return prog


# -- load ------------------------------------------------------------------------------------------------
def _read_json(file: Path):
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{file} is not UTF-8 text (byte {e.start}); is it really a JSON config?") from None
    except OSError as e:
        raise CheckpointError(f"{file}: cannot read ({e.strerror})") from None


def _shard_files(d: Path) -> list[Path]:
    if (d / INDEX).exists():
        index = _read_json(d / INDEX)
        wm = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wm, dict):
            raise CheckpointError(f"{d / INDEX}: has no `weight_map` object")
        files = sorted(set(wm.values()))
        missing = [f for f in files if not (d / f).exists()]
        if missing:
            raise CheckpointError(f"{d / INDEX} names shard(s) {missing} that are not in {d}")
        return [d / f for f in files]
    return sorted(d.glob("*.safetensors"))


def _meta_only(d: Path) -> bool:
    """A directory written by `save` for a meta program holds just its config (marked in it)."""
    try:
        return bool(json.loads((d / "config.json").read_text()).get("meta_only"))
    except (OSError, ValueError):
        return False


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
    prog = program_from_config(_read_json(cfg_file), cfg_file)
    spec_problems = [p for p in problems(prog) if "weight" not in p]
    if spec_problems:
        raise CheckpointError(f"{cfg_file} describes an inconsistent model:\n  " + "\n  ".join(spec_problems))
    files = _shard_files(d) if d is not None else []
    if d is not None and not files and not _meta_only(d):
        raise CheckpointError(f"{d} has a config.json but no *.safetensors weights; to plan on shapes alone, "
                              f"pass {d / 'config.json'} itself")
    prog.meta["source"] = str(path.resolve())
    dtype = getattr(torch, prog.meta["dtype"])
    if not files:
        return meta_weights(prog, dtype)
    for f in files:
        prog.weights.add_safetensors(f)
    for n in prog.nodes:
        for local, fmt in n.op.quant:
            if f"{n.path}.{local}_scale" in prog.weights:
                prog.weights.group_quantized(f"{n.path}.{local}", QUANT_FORMATS.get(fmt, ("?",))[0], dtype)
    found = problems(prog, check_finite)
    if found:
        raise CheckpointError(f"checkpoint {path} does not match its config:\n  " + "\n  ".join(found))
    return prog


# -- save ------------------------------------------------------------------------------------------------
def config_of(prog: Program) -> dict:
    """Our heterogeneous config: per-block `block_configs` plus the model-level fields."""
    emb, head, norm = prog.find("embed"), prog.find("lm_head"), prog.find("norm")
    if len(emb) != 1 or len(head) != 1 or len(norm) != 1:
        raise CheckpointError("save: only programs with one embed, norm and lm_head can be saved")
    opaque = prog.find("opaque")
    if opaque:
        raise CheckpointError(f"save: node {opaque[0].path} is opaque (traced, unrecognised); "
                              "register its module class with puzzlekit.ir.register_module to save it")
    mtp = prog.find("mtp")
    kept = {k: v for k, v in prog.meta.get("config", {}).items()
            if k in ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")}
    return {
        "architectures": ["NemotronHPuzzleForCausalLM"],
        "model_type": FORMAT,
        **kept,
        "vocab_size": emb[0].op.vocab,
        "hidden_size": emb[0].op.hidden,
        "layer_norm_epsilon": norm[0].op.eps,
        "tie_word_embeddings": head[0].op.tied,
        "dtype": prog.meta.get("dtype", "float32"),
        "num_hidden_layers": len(prog.blocks()),
        "num_nextn_predict_layers": len(mtp),
        "block_configs": [_spec_to_dict(b.op) for b in prog.blocks()],
        "mtp": _spec_to_dict(mtp[0].op) if mtp else None,
        **({"quantization_config": quantization_config(prog)} if any(n.op.quant for n in prog.nodes) else {}),
        **({"provenance": prog.meta["provenance"]} if prog.meta.get("provenance") else {}),
    }


def quantization_config(prog: Program) -> dict:
    """The serving engines' quantization config: algorithm per quantised module, group size, exclusions."""
    layers, algos, excluded = {}, set(), []
    for n in prog.nodes:
        quant = dict(n.op.quant)
        for local, shape in n.op.params().items():
            if len(shape) != 2 or local.endswith("norm.weight"):
                continue
            module = f"{n.path}.{local.rsplit('.', 1)[0]}" if "." in local else n.path
            fmt = quant.get(local)
            if fmt is None:
                excluded.append(module)
                continue
            algo = {"fp8": "FP8", "fp8-weight": "FP8_WEIGHT_ONLY", "nvfp4": "NVFP4",
                    "nvfp4-weight": "NVFP4_WEIGHT_ONLY"}[fmt]
            algos.add(algo)
            layers[module] = {"quant_algo": algo, **({"group_size": 16} if fmt.startswith("nvfp4") else {})}
    return {"quant_method": "modelopt", "producer": "puzzlekit",
            "quant_algo": algos.pop() if len(algos) == 1 else "MIXED_PRECISION",
            "group_size": 16, "kv_cache_quant_algo": None, "exclude_modules": sorted(excluded),
            "quantized_layers": layers}


def _atomic_dir(path: Path, overwrite: bool, inputs: set[Path]):
    if path.resolve() in inputs or any(p.is_relative_to(path.resolve()) for p in inputs):
        raise CheckpointError(f"{path} holds this program's own input tensors; save to a new directory")
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{path} is a file; save needs a directory path")
    if path.exists() and any(path.iterdir()) and not overwrite:
        raise CheckpointError(f"{path} already exists and is not empty; pass overwrite=True or pick a new path")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    tmp.chmod(0o777 & ~_UMASK)  # mkdtemp makes it private; an output directory should not be
    return tmp


_UMASK = os.umask(0)  # read once, at import: os.umask can only be read by setting it
os.umask(_UMASK)


def _stored_tensors(name: str, value) -> dict:
    """A weight as the serving layout stores it: quantised ones as values + `_scale` (+ `_scale_2`)."""
    if isinstance(value, torch.Tensor):
        return {name: value.contiguous()}
    out = {name: value.data.contiguous(), name + "_scale": value.scale.contiguous()} if value.format == "fp8" else {
        name: value.data.contiguous(), name + "_scale": value.block_scale.contiguous(),
        name + "_scale_2": value.global_scale.reshape(()).contiguous()}
    return out


def save(prog: Program, path, max_shard_bytes: int = 5 * 2**30, overwrite: bool = False) -> Path:
    """Writes config.json + safetensors (sharded with an index past `max_shard_bytes`), atomically.

    Tensors are written exactly as stored (dtype and bytes), so save -> load -> save is byte-identical.
    Lazy tensors are read one shard at a time, so a checkpoint larger than memory streams through.
    """
    path = Path(path)
    cfg = config_of(prog)
    found = problems(prog)
    if found:
        raise CheckpointError("save: the program does not verify:\n  " + "\n  ".join(found))
    w = prog.weights
    names = [f"{n.path}.{k}" for n in prog.nodes for k in n.op.stored_params()]
    metas = [k for k in names if w.is_meta(k)]
    if metas and len(metas) != len(names):
        raise CheckpointError(f"save: {len(metas)} tensors are meta (e.g. {metas[0]}) and the rest real; "
                              "materialise or drop them first")
    inputs = {Path(w.source(k)).resolve().parent for k in names if w.source(k) is not None}
    tmp = _atomic_dir(path, overwrite, inputs)
    try:
        (tmp / "config.json").write_text(json.dumps({**cfg, **({"meta_only": True} if metas else {})}, indent=2)
                                         + "\n")
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
                    tensors.update(_stored_tensors(k, w.get(k)))
                weight_map.update(dict.fromkeys(tensors, fname(i)))
                save_file(tensors, str(tmp / fname(i)), metadata={"format": "pt"})
            if len(shards) > 1:
                index = {"metadata": {"total_size": sum(w.nbytes(k) for k in names)}, "weight_map": weight_map}
                (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        for f in tmp.iterdir():
            f.chmod(0o666 & ~_UMASK)
        if path.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{path.name}.old.", dir=path.parent))
            os.replace(path, trash / "old")
            try:
                os.replace(tmp, path)
            except OSError:
                os.replace(trash / "old", path)  # put the old checkpoint back
                raise
            shutil.rmtree(trash)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path
