"""The code a published child carries (`trust_remote_code=True`): transformers' Auto classes load a heterogeneous
child (MoE experts, top-k and d_ff per layer, KV heads per layer, an MTP head), plain and quantised as Model
Optimizer stores it, and compute what puzzlekit computes on the same checkpoint; the files import with puzzlekit
out of reach, as in an engine's environment."""
from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from puzzlekit import ir  # noqa: E402
from puzzlekit.backends.torch import materialize  # noqa: E402
from puzzlekit.ir.hf_fields import fields_of  # noqa: E402
from puzzlekit.ir.nemotron_h_puzzle import REMOTE_CODE, REMOTE_CODE_DIR  # noqa: E402

TOL = 1e-5  # relative to the logits' magnitude
_LAYER_TYPE = {"mamba2": "linear_attention", "attention": "full_attention", "moe": "moe", "mlp": "mlp"}


def _rel(got, want) -> float:
    return (got - want).abs().max().item() / max(1.0, want.abs().max().item())


def _ids(b=2, t=21, seed=0):
    return torch.randint(0, 256, (b, t), generator=torch.Generator().manual_seed(seed))


def _expert_amax(module: str) -> float:
    """Activation amax differing per routed expert: the MoE's shared per-layer input scale is then the largest."""
    if ".experts." in module:
        return 2.0 + 0.25 * int(module.split(".experts.")[1].split(".")[0])
    return 4.0


@pytest.fixture(scope="module")
def children(heterogeneous_child, quantized_with, tmp_path_factory):
    """{form: (program, saved directory)} for the child in float32, FP8 and NVFP4-hybrid."""
    base = heterogeneous_child()
    out = {}
    for form in ("plain", "fp8", "nvfp4-hybrid"):
        prog = base if form == "plain" else quantized_with(base, form, _expert_amax)
        d = tmp_path_factory.mktemp(form) / "child"
        ir.save(prog, d)
        out[form] = (ir.load(d), d)
    return out


def _hf(d, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True, dtype=dtype).eval()


def test_save_writes_the_code_and_its_auto_map(children):
    _, d = children["plain"]
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["auto_map"]["AutoConfig"] == "configuration_nemotron_h_puzzle.NemotronHPuzzleConfig"
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_nemotron_h_puzzle.NemotronHPuzzleForCausalLM"
    for name in REMOTE_CODE:
        assert (d / name).read_bytes() == (REMOTE_CODE_DIR / name).read_bytes()


def test_extended_form_carries_no_code(children, tmp_path):
    prog, _ = children["plain"]
    ir.save(prog, tmp_path / "ext", extended=True)
    assert "auto_map" not in json.loads((tmp_path / "ext" / "config.json").read_text())
    assert not any((tmp_path / "ext" / name).exists() for name in REMOTE_CODE)


