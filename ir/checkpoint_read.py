"""Reading a checkpoint: `load` of a directory (config.json + safetensors, lazily) or a bare config.json
(meta weights), the shard index and shard files checked to stay inside the directory, stored dtypes cast
to the model's, and the tied-head copy transformers saves. Configs become Programs in `checkpoint_config`."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from ..errors import CheckpointError
from .ops.base import QUANT_FORMATS
from .program import Program
from .hf_fields import short
from .checkpoint_config import INDEX, meta_weights, program_from_config
from .companions import has_tokenizer
from .quant import modelopt
from .verifier import problems
from .weights import lazy_tensors, loads_strict


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
