"""Checkpoint IO: byte-exact round trips, sharding, the real configs as meta programs, and bad inputs."""
from __future__ import annotations

import importlib
import json
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from puzzlekit import ir
from puzzlekit.backends.torch import materialize, random_weights
from puzzlekit.errors import CheckpointError, PuzzlekitError
from puzzlekit.outputs import OutputError
from puzzlekit.tools.default_model import config_path


SUPER = config_path("nemotron-3-super-120b-a12b")
NANO = config_path("nemotron-3-nano-30b-a3b")
ckpt_module = importlib.import_module("puzzlekit.ir.checkpoint_write")  # save() and its save_file


# -- helpers ---------------------------------------------------------------------------------------------
def tensor_bytes(d: Path) -> dict[str, tuple[str, tuple, bytes]]:
    """name -> (dtype, shape, raw bytes) for every tensor of every safetensors file in `d`."""
    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                t = h.get_tensor(k)
                assert k not in out, f"{k} is stored twice"
                out[k] = (str(t.dtype), tuple(t.shape), t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return out


def program_bytes(prog: ir.Program) -> dict[str, tuple[str, tuple, bytes]]:
    w = prog.weights
    return {k: (str(w.get(k).dtype), tuple(w.get(k).shape),
                w.get(k).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()) for k in w.names()}


def dir_bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(d).iterdir()) if p.is_file()}


def bf16_copy(prog: ir.Program) -> ir.Program:
    """The program with every tensor cast to bfloat16, except the ones the op keeps in float32."""
    out = prog.copy()
    for n in out.nodes:
        fp32 = n.op.fp32_params()
        for local, full in n.weight_names().items():
            if local not in fp32:
                out.weights.set(full, out.weights.get(full).to(torch.bfloat16))
    out.meta["dtype"] = "bfloat16"
    return out


def logits(prog: ir.Program, ids: torch.Tensor):
    with torch.no_grad():
        return materialize(prog)(ids)


def saved(prog, d: Path, **kw) -> Path:
    ir.save(prog, d, **kw, extended=True)
    return d


def rewrite_tensors(file: Path, edit) -> None:
    """Loads every tensor of a safetensors file, lets `edit(dict)` change it, and writes it back."""
    ts = load_file(str(file))
    edit(ts)
    save_file(ts, str(file), metadata={"format": "pt"})


def tiny_hf_config(**changes) -> dict:
    cfg = {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
        "hidden_size": 32, "vocab_size": 64, "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False,
        "hybrid_override_pattern": "M*E-ME",
        "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 8, "n_groups": 2, "chunk_size": 4,
        "conv_kernel": 4, "use_conv_bias": True,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "moe_shared_expert_intermediate_size": 24, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 48,
        "num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "*E",
        "torch_dtype": "float32",
    }
    cfg.update(changes)
    return cfg


def write_hf_checkpoint(d: Path, cfg: dict, seed: int = 0) -> Path:
    """An HF-layout checkpoint (config.json + model.safetensors) for `cfg`, random weights."""
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    prog = ir.load(d / "config.json")  # meta
    random_weights(prog, seed=seed, std=0.3)
    save_file({k: prog.weights.get(k).contiguous() for k in prog.weights.names()}, str(d / "model.safetensors"),
              metadata={"format": "pt"})
    return d


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory, make_small_program) -> Path:
    """A saved small program (one shard), read-only for the tests: they copy it before editing."""
    return saved(make_small_program(), tmp_path_factory.mktemp("good") / "ckpt")


@pytest.fixture
def bad_dir(good_dir, tmp_path) -> Path:
    import shutil

    d = tmp_path / "bad"
    shutil.copytree(good_dir, d)
    return d


def load_error(path, **kw) -> str:
    """Loads `path` expecting a CheckpointError (and nothing else); returns its message."""
    try:
        ir.load(path, **kw)
    except CheckpointError as e:
        return str(e)
    except Exception as e:  # pragma: no cover - a failure, reported with the real type
        pytest.fail(f"expected CheckpointError, got {type(e).__name__}: {e}")
    pytest.fail("expected CheckpointError, the load succeeded")


