"""The engines' own code as the oracle for the serving commands and check-serving, where it runs on a CPU.

vLLM 0.34.0's config checks import without a GPU from its released wheel (`pip install --no-deps vllm==0.34.0
pyzmq`, the `engine-oracles` extra): `ModelConfig`'s `_get_and_verify_max_len` with the architecture convertor's
`derive_max_model_len_and_key`, and `SchedulerConfig`'s batch check. SGLang 0.5.23's configuration class
(`srt/configs/nemotron_h.py`) is read by the same extra's wheel (`pip install --no-deps sglang==0.5.23`): its
package import needs a GPU stack, so `_sglang()` loads that file alone with its two runtime imports stubbed (the
TP size, the dtype environment), and `ModelConfig._derive_context_length` with `get_context_length` from their
files' source. Tests skip when the wheels are absent; they are not in the `test` extra (vLLM's wheel is 239 MB and
pins another torch), so CI does not require them (docs/engines.md).
"""
from __future__ import annotations

import ast
import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest

from puzzlekit import ir
from puzzlekit.backends.cost import get_scenario
from puzzlekit.backends.serving import serving
from puzzlekit.backends.serving_check import check_serving
from puzzlekit.backends.torch import random_weights
from puzzlekit.ir.ops import MTP, Attention, Embed, LMHead, Mamba2, MoE, Norm
from puzzlekit.tools.default_model import DEFAULT_MODEL

H, V = 32, 64


def _flag(argv, name):
    return argv[argv.index(name) + 1]


@pytest.fixture(scope="module")
def children(tmp_path_factory):
    """The built-in model (the main job's parent) re-saved, and heterogeneous children: per-layer KV heads,
    experts and latents, an MTP head with its own experts."""
    root = tmp_path_factory.mktemp("oracle")
    out = {}
    prog = ir.load(DEFAULT_MODEL)
    ir.save(prog, root / "builtin")
    out["builtin"] = root / "builtin"
    moe = lambda e, lat=16: MoE(H, experts=e, top_k=2, d_ff=16, shared_d_ff=24, latent=lat)
    att = lambda kv: Attention(H, q_heads=4, kv_heads=kv, head_dim=8)
    mamba = Mamba2(H, heads=4, head_dim=16, state=8, groups=2, chunk=4)
    for name, blocks, head in (("uniform", [mamba, moe(8), att(2), moe(8)], (att(2), moe(8))),
                               ("kv", [mamba, moe(8), att(1), moe(8), att(2)], (att(2), moe(8))),
                               ("experts", [mamba, moe(8), att(2), moe(6, 0)], (att(2), moe(4)))):
        p = ir.assemble(Embed(V, H), blocks, Norm(H), LMHead(V, H), MTP(H, head))
        random_weights(p, seed=0, std=0.3)
        ir.save(p, root / name)
        out[name] = root / name
    return out


# -- vLLM ------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vllm():
    """vLLM's own length and batch checks (its config modules import on a CPU)."""
    pytest.importorskip("vllm.config.scheduler", reason="vLLM's wheel: pip install --no-deps vllm==0.34.0 pyzmq")
    from vllm.config.model import _get_and_verify_max_len
    from vllm.config.scheduler import SchedulerConfig
    from vllm.transformers_utils.model_arch_config_convertor import ModelArchConfigConvertorBase

    return types.SimpleNamespace(max_len=_get_and_verify_max_len, scheduler=SchedulerConfig,
                                 convertor=ModelArchConfigConvertorBase)


