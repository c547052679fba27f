"""Writing a checkpoint: the config.json (published `nemotron_h_puzzle` with Model Optimizer's quantization
config, or puzzlekit's extended form) checked to read back as the same program, and `save`, which stages
the directory and writes the tensors as stored, sharded with an index past a size. The tokenizer's files
are copied by `companions`."""
from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from ..errors import CheckpointError
from ..outputs import staged_dir
from .program import Program
from .checkpoint_config import EXTENDED, EXTENDED_ARCHITECTURE, INDEX, program_from_config, spec_to_dict
from . import nemotron_h_puzzle as puzzle
from .companions import copy_companions
from .hf_fields import context_of
from .quant import modelopt
from .verifier import problems
from .weights import stored_tensors


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
    config = prog.meta.get("config", {})
    kept = {k: v for k, v in config.items() if k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    context = context_of(config)  # the parent's, else the window it was trained on: the engines read it
    common = {
        **kept,
        **({"max_position_embeddings": context} if context else {}),
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
    cfg = {"architectures": [puzzle.ARCHITECTURE], "model_type": puzzle.MODEL_TYPE, "auto_map": puzzle.AUTO_MAP,
           **common, **layers,
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
        if not extended:
            puzzle.write_remote_code(tmp)
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