# -- round trips -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shard", [None, 4000], ids=["one-file", "sharded"])
def test_save_load_save_is_byte_identical(tmp_path, small_program, dtype, shard):
    prog = small_program if dtype == "float32" else bf16_copy(small_program)
    kw = {} if shard is None else {"max_shard_bytes": shard}
    a = saved(prog, tmp_path / "a", **kw)
    files = sorted(p.name for p in a.iterdir())
    if shard is None:
        assert files == ["config.json", "model.safetensors"]
    else:
        shards = [f for f in files if f.endswith(".safetensors")]
        assert len(shards) > 2 and "model.safetensors.index.json" in files
        index = json.loads((a / "model.safetensors.index.json").read_text())
        assert sorted(index["weight_map"]) == sorted(prog.weights.names())
        assert sorted(set(index["weight_map"].values())) == shards
        for f in shards:  # no shard over the limit unless it holds a single bigger tensor
            with safe_open(str(a / f), framework="pt") as h:
                keys = list(h.keys())
                size = sum(prog.weights.nbytes(k) for k in keys)
                assert size <= shard or len(keys) == 1

    loaded = ir.load(a)
    assert loaded.meta["dtype"] == dtype
    assert not loaded.is_meta
    for k in loaded.weights.names():
        assert loaded.weights.source(k) is not None  # lazy, from the files
    b = saved(loaded, tmp_path / "b", **kw)

    first, second = tensor_bytes(a), tensor_bytes(b)
    assert sorted(first) == sorted(prog.weights.names())
    assert first == program_bytes(prog)  # written exactly as stored
    assert second == first
    assert sorted(p.name for p in b.iterdir()) == files
    assert (b / "config.json").read_text() == (a / "config.json").read_text()
    if shard is not None:
        assert (b / "model.safetensors.index.json").read_text() == (a / "model.safetensors.index.json").read_text()
    # dtypes as stored: router weights stay float32 in the bfloat16 copy
    gate = "backbone.layers.1.mixer.gate.weight"
    assert loaded.weights.dtype(gate) == torch.float32
    up = "backbone.layers.1.mixer.experts.0.up_proj.weight"
    assert loaded.weights.dtype(up) == getattr(torch, dtype)


@pytest.mark.parametrize("shard", [None, 4000], ids=["one-file", "sharded"])
def test_loaded_program_prints_and_runs_identically(tmp_path, small_program, ids, shard):
    kw = {} if shard is None else {"max_shard_bytes": shard}
    loaded = ir.load(saved(small_program, tmp_path / "c", **kw))
    assert ir.print_program(loaded) == ir.print_program(small_program)
    assert [(n.name, n.op, n.args, n.path) for n in loaded.nodes] == \
        [(n.name, n.op, n.args, n.path) for n in small_program.nodes]
    assert loaded.outputs == small_program.outputs
    ir.verify(loaded, check_finite=True)
    want, got = logits(small_program, ids), logits(loaded, ids)
    assert len(want) == len(got) == 2  # logits and MTP logits
    for w, g in zip(want, got):
        assert g.dtype == w.dtype and g.shape == w.shape == (2, 11, 64)
        assert torch.equal(g, w)


def test_hf_layers_block_type_and_pattern_give_the_same_program_meta(tmp_path):
    cfg = json.loads(NANO.read_text())
    names = {"M": "mamba", "E": "moe", "*": "attention", "-": "mlp"}
    listed = dict(cfg)
    listed["layers_block_type"] = [names[c] for c in listed.pop("hybrid_override_pattern")]
    (tmp_path / "pattern.json").write_text(json.dumps(cfg))
    (tmp_path / "listed.json").write_text(json.dumps(listed))
    a, b = ir.load(tmp_path / "pattern.json"), ir.load(tmp_path / "listed.json")
    assert [(n.name, n.op, n.args, n.path) for n in a.nodes] == [(n.name, n.op, n.args, n.path) for n in b.nodes]
    assert ir.print_program(a) == ir.print_program(b)
    assert a.param_counts() == b.param_counts()