def _vllm_accepts(vllm, model: Path, argv: list[str]) -> None:
    """What `vllm serve` checks of the length and batch flags, run by vLLM's code on the checkpoint's config (its
    remote-code class, as --trust-remote-code loads it). Raises vLLM's own error."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model, trust_remote_code=True)
    arch = types.SimpleNamespace(derived_max_model_len_and_key=vllm.convertor(cfg, cfg).derive_max_model_len_and_key())
    length = vllm.max_len(cfg, arch, None, int(_flag(argv, "--max-model-len")), False, None)
    vllm.scheduler(max_num_batched_tokens=int(_flag(argv, "--max-num-batched-tokens")),
                   max_num_seqs=int(_flag(argv, "--max-num-seqs")), max_model_len=length, is_encoder_decoder=False)


@pytest.mark.parametrize("name", ["builtin", "uniform", "kv", "experts"])
def test_vllm_accepts_the_serve_command_written_for_each_child(vllm, children, name):
    """The main job's scenario (73,728 tokens, 2,664 requests, 3 drafts) on children without a stated context:
    the command asks for what vLLM derives, and batched tokens it accepts."""
    d = children[name]
    argv = serving(d, d, "tp1", get_scenario("decode-heavy"), 2664).vllm()
    _vllm_accepts(vllm, d, argv)
    before = list(argv)  # what serve.sh asked for before: the scenario's context
    before[before.index("--max-model-len") + 1] = "73728"
    with pytest.raises(Exception, match="VLLM_ALLOW_LONG_MAX_MODEL_LEN"):
        _vllm_accepts(vllm, d, before)
    (v,) = check_serving(d, engines=("vllm",), context=73728)
    assert not v.loads and "VLLM_ALLOW_LONG_MAX_MODEL_LEN" in v.problems[-1]  # check-serving agrees


def test_vllm_refuses_fewer_batched_tokens_than_sequences_as_the_writer_assumes(vllm):
    """Why serve.sh writes --max-num-batched-tokens: vLLM's default on a GPU under 70 GiB is 2,048."""
    with pytest.raises(Exception, match="must be greater than or equal to max_num_seqs"):
        vllm.scheduler(max_num_batched_tokens=2048, max_num_seqs=2664, max_model_len=4096, is_encoder_decoder=False)


# -- SGLang ----------------------------------------------------------------------------------------------------------
def _source_of(path: Path, *names: str) -> str:
    """The source of top-level definitions (or `Class.method`, dedented) of an engine file."""
    tree, text, out = ast.parse(path.read_text()), path.read_text(), []
    for name in names:
        cls, _, meth = name.partition(".")
        node = next(n for n in tree.body if getattr(n, "name", None) == cls or
                    (isinstance(n, ast.Assign) and any(getattr(t, "id", None) == cls for t in n.targets)))
        if meth:
            node = next(n for n in node.body if getattr(n, "name", None) == meth)
        seg = ast.get_source_segment(text, node)
        first, *rest = seg.splitlines()  # the segment starts at the node; its later lines keep the indent
        out.append("\n".join([first] + [ln[node.col_offset:] for ln in rest]))
    return "\n\n".join(out)