def test_code_imports_only_torch_and_transformers():
    allowed = {"__future__", "copy", "fnmatch", "torch", "transformers"}
    for name in REMOTE_CODE:
        tree = ast.parse((REMOTE_CODE_DIR / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                roots = set() if node.level else {node.module.split(".")[0]}
            else:
                continue
            assert roots <= allowed, (name, roots)


def test_per_layer_configs_carry_each_blocks_fields(children):
    from transformers import AutoConfig

    prog, d = children["plain"]
    cfg = AutoConfig.from_pretrained(d, trust_remote_code=True)
    assert type(cfg).__name__ == "NemotronHPuzzleConfig" and cfg.model_type == "nemotron_h_puzzle"
    blocks = prog.blocks()
    assert len(cfg.block_configs) == len(blocks)
    for i, node in enumerate(blocks):
        layer = cfg.get_nemotron_h_config_for_layer(i)
        assert layer.layers_block_type[i] == _LAYER_TYPE[node.op.kind], i
        for k, v in fields_of(node.op).items():
            got = getattr(layer, k)
            if k == "time_step_limit":
                assert tuple(got) == (v[0], float("inf"))
            else:
                assert got == v, (i, k)
    # the layers that differ: top-1 with 6 experts, half the d_ff, 4 experts of 96, one KV group
    assert [cfg.get_nemotron_h_config_for_layer(i).num_experts_per_tok for i in (1, 4)] == [1, 2]
    assert cfg.get_nemotron_h_config_for_layer(4).moe_intermediate_size == 64
    assert cfg.get_nemotron_h_config_for_layer(8).n_routed_experts == 4
    assert [cfg.get_nemotron_h_config_for_layer(i).num_key_value_heads for i in (3, 10)] == [1, 2]
    mtp = cfg.get_mtp_config()
    assert mtp.layers_block_type == ["full_attention", "moe"] and mtp.num_experts_per_tok == 1
    assert cfg.get_mtp_config_for_layer(1).num_experts_per_tok == 1


@pytest.mark.parametrize("form", ["plain", "fp8", "nvfp4-hybrid"])
def test_transformers_logits_equal_puzzlekits(children, form):
    prog, d = children[form]
    model = _hf(d)
    ids = _ids()
    with torch.no_grad():
        want, want_mtp = materialize(prog)(ids)
        got = model(ids).logits
        trunk, got_mtp = model.mtp_logits(ids)
    assert want.abs().max() > 1.0 and (want_mtp - want).abs().max() > 0.1
    assert _rel(got, want) < TOL and _rel(trunk, want) < TOL
    assert _rel(got_mtp, want_mtp) < TOL
    if form != "plain":  # the quantised weights stay quantised in transformers, scales in float32
        lin = model.backbone.layers[0].mixer.in_proj
        assert type(lin).__name__ == "ModelOptLinear" and lin.weight.dtype == torch.float8_e4m3fn
        assert lin.weight_scale.dtype == torch.float32
        up = model.backbone.layers[1].mixer.experts[0].up_proj
        assert up.algo == ("FP8" if form == "fp8" else "NVFP4")


def test_quantized_weights_stay_quantized_in_bfloat16(children):
    _, d = children["nvfp4-hybrid"]
    model = _hf(d, torch.bfloat16)
    up = model.backbone.layers[1].mixer.experts[0].up_proj
    assert up.weight.dtype == torch.uint8 and up.weight_scale.dtype == torch.float8_e4m3fn
    assert up.weight_scale_2.dtype == torch.float32 and up.input_scale.dtype == torch.float32
    assert model.lm_head.weight.dtype == torch.bfloat16


def test_greedy_generate_equals_puzzlekit(children):
    """transformers' generate (its cache, cached decode) against puzzlekit's prefill and decode, from a text
    prompt the default model was trained on."""
    prog, d = children["plain"]
    prompt = torch.tensor([list(b"def main(argv):\n    ret"), list(b"import os\nimport sys\ncl")])
    n = 24
    with torch.no_grad():
        got = _hf(d).generate(prompt, max_new_tokens=n, do_sample=False, min_new_tokens=n)[:, prompt.shape[1]:]
        m = materialize(prog)
        (logits, *_), state = m.prefill(prompt)
        new, gaps = [], []
        for i in range(n):
            top = logits[:, -1].topk(2)
            gaps.append((top.values[:, 0] - top.values[:, 1]).min().item())
            new.append(top.indices[:, 0])
            if i + 1 < n:
                (logits, *_), state = m.decode(new[-1], state)
    want = torch.stack(new, dim=1)
    assert min(gaps) > 1e-3  # no near tie that a different summation order could flip
    assert torch.equal(got, want), (got, want)


_FRESH = """
import sys
sys.modules["puzzlekit"] = None  # an engine's environment: puzzlekit cannot be imported
import torch
from transformers import AutoConfig, AutoModelForCausalLM
try:
    import puzzlekit
    raise SystemExit("puzzlekit was importable")
except ImportError:
    pass
d, out = sys.argv[1], sys.argv[2]
cfg = AutoConfig.from_pretrained(d, trust_remote_code=True)
model = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True, dtype=torch.float32).eval()
ids = torch.randint(0, 256, (2, 21), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    torch.save({"logits": model(ids).logits, "mtp": model.mtp_logits(ids)[1],
                "top_k": [cfg.get_nemotron_h_config_for_layer(i).num_experts_per_tok for i in (1, 4)]}, out)
"""


def test_code_runs_where_puzzlekit_cannot_be_imported(children, tmp_path):
    """In a fresh process (one thread: a 2 x 21-token forward gains nothing from more, and on a busy machine
    threads that wait on each other cost seconds)."""
    prog, d = children["fp8"]
    out = tmp_path / "out.pt"
    r = subprocess.run([sys.executable, "-c", _FRESH, str(d), str(out)], capture_output=True, text=True,
                       env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
                            "HF_MODULES_CACHE": str(tmp_path / "modules")}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = torch.load(out)
    with torch.no_grad():
        want, want_mtp = materialize(prog)(_ids())
    assert got["top_k"] == [1, 2]
    assert _rel(got["logits"], want) < TOL and _rel(got["mtp"], want_mtp) < TOL