def test_hf_layers_block_type_and_pattern_give_the_same_program_with_weights(tmp_path, make_ids):
    a_cfg = tiny_hf_config()
    b_cfg = tiny_hf_config(layers_block_type=["mamba", "attention", "moe", "mlp", "mamba", "moe"],
                           mtp_layers_block_type=["attention", "moe"])
    del b_cfg["hybrid_override_pattern"], b_cfg["mtp_hybrid_override_pattern"]
    a = ir.load(write_hf_checkpoint(tmp_path / "a", a_cfg, seed=3))
    b = ir.load(write_hf_checkpoint(tmp_path / "b", b_cfg, seed=3))
    ir.verify(a)
    ir.verify(b)
    assert [n.op.kind for n in a.blocks()] == ["mamba2", "attention", "moe", "mlp", "mamba2", "moe"]
    assert a.find("mtp")[0].op.pattern == "*E"
    assert [(n.name, n.op, n.args, n.path) for n in a.nodes] == [(n.name, n.op, n.args, n.path) for n in b.nodes]
    assert ir.print_program(a) == ir.print_program(b)
    assert tensor_bytes(tmp_path / "a") == tensor_bytes(tmp_path / "b")
    ids = make_ids(seed=5)
    for x, y in zip(logits(a, ids), logits(b, ids)):
        assert torch.equal(x, y)


def test_tied_lm_head_round_trip(tmp_path, small_program, ids):
    from puzzlekit.ir import Node
    from puzzlekit.ir.ops import LMHead

    i = small_program.nodes.index(small_program.node("lm_head"))
    small_program.nodes[i] = Node("logits", LMHead(64, 32, tied=True), ("h",), "lm_head")
    small_program.weights.delete("lm_head.weight")
    ir.verify(small_program)
    a = saved(small_program, tmp_path / "a")
    assert json.loads((a / "config.json").read_text())["tie_word_embeddings"] is True
    loaded = ir.load(a)
    assert "lm_head.weight" not in loaded.weights
    assert ir.print_program(loaded) == ir.print_program(small_program)
    b = saved(loaded, tmp_path / "b")
    assert tensor_bytes(b) == tensor_bytes(a)
    for w, g in zip(logits(small_program, ids), logits(loaded, ids)):
        assert torch.equal(w, g)


# -- the real configs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [SUPER, NANO], ids=["super", "nano"])
def test_real_configs_load_as_meta_programs_fast(cfg):
    t0 = time.perf_counter()
    prog = ir.load(cfg)
    ir.verify(prog)
    text = ir.print_program(prog)
    elapsed = time.perf_counter() - t0
    assert elapsed < 2.0, f"load + verify + print of {cfg.name} took {elapsed:.2f}s"
    assert text.endswith("\n") and "%logits = lm_head" in text
    names = prog.weights.names()
    assert names and prog.is_meta
    assert all(prog.weights.is_meta(k) for k in names)
    assert all(prog.weights.source(k) is None for k in names)
    # dtypes follow the config, with the router in float32
    assert prog.meta["dtype"] == "bfloat16"
    moe = prog.blocks("moe")[0]
    assert prog.weights.dtype(f"{moe.path}.mixer.gate.weight") == torch.float32
    assert prog.weights.dtype(f"{moe.path}.mixer.experts.0.up_proj.weight") == torch.bfloat16
    # the trunk follows the pattern
    pattern = json.loads(cfg.read_text())["hybrid_override_pattern"]
    letters = {"mamba2": "M", "moe": "E", "attention": "*", "mlp": "-"}
    assert "".join(letters[n.op.kind] for n in prog.blocks()) == pattern


def test_super_param_counts():
    c = ir.load(SUPER).param_counts()
    assert 120.6e9 <= c["total"] <= 120.7e9
    assert 12.7e9 <= c["active"] <= 12.8e9
    assert c["mtp_total"] > 0 and c["mtp_active"] > 0
    assert c["mtp_active"] < c["mtp_total"]
    # the MTP head is reported apart, not folded into the trunk
    assert "mtp" not in c["by_kind"]
    assert sum(v["total"] for v in c["by_kind"].values()) == c["total"]
    assert sum(v["active"] for v in c["by_kind"].values()) == c["active"]
    assert c["by_kind"]["moe"]["count"] == 40 and c["by_kind"]["mamba2"]["count"] == 40
    assert c["by_kind"]["attention"]["count"] == 8


def test_nano_param_counts():
    c = ir.load(NANO).param_counts()
    assert abs(c["total"] - 31.6e9) <= 0.1e9
    assert abs(c["active"] - 3.6e9) <= 0.1e9
    assert c["mtp_total"] == 0 and c["mtp_active"] == 0
    assert ir.load(NANO).find("mtp") == []