@pytest.fixture(scope="module")
def sglang():
    """SGLang's NemotronH config classes (their file, with the TP size and dtype environment stubbed) and its
    context derivation, from the installed wheel's files."""
    spec = importlib.util.find_spec("sglang")
    if spec is None:
        pytest.skip("SGLang's wheel: pip install --no-deps sglang==0.5.23")
    srt = Path(spec.submodule_search_locations[0]) / "srt"
    env = types.SimpleNamespace(get=lambda: None)
    envs = types.SimpleNamespace(SGLANG_MAMBA_CONV_DTYPE=env, SGLANG_MAMBA_SSM_DTYPE=env,
                                 SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=types.SimpleNamespace(get=lambda: False))
    saved = {k: sys.modules.get(k) for k in ("sglang", "sglang.srt", "sglang.srt.configs", "sglang.srt.environ",
                                               "sglang.srt.runtime_context", "sglang.srt.distributed",
                                               "sglang.srt.distributed.utils", "sglang.srt.configs.mamba_utils")}
    stubs = {"sglang": [], "sglang.srt": [], "sglang.srt.configs": [], "sglang.srt.distributed": []}
    for name, path in stubs.items():
        sys.modules[name] = types.ModuleType(name)
        sys.modules[name].__path__ = path
    sys.modules["sglang.srt.environ"] = types.SimpleNamespace(envs=envs)
    sys.modules["sglang.srt.runtime_context"] = types.SimpleNamespace(
        get_parallel=lambda: types.SimpleNamespace(attn_tp_size=1))
    dist = types.ModuleType("sglang.srt.distributed.utils")
    exec(_source_of(srt / "distributed" / "utils.py", "ensure_divisibility", "divide"), dist.__dict__)
    sys.modules["sglang.srt.distributed.utils"] = dist
    try:
        mods = {}
        for name in ("mamba_utils", "nemotron_h"):
            s = importlib.util.spec_from_file_location(f"sglang.srt.configs.{name}", srt / "configs" / f"{name}.py")
            mods[name] = importlib.util.module_from_spec(s)
            sys.modules[s.name] = mods[name]
            s.loader.exec_module(mods[name])
        ns = {"envs": envs, "is_in_ci": lambda: False, "logger": types.SimpleNamespace(warning=lambda *a: None)}
        exec(_source_of(srt / "utils" / "hf_transformers" / "common.py", "CONTEXT_LENGTH_KEYS", "get_context_length")
             + "\n\n" + _source_of(srt / "configs" / "model_config.py", "ModelConfig._derive_context_length"), ns)
        yield types.SimpleNamespace(puzzle=mods["nemotron_h"].NemotronHPuzzleConfig, derive=ns["_derive_context_length"])
    finally:
        for k, v in saved.items():
            sys.modules.pop(k, None) if v is None else sys.modules.__setitem__(k, v)


def _sglang_config(sglang, model: Path):
    cfg = json.loads((model / "config.json").read_text())
    return sglang.puzzle(**{k: v for k, v in cfg.items() if k not in ("auto_map", "architectures")})


@pytest.mark.parametrize("name", ["builtin", "uniform", "kv", "experts"])
def test_sglang_takes_the_serve_commands_context_and_check_serving_reads_its_layers(sglang, children, name):
    d = children[name]
    cfg = _sglang_config(sglang, d)
    argv = serving(d, d, "tp1", get_scenario("decode-heavy"), 2664).sglang()
    me = types.SimpleNamespace(is_draft_model=False, hf_text_config=cfg, hf_config=cfg)
    sglang.derive(me, int(_flag(argv, "--context-length")))
    assert me.context_len == int(_flag(argv, "--context-length"))
    with pytest.raises(ValueError, match="SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"):
        sglang.derive(me, 73728)
    # every attention and MoE layer as SGLang's accessor builds it, against check-serving's reading
    (v,) = check_serving(d, engines=("sglang",))
    layers = {x["layer"]: x for x in v.layers}
    for i, b in enumerate(cfg.block_configs):
        if b["block_type"] in ("attention", "moe"):
            layer = cfg.get_nemotron_h_config_for_layer(i)
            for k, want in layers[f"backbone.layers.{i}"]["fields"].items():
                assert getattr(layer, k) == want, (name, i, k)
    # the KV pool: one head count, the top level's (MHATokenToKVPool); check-serving refuses a layer that differs
    pool = cfg.num_key_value_heads
    differ = [i for i, b in enumerate(cfg.block_configs) if b["block_type"] == "attention"
              and cfg.get_nemotron_h_config_for_layer(i).num_key_value_heads != pool]
    assert bool(differ) == any("one KV pool" in p for p in v.problems), (name, differ, v.problems)
    assert (name == "kv") == bool(differ)
    # the Mamba state cache: SGLang's own shape from the top level, the checkpoint's Mamba layers
    shape = cfg.mamba2_cache_params.shape
    mamba = next(n.op for n in ir.load(d).blocks("mamba2"))
    assert shape.temporal == (mamba.heads, mamba.head_dim, mamba.state)
