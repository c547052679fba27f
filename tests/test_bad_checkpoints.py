"""Hardened checkpoint loading: every bad input is a CheckpointError naming the file, the field or tensor
and the fix (never a traceback, never silently wrong weights), and loading never changes its inputs.

Covers: which file a tensor comes from (stray copies, the index, paths escaping the checkpoint, hidden
staging files), safetensors headers crafted byte by byte (checked as strictly as the safetensors library
does), stored dtypes that differ from the model's, config types, ranges and size bounds, tied LM heads
saved by transformers, tracing a transformers model without kwargs, and the CLI's report of all this.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import time
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from puzzlekit import ir
from puzzlekit.backends.torch import materialize
from puzzlekit.errors import CheckpointError
from puzzlekit.ir import weights as weights_module
from puzzlekit.ir.checkpoint import CheckpointWarning
from puzzlekit.ir.weights import lazy_tensors
from puzzlekit.tools.default_model import config_path

SUPER = config_path("nemotron-3-super-120b-a12b")
INDEX = "model.safetensors.index.json"
GATE = "backbone.layers.1.mixer.gate.weight"  # a float32-only router weight
UP = "backbone.layers.4.mixer.up_proj.weight"  # an ordinary weight (MLP block)


# -- helpers ---------------------------------------------------------------------------------------------
def digest(root: Path) -> dict[str, str]:
    """sha256 of every file under `root` (what loading must leave unchanged)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(root).rglob("*")) if p.is_file()}


def load_error(path: Path, root: Path, *parts: str) -> str:
    """ir.load(path) must raise a CheckpointError whose message holds every one of `parts`, and leave
    every file under `root` unchanged; returns the message."""
    before = digest(root)
    try:
        ir.load(path)
    except CheckpointError as e:
        msg = str(e)
    except Exception as e:  # pragma: no cover - a failure, reported with the real type
        pytest.fail(f"expected CheckpointError, got {type(e).__name__}: {e}")
    else:
        pytest.fail("expected CheckpointError, the load succeeded")
    assert digest(root) == before, "loading changed its input files"
    for p in parts:
        assert p in msg, f"{p!r} not in the message: {msg}"
    return msg


def edit_tensors(file: Path, edit) -> None:
    ts = load_file(str(file))
    edit(ts)
    save_file(ts, str(file), metadata={"format": "pt"})


def edit_json(file: Path, edit) -> None:
    data = json.loads(file.read_text())
    edit(data)
    file.write_text(json.dumps(data, indent=2))


def logits(prog, ids):
    with torch.no_grad():
        return materialize(prog)(ids)


@pytest.fixture(scope="module")
def good(tmp_path_factory, make_small_program) -> Path:
    """The small program saved in one file (read-only: tests copy it)."""
    d = tmp_path_factory.mktemp("good") / "ckpt"
    ir.save(make_small_program(), d, extended=True)
    return d


@pytest.fixture(scope="module")
def good_sharded(tmp_path_factory, make_small_program) -> Path:
    d = tmp_path_factory.mktemp("good") / "sharded"
    ir.save(make_small_program(), d, max_shard_bytes=4000, extended=True)
    return d


@pytest.fixture
def ckpt(good, tmp_path) -> Path:
    return Path(shutil.copytree(good, tmp_path / "ckpt"))


@pytest.fixture
def sharded(good_sharded, tmp_path) -> Path:
    return Path(shutil.copytree(good_sharded, tmp_path / "sharded"))


def shard_of(d: Path, name: str) -> Path:
    return d / json.loads((d / INDEX).read_text())["weight_map"][name]


# -- 1, 7: which file each tensor comes from ---------------------------------------------------------------
def test_stray_copy_beside_an_unindexed_checkpoint(ckpt, tmp_path):
    save_file({UP: torch.zeros(48, 32)}, str(ckpt / "old.safetensors"))
    load_error(ckpt, tmp_path, UP, "stored twice", "model.safetensors", "old.safetensors")