def test_loading_super_config_allocates_far_less_than_its_weights():
    tracemalloc.start()
    try:
        prog = ir.load(SUPER)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    weights_bytes = sum(prog.weights.nbytes(k) for k in prog.weights.names())
    assert weights_bytes > 200e9  # ~120B parameters, mostly bfloat16
    assert peak < 200e6, f"loading the Super config allocated {peak / 1e6:.0f} MB"


# -- bad checkpoints -------------------------------------------------------------------------------------
def test_missing_tensor(bad_dir):
    full = "backbone.layers.1.mixer.experts.2.down_proj.weight"
    rewrite_tensors(bad_dir / "model.safetensors", lambda ts: ts.pop(full))
    msg = load_error(bad_dir)
    assert "mixer.experts.2.down_proj.weight" in msg and "backbone.layers.1" in msg
    assert "missing" in msg


def test_missing_tensor_in_mtp_head(bad_dir):
    rewrite_tensors(bad_dir / "model.safetensors", lambda ts: ts.pop("mtp.layers.0.eh_proj.weight"))
    msg = load_error(bad_dir)
    assert "layers.0.eh_proj.weight" in msg and "mtp" in msg and "missing" in msg


def test_wrong_shape(bad_dir):
    full = "backbone.layers.3.mixer.q_proj.weight"
    rewrite_tensors(bad_dir / "model.safetensors", lambda ts: ts.__setitem__(full, torch.zeros(16, 32)))
    msg = load_error(bad_dir)
    assert "mixer.q_proj.weight" in msg and "backbone.layers.3" in msg
    assert "[16, 32]" in msg and "[32, 32]" in msg


def test_extra_tensor_that_belongs_to_no_node(bad_dir):
    rewrite_tensors(bad_dir / "model.safetensors",
                    lambda ts: ts.__setitem__("backbone.layers.3.mixer.rotary.inv_freq", torch.zeros(4)))
    msg = load_error(bad_dir)
    assert "backbone.layers.3.mixer.rotary.inv_freq" in msg and "belongs to no node" in msg


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_weights(bad_dir, value):
    full = "backbone.layers.4.mixer.up_proj.weight"

    def poison(ts):
        ts[full] = ts[full].clone()
        ts[full][3, 5] = value

    rewrite_tensors(bad_dir / "model.safetensors", poison)
    msg = load_error(bad_dir, check_finite=True)
    assert "mixer.up_proj.weight" in msg and "backbone.layers.4" in msg
    assert "NaN or inf" in msg
    prog = ir.load(bad_dir, check_finite=False)  # the default: no scan, no error
    assert not bool(torch.isfinite(prog.weights.get(full)).all())
    ir.load(bad_dir)


def test_non_finite_bfloat16_weight(tmp_path, small_program):
    d = saved(bf16_copy(small_program), tmp_path / "bf")
    full = "backbone.layers.0.mixer.out_proj.weight"

    def poison(ts):
        ts[full] = ts[full].clone()
        ts[full][0, 0] = float("nan")

    rewrite_tensors(d / "model.safetensors", poison)
    msg = load_error(d, check_finite=True)
    assert "mixer.out_proj.weight" in msg and "backbone.layers.0" in msg


@pytest.mark.parametrize("pattern,bad", [("MX*", "X"), ("M E", " "), ("ME*E?", "?")])
def test_unknown_layer_letter_in_pattern(tmp_path, pattern, bad):
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config(hybrid_override_pattern=pattern)))
    msg = load_error(tmp_path / "config.json")
    assert "hybrid_override_pattern" in msg and repr(bad) in msg
    assert f"position {pattern.index(bad)}" in msg
    assert "config.json" in msg


def test_unknown_mtp_layer_letter(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config(mtp_hybrid_override_pattern="*Q")))
    msg = load_error(tmp_path / "config.json")
    assert "mtp_hybrid_override_pattern" in msg and "'Q'" in msg