def test_shard_repeating_a_tensor_the_index_puts_elsewhere(sharded, tmp_path):
    home = shard_of(sharded, UP)
    other = next(f for f in sorted(sharded.glob("*.safetensors")) if f != home)
    edit_tensors(other, lambda ts: ts.__setitem__(UP, torch.zeros(48, 32)))
    load_error(sharded, tmp_path, UP, other.name, home.name, INDEX)


def test_shard_holding_a_tensor_the_index_does_not_list(sharded, tmp_path):
    edit_tensors(shard_of(sharded, UP), lambda ts: ts.__setitem__("backbone.layers.4.mixer.extra", torch.zeros(2)))
    load_error(sharded, tmp_path, "backbone.layers.4.mixer.extra", "does not list it", INDEX)


def test_tensor_in_the_index_but_not_in_its_shard(sharded, tmp_path):
    home = shard_of(sharded, UP)
    edit_tensors(home, lambda ts: ts.pop(UP))
    load_error(sharded, tmp_path, UP, home.name, "does not hold it")


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink", "hidden"])
def test_index_entry_escaping_the_checkpoint(sharded, tmp_path, how):
    home = shard_of(sharded, UP)
    outside = tmp_path / "outside.safetensors"
    shutil.copy(home, outside)  # a perfectly good copy: following the entry would load it
    name = {"dotdot": "../outside.safetensors", "absolute": str(outside), "symlink": "link.safetensors",
            "hidden": ".staging.safetensors"}[how]
    if how == "symlink":
        (sharded / name).symlink_to(outside)
    if how == "hidden":
        shutil.copy(home, sharded / name)
    edit_json(sharded / INDEX, lambda ix: ix["weight_map"].update(
        {k: name for k, v in ix["weight_map"].items() if v == home.name}))
    load_error(sharded, tmp_path, name, INDEX if how != "symlink" else "outside")


def test_index_entry_that_is_not_a_file_name(sharded, tmp_path):
    edit_json(sharded / INDEX, lambda ix: ix["weight_map"].__setitem__(UP, 3))
    load_error(sharded, tmp_path, UP, "weight_map", INDEX)