def test_unknown_layers_block_type_entry(tmp_path):
    cfg = tiny_hf_config(layers_block_type=["mamba", "moe", "transformer", "attention"])
    del cfg["hybrid_override_pattern"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    msg = load_error(tmp_path / "config.json")
    assert "layers_block_type" in msg and "'transformer'" in msg and "position 2" in msg


def test_malformed_json_config(bad_dir):
    (bad_dir / "config.json").write_text('{\n  "hidden_size": 32,\n  "vocab_size": 64,\n}\n')
    msg = load_error(bad_dir)
    assert "config.json" in msg and "line 4" in msg and "JSON" in msg


def test_config_that_is_not_utf8_text(bad_dir):
    """A config.json holding binary junk is a malformed config, not a UnicodeDecodeError."""
    (bad_dir / "config.json").write_bytes(b'\xff\xfe{"hidden_size": 32}')
    msg = load_error(bad_dir)
    assert "config.json" in msg


def test_config_that_is_not_an_object(bad_dir):
    (bad_dir / "config.json").write_text("[1, 2, 3]\n")
    assert "JSON object" in load_error(bad_dir)


@pytest.mark.parametrize("field", ["n_routed_experts", "hidden_size", "vocab_size", "mamba_num_heads",
                                   "num_attention_heads", "intermediate_size"])
def test_missing_required_config_field(tmp_path, field):
    cfg = tiny_hf_config()
    del cfg[field]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    msg = load_error(tmp_path / "config.json")
    assert repr(field) in msg and "missing" in msg and "config.json" in msg


@pytest.mark.parametrize("field,value", [
    ("hidden_size", -1),
    ("hidden_size", "32"),
    ("moe_intermediate_size", 16.5),
    ("hybrid_override_pattern", 5),
    ("num_nextn_predict_layers", "1"),
], ids=["negative-hidden", "string-hidden", "float-d_ff", "int-pattern", "string-mtp-layers"])
def test_config_field_of_the_wrong_type_or_sign(tmp_path, field, value):
    """A malformed value in config.json is a CheckpointError, not a TypeError / torch RuntimeError."""
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config(**{field: value})))
    msg = load_error(tmp_path / "config.json")
    assert "config.json" in msg


def test_missing_required_field_of_the_real_config(tmp_path):
    cfg = json.loads(SUPER.read_text())
    del cfg["moe_intermediate_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    msg = load_error(tmp_path / "config.json")
    assert "'moe_intermediate_size'" in msg


def test_missing_layer_layout(tmp_path):
    cfg = tiny_hf_config()
    del cfg["hybrid_override_pattern"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    msg = load_error(tmp_path / "config.json")
    assert "layers_block_type" in msg and "hybrid_override_pattern" in msg


def test_bad_block_config_in_our_format(bad_dir):
    cfg = json.loads((bad_dir / "config.json").read_text())
    cfg["block_configs"][2]["block_type"] = "transformer"
    (bad_dir / "config.json").write_text(json.dumps(cfg))
    msg = load_error(bad_dir)
    assert "block_configs[2]" in msg and "'transformer'" in msg
    cfg["block_configs"][2] = {"block_type": "moe", "hidden": 32, "bogus": 1}
    (bad_dir / "config.json").write_text(json.dumps(cfg))
    msg = load_error(bad_dir)
    assert "block_configs[2]" in msg and "moe" in msg


def test_index_naming_a_missing_shard(tmp_path, small_program):
    d = saved(small_program, tmp_path / "sh", max_shard_bytes=4000)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[1]
    (d / gone).unlink()
    msg = load_error(d)
    assert gone in msg and "model.safetensors.index.json" in msg


def test_index_without_weight_map(tmp_path, small_program):
    d = saved(small_program, tmp_path / "sh", max_shard_bytes=4000)
    (d / "model.safetensors.index.json").write_text('{"metadata": {}}')
    msg = load_error(d)
    assert "weight_map" in msg


@pytest.mark.parametrize("keep", [0, 7, 100, 5000, -1], ids=["empty", "7B", "100B", "5000B", "last-byte"])
def test_truncated_safetensors(bad_dir, keep):
    f = bad_dir / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:keep] if keep >= 0 else data[:-1])
    msg = load_error(bad_dir)
    assert "model.safetensors" in msg


def test_garbage_safetensors(bad_dir):
    (bad_dir / "model.safetensors").write_bytes(b"this is not a safetensors file\n" * 64)
    msg = load_error(bad_dir)
    assert "model.safetensors" in msg


def test_nonexistent_path(tmp_path):
    msg = load_error(tmp_path / "no" / "such" / "checkpoint")
    assert "does not exist" in msg and "checkpoint" in msg


def test_directory_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    msg = load_error(tmp_path / "empty")
    assert "config.json" in msg


def test_checkpoint_error_is_a_puzzlekit_error():
    assert issubclass(CheckpointError, PuzzlekitError)


# -- save safety -----------------------------------------------------------------------------------------
def test_save_refuses_a_non_empty_directory_unless_overwrite(tmp_path, small_program):
    d = tmp_path / "out"
    d.mkdir()
    (d / "notes.txt").write_text("keep me")
    with pytest.raises(OutputError, match="--overwrite"):
        ir.save(small_program, d, extended=True)
    assert dir_bytes(d) == {"notes.txt": b"keep me"}
    ir.save(small_program, d, overwrite=True, extended=True)
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "model.safetensors"]
    assert ir.print_program(ir.load(d)) == ir.print_program(small_program)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temp or trash dirs left behind


def test_save_into_an_existing_empty_directory(tmp_path, small_program):
    d = tmp_path / "out"
    d.mkdir()
    ir.save(small_program, d, extended=True)
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_save_onto_an_existing_file_is_an_output_error(tmp_path, small_program):
    f = tmp_path / "out"
    f.write_text("a file, not a directory")
    for overwrite in (False, True):
        with pytest.raises(OutputError, match="is a file"):
            ir.save(small_program, f, overwrite=overwrite, extended=True)
        assert f.read_text() == "a file, not a directory"


@pytest.mark.parametrize("shard", [None, 4000], ids=["one-file", "sharded"])
def test_save_refuses_its_own_input(tmp_path, small_program, shard):
    kw = {} if shard is None else {"max_shard_bytes": shard}
    src = saved(small_program, tmp_path / "src", **kw)
    before = dir_bytes(src)
    loaded = ir.load(src)
    for target in (src, tmp_path, tmp_path / "src" / ".." / "src"):
        with pytest.raises(OutputError, match="would replace the input"):
            ir.save(loaded, target, overwrite=True, **kw, extended=True)
        assert dir_bytes(src) == before
    # also when only some of its tensors still come from there
    partly = loaded.copy()
    name = "backbone.layers.4.mixer.up_proj.weight"
    partly.weights.set(name, partly.weights.get(name).clone())
    with pytest.raises(OutputError, match="would replace the input"):
        ir.save(partly, src, overwrite=True, **kw, extended=True)
    assert dir_bytes(src) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    # and the program still reads its (untouched) tensors
    for k in loaded.weights.names():
        assert torch.equal(loaded.weights.get(k), small_program.weights.get(k))


@pytest.mark.parametrize("fail_at", [1, 3])
def test_failed_save_leaves_no_partial_output(tmp_path, small_program, monkeypatch, fail_at):
    real = ckpt_module.save_file
    calls = []

    def flaky(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == fail_at:
            Path(filename).write_bytes(b"half a shard")
            raise OSError(28, "No space left on device")
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(ckpt_module, "save_file", flaky)
    parent = tmp_path / "parent"
    parent.mkdir()
    (parent / "other").write_text("x")
    target = parent / "model"
    with pytest.raises(OSError, match="No space left"):
        ir.save(small_program, target, max_shard_bytes=4000, extended=True)
    assert len(calls) == fail_at
    assert not target.exists()
    assert sorted(p.name for p in parent.iterdir()) == ["other"]


def test_failed_overwrite_keeps_the_old_checkpoint(tmp_path, small_program, make_small_program, monkeypatch):
    target = saved(make_small_program(seed=7), tmp_path / "model")
    before = dir_bytes(target)

    def broken(*a, **k):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(ckpt_module, "save_file", broken)
    with pytest.raises(RuntimeError, match="disk on fire"):
        ir.save(small_program, target, overwrite=True, extended=True)
    assert dir_bytes(target) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_save_of_a_meta_program_writes_only_the_config(tmp_path):
    prog = ir.load(NANO)
    d = saved(prog, tmp_path / "nano")
    assert sorted(p.name for p in d.iterdir()) == ["config.json"]
    again = ir.load(d)
    assert again.is_meta
    assert ir.print_program(again) == ir.print_program(prog)
    assert again.param_counts() == prog.param_counts()


def test_save_refuses_a_mix_of_meta_and_real_tensors(tmp_path, make_small_program):
    prog = make_small_program()
    prog.weights.set_meta("backbone.layers.4.mixer.up_proj.weight", (48, 32), torch.float32)
    with pytest.raises(CheckpointError, match="meta"):
        ir.save(prog, tmp_path / "mixed", extended=True)
    assert not (tmp_path / "mixed").exists()
    assert list(tmp_path.iterdir()) == []