def test_symlink_outside_an_unindexed_checkpoint(ckpt, tmp_path):
    (ckpt / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    (ckpt / "model.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    load_error(ckpt, tmp_path, "model.safetensors", "outside")


def test_hf_cache_snapshot_symlinks_load(good, tmp_path, ids):
    """The Hugging Face hub cache keeps files in blobs/ and symlinks them from snapshots/<rev>/."""
    repo = tmp_path / "models--x--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    for f in good.iterdir():
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    torch.testing.assert_close(logits(ir.load(snap), ids), logits(ir.load(good), ids), rtol=1e-5, atol=1e-5)


def test_index_is_authoritative_and_hidden_files_are_not_shards(sharded, good_sharded, tmp_path, ids):
    """A stray file beside an indexed checkpoint, a hidden staging file or directory: none is read."""
    home = shard_of(sharded, UP)
    bogus = {UP: torch.full((48, 32), 7.0)}
    save_file(bogus, str(sharded / "stray.safetensors"))
    save_file(bogus, str(sharded / ".model.safetensors"))
    (sharded / ".staging").mkdir()
    save_file(bogus, str(sharded / ".staging" / "model.safetensors"))
    prog = ir.load(sharded)
    assert prog.weights.source(UP) == home
    torch.testing.assert_close(logits(prog, ids), logits(ir.load(good_sharded), ids), rtol=1e-5, atol=1e-5)


def test_hidden_files_beside_an_unindexed_checkpoint_are_not_shards(ckpt):
    save_file({UP: torch.full((48, 32), 7.0)}, str(ckpt / ".model.safetensors.partial.safetensors"))
    (ckpt / ".tmp.safetensors").mkdir()
    prog = ir.load(ckpt)
    assert prog.weights.source(UP) == ckpt / "model.safetensors"


# -- 2: safetensors headers, byte by byte ------------------------------------------------------------------
def raw_file(header, data: bytes, length: int | None = None) -> bytes:
    """A safetensors file from a header (a dict, or raw bytes) and the data region."""
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(h) if length is None else length) + h + data


def two(a_offsets=(0, 8), b_offsets=(8, 20), a=None, b=None) -> dict:
    """Two F32 tensors: a [2] and b [3], at the given offsets; `a` / `b` replace their entries."""
    return {"a": a or {"dtype": "F32", "shape": [2], "data_offsets": list(a_offsets)},
            "b": b or {"dtype": "F32", "shape": [3], "data_offsets": list(b_offsets)}}


BAD_HEADERS = {  # id -> (file bytes, message part, does the safetensors library refuse it too?)
    "overlap": (raw_file(two(b_offsets=(4, 16)), bytes(16)), "overlaps 'a'", True),
    "same-range": (raw_file(two(b_offsets=(0, 12), b={"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}),
                            bytes(12)), "overlaps", True),
    "gap": (raw_file(two(b_offsets=(12, 24)), bytes(24)), "4 unused bytes", True),
    "not-from-0": (raw_file(two((4, 12), (12, 24)), bytes(24)), "unused bytes", True),
    "negative-offset": (raw_file(two((-8, 0), (0, 12)), bytes(12)), "data_offsets [-8, 0]", True),
    "start-after-end": (raw_file(two((8, 0)), bytes(20)), "data_offsets [8, 0]", True),
    "float-offsets": (raw_file(two((0.0, 8.0)), bytes(20)), "data_offsets [0.0, 8.0]", True),
    "bool-offset": (raw_file(two((False, 8)), bytes(20)), "data_offsets [False, 8]", True),
    "three-offsets": (raw_file(two(a={"dtype": "F32", "shape": [2], "data_offsets": [0, 8, 8]}), bytes(20)),
                      "data_offsets [0, 8, 8]", True),
    "size-mismatch": (raw_file(two((0, 12), (12, 24)), bytes(24)), "needs 8", True),
    "negative-dim": (raw_file(two(a={"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}), bytes(20)),
                     "shape [-2]", True),
    "float-dim": (raw_file(two(a={"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}), bytes(20)),
                  "shape [2.0]", True),
    "unknown-dtype": (raw_file(two(a={"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}), bytes(20)),
                      "dtype 'Q7'", True),
    "entry-not-object": (raw_file({"a": 5}, b""), "tensor 'a'", True),
    "trailing-bytes": (raw_file(two(), bytes(24)), "4 trailing bytes", True),
    "short-data": (raw_file(two(), bytes(16)), "truncated", True),
    "header-past-eof": (raw_file(two(), bytes(20), length=10**6), "header length 1000000", True),
    "header-not-utf8": (raw_file(b'{"a\xff": {}}', b""), "not a readable safetensors file", True),
    "header-a-list": (raw_file(b"[1, 2]", b""), "not a JSON object", True),
    "deeply-nested": (raw_file(b"[" * 100_000 + b"]" * 100_000, b""), "not a readable safetensors file", True),
    "metadata-not-strings": (raw_file({"__metadata__": {"format": 1}, **two()}, bytes(20)), "__metadata__", True),
    "repeated-name": (raw_file(b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
                               b'"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}', bytes(16)),
                      "'a' appears twice", False),
}


def test_a_well_formed_crafted_file_passes(tmp_path):
    f = tmp_path / "ok.safetensors"
    f.write_bytes(raw_file(two(), struct.pack("<5f", 1, 2, 3, 4, 5)))
    t = lazy_tensors(f)
    assert torch.equal(t["b"].read(), torch.tensor([3.0, 4.0, 5.0]))
    with safe_open(str(f), framework="pt") as h:
        assert sorted(h.keys()) == ["a", "b"]


@pytest.mark.parametrize("case", list(BAD_HEADERS))
def test_bad_safetensors_header(ckpt, tmp_path, case):
    data, part, library_refuses = BAD_HEADERS[case]
    f = ckpt / "model.safetensors"
    f.write_bytes(data)
    load_error(ckpt, tmp_path, str(f), part)
    if library_refuses:  # as strict as the reference implementation
        with pytest.raises(SafetensorError), safe_open(str(f), framework="pt") as h:
            [h.get_tensor(k) for k in h.keys()]


def test_header_over_the_length_limit(ckpt, tmp_path, monkeypatch):
    monkeypatch.setattr(weights_module, "MAX_HEADER_BYTES", 64)
    (ckpt / "model.safetensors").write_bytes(raw_file(two(), bytes(20)))
    load_error(ckpt, tmp_path, "model.safetensors", "64-byte limit")


# -- 3: stored dtypes that differ from the model's ---------------------------------------------------------
@pytest.mark.parametrize("model,stored,lossy", [("bfloat16", "float32", True), ("bfloat16", "float16", True),
                                                ("float16", "bfloat16", True), ("float32", "float16", False)])
def test_float_tensor_in_another_dtype_is_cast_on_read(tmp_path, small_program, ids, model, stored, lossy):
    """Cast to the model's dtype (else the first matmul fails), with a warning and a note when it loses precision."""
    model_dt, stored_dt = getattr(torch, model), getattr(torch, stored)
    prog = small_program.copy()
    for n in prog.nodes:
        for local, full in n.weight_names().items():
            if local not in n.op.fp32_params():
                prog.weights.set(full, prog.weights.get(full).to(model_dt))
    prog.meta["dtype"] = model
    ir.save(prog, tmp_path / "a", extended=True)
    edit_tensors(tmp_path / "a" / "model.safetensors", lambda ts: ts.__setitem__(UP, ts[UP].to(stored_dt)))
    before = digest(tmp_path / "a")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = ir.load(tmp_path / "a")
    assert digest(tmp_path / "a") == before
    notes = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
    if lossy:
        assert len(notes) == 1 and f"{UP} {stored} -> {model}" in notes[0] and str(tmp_path / "a") in notes[0]
        assert any(UP in note for note in loaded.meta["notes"])
    else:
        assert notes == [] and "notes" not in loaded.meta
    assert loaded.weights.dtype(UP) == model_dt and loaded.weights.get(UP).dtype == model_dt
    want = prog.copy()
    want.weights.set(UP, prog.weights.get(UP).to(stored_dt).to(model_dt))
    for g, r in zip(logits(loaded, ids), logits(want, ids)):
        assert g.dtype == model_dt
        torch.testing.assert_close(g.float(), r.float(), rtol=1e-5, atol=1e-5)


def test_widening_a_float32_only_weight_is_silent(tmp_path, small_program, ids):
    """A router weight stored in bfloat16 is read as the float32 its op keeps, with no warning."""
    prog = small_program.copy()
    prog.weights.set(GATE, prog.weights.get(GATE).to(torch.bfloat16))
    edited = tmp_path / "a"
    ir.save(small_program, edited, extended=True)
    edit_tensors(edited / "model.safetensors", lambda ts: ts.__setitem__(GATE, ts[GATE].to(torch.bfloat16)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = ir.load(edited)
    assert loaded.weights.dtype(GATE) == torch.float32 and "notes" not in loaded.meta
    want = small_program.copy()
    want.weights.set(GATE, prog.weights.get(GATE).float())
    for g, r in zip(logits(loaded, ids), logits(want, ids)):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


def test_integer_tensor_where_a_float_is_expected(ckpt, tmp_path):
    edit_tensors(ckpt / "model.safetensors", lambda ts: ts.__setitem__(UP, ts[UP].to(torch.int32)))
    load_error(ckpt, tmp_path, "mixer.up_proj.weight", "backbone.layers.4", "int32", "floating-point")


def test_fp8_tensor_without_a_quantization_config(ckpt, tmp_path):
    edit_tensors(ckpt / "model.safetensors", lambda ts: ts.__setitem__(UP, ts[UP].to(torch.float8_e4m3fn)))
    load_error(ckpt, tmp_path, UP, "float8_e4m3fn", "quantization config")


# -- 4: config types, ranges and sizes ---------------------------------------------------------------------
def tiny_hf_config(**changes) -> dict:
    cfg = {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
        "hidden_size": 32, "vocab_size": 64, "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False,
        "hybrid_override_pattern": "M*E-ME", "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 8,
        "n_groups": 2, "chunk_size": 4, "conv_kernel": 4, "use_conv_bias": True,
        "time_step_limit": [0.001, {"__float__": "Infinity"}],
        "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "moe_shared_expert_intermediate_size": 24, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
        "norm_topk_prob": True, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "intermediate_size": 48, "num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "*E",
        "torch_dtype": "float32",
    }
    cfg.update(changes)
    return cfg


BAD_HF_FIELDS = [  # (changes, parts of the message)
    ({"hidden_size": "64"}, ["'hidden_size'", "integer", "'64'"]),
    ({"hidden_size": 32.0}, ["'hidden_size'", "integer"]),
    ({"n_routed_experts": True}, ["'n_routed_experts'", "integer"]),
    ({"mamba_num_heads": -4}, ["'mamba_num_heads'", "-4"]),
    ({"num_nextn_predict_layers": "1"}, ["'num_nextn_predict_layers'", "'1'"]),
    ({"layers_block_type": [1]}, ["layers_block_type", "position 0"]),
    ({"layers_block_type": [["moe"]]}, ["layers_block_type", "position 0"]),
    ({"hybrid_override_pattern": {"M": 1}}, ["'hybrid_override_pattern'", "string or a list"]),
    ({"mtp_hybrid_override_pattern": 7}, ["'mtp_hybrid_override_pattern'"]),
    ({"layer_norm_epsilon": 0}, ["'layer_norm_epsilon'", "> 0"]),
    ({"layer_norm_epsilon": -1e-5}, ["'layer_norm_epsilon'", "> 0"]),
    ({"layer_norm_epsilon": float("nan")}, ["'layer_norm_epsilon'", "finite"]),
    ({"layer_norm_epsilon": 10**400}, ["'layer_norm_epsilon'", "finite"]),
    ({"routed_scaling_factor": float("inf")}, ["'routed_scaling_factor'", "finite"]),
    ({"time_step_limit": [-0.001, {"__float__": "Infinity"}]}, ["'time_step_limit'", "0 <= low"]),
    ({"time_step_limit": "0.001"}, ["'time_step_limit'", "[low, high]"]),
    ({"time_step_limit": [0.1, 0.01]}, ["'time_step_limit'", "0 <= low <= high"]),
    ({"tie_word_embeddings": "false"}, ["'tie_word_embeddings'", "true or false"]),
    ({"torch_dtype": "int64"}, ["'torch_dtype'", "int64"]),
    ({"torch_dtype": 16}, ["'torch_dtype'", "string"]),
    ({"num_attention_heads": 0}, ["'num_attention_heads'", "must be > 0"]),
    ({"num_hidden_layers": 7}, ["num_hidden_layers", "7", "6 layers"]),
    ({"block_configs": 3}, ["'block_configs'", "list"]),
]


@pytest.mark.parametrize("changes,parts", BAD_HF_FIELDS, ids=[f"{next(iter(c))}={next(iter(c.values()))!r}"[:40]
                                                           for c, _ in BAD_HF_FIELDS])
def test_hf_config_field_of_the_wrong_type_or_range(tmp_path, changes, parts):
    f = tmp_path / "config.json"
    f.write_text(json.dumps(tiny_hf_config(**changes)))
    load_error(f, tmp_path, "config.json", *parts)


BAD_OUR_FIELDS = [  # (edit of our config, parts of the message)
    (lambda c: c.update(block_configs=[1]), ["block_configs[0]", "must be an object"]),
    (lambda c: c.update(mtp=[]), ["'mtp'", "an object"]),
    (lambda c: c["block_configs"][2].update(block_type=["moe"]), ["block_configs[2]", "block_type"]),
    (lambda c: c["block_configs"][2].update(block_type="embed"), ["block_configs[2]", "'embed'"]),
    (lambda c: c["block_configs"][4].update(d_ff="48"), ["block_configs[4]", "d_ff", "'48'"]),
    (lambda c: c["block_configs"][4].update(eps=0.0), ["backbone.layers.4", "eps", "> 0"]),
    (lambda c: c["block_configs"][0].update(dt_min=-1.0), ["backbone.layers.0", "dt_min"]),
    (lambda c: c["block_configs"][1].update(scaling=10**400), ["block_configs[1]", "scaling"]),
    (lambda c: c["mtp"].update(blocks=3), ["mtp.blocks", "list"]),
    (lambda c: c["mtp"].update(block_type="moe"), ["mtp", "'moe'"]),
    (lambda c: c.update(num_nextn_predict_layers=0), ["num_nextn_predict_layers", "mtp"]),
]


@pytest.mark.parametrize("edit,parts", BAD_OUR_FIELDS, ids=[str(i) for i in range(len(BAD_OUR_FIELDS))])
def test_our_config_field_of_the_wrong_type_or_range(ckpt, tmp_path, edit, parts):
    edit_json(ckpt / "config.json", edit)
    load_error(ckpt, tmp_path, "config.json", *parts)


@pytest.mark.parametrize("config_text,part", [
    ('{"hidden_size": 32, "hidden_size": 64}', "'hidden_size' appears twice"),
    ("[" * 100_000 + "]" * 100_000, "not usable JSON"),
], ids=["repeated-field", "deeply-nested"])
def test_config_json_that_parses_badly(tmp_path, config_text, part):
    (tmp_path / "config.json").write_text(config_text)
    load_error(tmp_path / "config.json", tmp_path, "config.json", part)


@pytest.mark.parametrize("changes,part", [
    ({"n_routed_experts": 10**9}, "weight tensors"),
    ({"num_hidden_layers": 10**6}, "num_hidden_layers is 1,000,000"),
    ({"hybrid_override_pattern": "M" * 10**6}, "hybrid_override_pattern declares 1,000,000 layers"),
    ({"hidden_size": 10**12}, "backbone.embeddings.weight"),
    ({"vocab_size": 10**9}, "backbone.embeddings.weight"),
    ({"moe_intermediate_size": 10**7}, "parameters"),
], ids=["experts", "num_hidden_layers", "pattern", "hidden", "vocab", "params"])
def test_absurd_sizes_fail_fast(tmp_path, changes, part):
    f = tmp_path / "config.json"
    f.write_text(json.dumps({**json.loads(SUPER.read_text()), **changes}))
    t0 = time.perf_counter()
    load_error(f, tmp_path, "config.json", part, "puzzlekit accepts" if "num_hidden" not in part else "agree")
    assert time.perf_counter() - t0 < 1.0


def test_absurd_sizes_in_our_format_fail_fast(ckpt, tmp_path):
    edit_json(ckpt / "config.json", lambda c: c["block_configs"][1].update(experts=10**9))
    t0 = time.perf_counter()
    load_error(ckpt, tmp_path, "weight tensors")
    assert time.perf_counter() - t0 < 1.0


def test_real_config_still_loads_fast():
    t0 = time.perf_counter()
    ir.verify(ir.load(SUPER))
    assert time.perf_counter() - t0 < 2.0


# -- 5, 6: transformers (tied heads, tracing without kwargs) -----------------------------------------------
LETTER = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}


def hf_model(tied: bool, equal_head: bool, pattern: str = "ME*-ME"):
    """A tiny transformers NemotronH with O(0.3) weights, tied in the config; the head copies the
    embedding if `equal_head` (transformers' NemotronH itself never ties them)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.NemotronHConfig(
        vocab_size=64, hidden_size=32, layers_block_type=[LETTER[c] for c in pattern], num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=48, mamba_num_heads=4, mamba_head_dim=8, n_groups=2,
        ssm_state_size=8, conv_kernel=4, chunk_size=4, time_step_limit=(0.01, float("inf")), n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=24,
        routed_scaling_factor=2.0, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = transformers.NemotronHForCausalLM(cfg).float().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "A_log":
                p.copy_(torch.log(torch.arange(1, p.numel() + 1, dtype=torch.float32)))
            elif leaf == "dt_bias":
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 - 3.0)
            elif "norm" in name or leaf == "D":
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_((0.05 if leaf == "e_score_correction_bias" else 0.3) * torch.randn(p.shape, generator=g))
        if equal_head:
            model.lm_head.weight.copy_(model.model.embeddings.weight)
    return model


def hf_ids():
    return torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(6))


def test_transformers_tied_checkpoint_loads_and_matches(tmp_path):
    model = hf_model(tied=True, equal_head=True)
    model.save_pretrained(tmp_path / "tied")
    with safe_open(str(tmp_path / "tied" / "model.safetensors"), framework="pt") as h:
        assert "lm_head.weight" in h.keys()  # transformers stores the head anyway
    prog = ir.load(tmp_path / "tied")
    assert prog.node("lm_head").op.tied and "lm_head.weight" not in prog.weights
    assert any("lm_head.weight" in note for note in prog.meta["notes"])
    ids = hf_ids()
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
    assert want.abs().max() > 0.1
    torch.testing.assert_close(logits(prog, ids), want, rtol=1e-5, atol=1e-5)


def test_transformers_tied_config_with_a_different_head_loads_as_transformers_computes(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = hf_model(tied=True, equal_head=False)
    d = tmp_path / "untied"
    model.save_pretrained(d)
    before = digest(d)
    with pytest.warns(CheckpointWarning, match=r"tie_word_embeddings=true.*'lm_head.weight' differs"):
        prog = ir.load(d)
    assert not prog.node("lm_head").op.tied and "lm_head.weight" in prog.weights
    ids = hf_ids()
    with torch.no_grad():  # the oracle: transformers' own loading of the same directory
        want = transformers.NemotronHForCausalLM.from_pretrained(d).float().eval()(ids, use_cache=False).logits
        tied = torch.nn.functional.linear(model.model(ids, use_cache=False).last_hidden_state,  # after norm_f
                                          model.model.embeddings.weight)
    assert (want - tied).abs().max() > 0.1  # a head tied to the embedding would compute something else
    torch.testing.assert_close(logits(prog, ids), want, rtol=1e-5, atol=1e-5)
    assert digest(d) == before
    ir.save(prog, tmp_path / "resaved")
    assert json.loads((tmp_path / "resaved" / "config.json").read_text())["tie_word_embeddings"] is False


def test_trace_a_transformers_model_without_kwargs():
    import puzzlekit

    model = hf_model(tied=False, equal_head=False, pattern="M*E")
    ids = hf_ids()
    prog = puzzlekit.trace(model, (ids,))  # no kwargs={"use_cache": False}: no DynamicCache error
    assert [n.op.kind for n in prog.blocks()] == ["mamba2", "attention", "moe"]
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
    torch.testing.assert_close(logits(prog, ids), want, rtol=1e-5, atol=1e-5)


# -- CLI -----------------------------------------------------------------------------------------------------
def make_stray(d: Path):
    save_file({UP: torch.zeros(48, 32)}, str(d / "old.safetensors"))
    return ["stored twice", "old.safetensors", UP]


def make_overlap(d: Path):
    (d / "model.safetensors").write_bytes(BAD_HEADERS["overlap"][0])
    return ["model.safetensors", "overlaps"]


@pytest.mark.parametrize("make", [make_stray, make_overlap], ids=["stray", "overlap"])
def test_cli_inspect_reports_bad_checkpoints(ckpt, tmp_path, make, capsys):
    from puzzlekit.tools.cli import main

    parts = make(ckpt)
    before = digest(tmp_path)
    code = main(["inspect", str(ckpt)])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "Traceback" not in err and err.startswith("puzzlekit inspect: error:")
    for p in parts:
        assert p in err
    assert digest(tmp_path) == before
