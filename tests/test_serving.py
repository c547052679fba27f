"""The serving command lines a bundle carries (backends/serving.py): vLLM, SGLang and TensorRT-LLM flags for the
priced layout, cache dtypes, context, batch and MTP head; serve.sh; and write_bundle writing them."""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess

import pytest

from puzzlekit.backends.cost import get_scenario
from puzzlekit.backends.layout import Layout
from puzzlekit.backends.serving import TRTLLM_YAML, ServingError, serving

BASH = shutil.which("bash")


def _ckpt(tmp_path, mtp: bool = True):
    """A checkpoint directory as `save` writes its config (all the commands read of it: the head, the context)."""
    d = tmp_path / ("my model" if mtp else "no head")  # a space: the commands must quote the path
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "nemotron_h_puzzle", "max_position_embeddings": 2**21,
                                               "num_nextn_predict_layers": int(mtp)}))
    return d


def _flags(argv: list[str], head: int) -> dict:
    """--flag [value] pairs after the first `head` words; a flag without a value maps to True."""
    out, rest = {}, argv[head:]
    for i, a in enumerate(rest):
        if a.startswith("--"):
            nxt = rest[i + 1] if i + 1 < len(rest) else None
            out[a] = True if nxt is None or nxt.startswith("--") else nxt
    return out


def test_single_gpu_commands_carry_exactly_the_priced_settings(tmp_path):
    ckpt = _ckpt(tmp_path)
    s = serving(ckpt, ckpt, "tp1", get_scenario("chat", input_len=1000, output_len=24), 48)
    model = str(ckpt.resolve())
    assert s.vllm()[:3] == ["vllm", "serve", model]
    assert _flags(s.vllm(), 3) == {
        "--trust-remote-code": True, "--tensor-parallel-size": "1", "--kv-cache-dtype": "auto",
        "--mamba-ssm-cache-dtype": "float32", "--speculative-config": '{"method":"mtp","num_speculative_tokens":3}',
        "--max-model-len": "1024", "--max-num-seqs": "48", "--max-num-batched-tokens": "8192"}
    assert s.sglang()[:3] == ["python", "-m", "sglang.launch_server"]
    assert _flags(s.sglang(), 3) == {
        "--model-path": model, "--trust-remote-code": True, "--tp-size": "1", "--kv-cache-dtype": "auto",
        "--mamba-ssm-dtype": "float32", "--speculative-algorithm": "EAGLE", "--speculative-num-steps": "3",
        "--speculative-eagle-topk": "1", "--speculative-num-draft-tokens": "4", "--context-length": "1024",
        "--max-running-requests": "48"}
    assert s.trtllm()[:2] == ["trtllm-serve", model]
    assert _flags(s.trtllm(), 2) == {
        "--backend": "pytorch", "--tp_size": "1", "--ep_size": "1", "--trust_remote_code": True,
        "--max_batch_size": "48", "--max_seq_len": "1024", "--extra_llm_api_options": TRTLLM_YAML}
    assert "'" + model + "'" in s.command("vllm")  # quoted for the shell
    # the scenario priced no drafting: the head still drafts, and the bundle says so
    assert s.drafts == 3 and any("priced plain decoding" in n for n in s.notes)


def test_multi_gpu_layout_and_fp8_kv_cache(tmp_path):
    ckpt = _ckpt(tmp_path)
    sc = get_scenario("long-1m", mtp_draft=2, mtp_acceptance=2.5)
    assert sc.kv_dtype == "fp8"
    s = serving(ckpt, ckpt, Layout.parse("tp2.dp4.ep8"), sc, 100)
    v = _flags(s.vllm(), 3)
    assert (v["--tensor-parallel-size"], v["--data-parallel-size"], v["--enable-expert-parallel"]) == ("2", "4", True)
    assert v["--kv-cache-dtype"] == "fp8" and v["--max-num-seqs"] == "25"  # per data-parallel rank
    assert json.loads(v["--speculative-config"]) == {"method": "mtp", "num_speculative_tokens": 2}
    assert v["--max-model-len"] == str(sc.context_len)
    g = _flags(s.sglang(), 3)
    assert (g["--tp-size"], g["--attn-dp-size"], g["--ep-size"]) == ("8", "4", "8")
    assert g["--kv-cache-dtype"] == "fp8_e4m3" and g["--max-running-requests"] == "100"
    assert (g["--speculative-num-steps"], g["--speculative-num-draft-tokens"]) == ("2", "3")
    t = _flags(s.trtllm(), 2)
    assert (t["--tp_size"], t["--ep_size"], t["--max_batch_size"]) == ("8", "8", "25")
    y = s.trtllm_yaml()
    lines = [ln for ln in y.splitlines() if not ln.startswith("#")]
    assert lines == ["kv_cache_config:", "  dtype: fp8", "  mamba_ssm_cache_dtype: float32",
                     "  enable_block_reuse: false", "speculative_config:", "  decoding_type: MTP",
                     "  num_nextn_predict_layers: 2", "enable_attention_dp: true"]
    if _has_yaml():  # pyyaml is no dependency: checked when it happens to be installed
        import yaml

        assert yaml.safe_load(y) == {"kv_cache_config": {"dtype": "fp8", "mamba_ssm_cache_dtype": "float32",
                                                         "enable_block_reuse": False},
                                     "speculative_config": {"decoding_type": "MTP", "num_nextn_predict_layers": 2},
                                     "enable_attention_dp": True}
    assert not s.notes  # priced with drafting, one replica


def _has_yaml() -> bool:
    import importlib.util

    return importlib.util.find_spec("yaml") is not None


def test_no_mtp_head_no_speculative_flags(tmp_path):
    ckpt = _ckpt(tmp_path, mtp=False)
    s = serving(ckpt, ckpt, "tp1", get_scenario("chat"), 8)
    everything = " ".join(s.vllm() + s.sglang() + s.trtllm()) + s.trtllm_yaml()
    assert s.drafts == 0 and "speculative" not in everything and "MTP" not in everything
    with pytest.raises(ServingError, match="no MTP head"):
        serving(ckpt, ckpt, "tp1", get_scenario("chat"), 8, drafts=2)
    assert serving(_ckpt(tmp_path), ckpt, "tp1", get_scenario("chat"), 8, drafts=0).drafts == 0


def test_ssm_dtype_is_a_parameter_and_bad_dtypes_are_refused(tmp_path):
    ckpt = _ckpt(tmp_path)
    s = serving(ckpt, ckpt, "tp1", get_scenario("chat"), 8, ssm_dtype="bf16")
    assert "bfloat16" in s.vllm() and "bfloat16" in s.sglang() and "mamba_ssm_cache_dtype: bfloat16" in s.trtllm_yaml()
    with pytest.raises(ServingError, match="SSM"):
        serving(ckpt, ckpt, "tp1", get_scenario("chat"), 8, ssm_dtype="fp8")
    with pytest.raises(ServingError, match="KV cache nvfp4"):
        serving(ckpt, ckpt, "tp1", get_scenario("chat", kv_dtype="nvfp4"), 8)


def test_layouts_the_engines_cannot_express_are_stated(tmp_path):
    ckpt = _ckpt(tmp_path)
    s = serving(ckpt, ckpt, "tp3", get_scenario("chat"), 8)
    assert any("TP 1, 2, 4 or 8" in n for n in s.engine_notes("tensorrt-llm"))
    assert "# TensorRT-LLM's NemotronH accepts TP 1, 2, 4 or 8" in s.serve_sh()
    assert not any("TP 1, 2, 4 or 8" in n for n in serving(ckpt, ckpt, "tp4", get_scenario("chat"), 8)
                   .engine_notes("tensorrt-llm"))
    r = serving(ckpt, ckpt, "tp2.r4", get_scenario("chat"), 8)
    assert any("one server per replica" in n for n in r.notes)


@pytest.mark.skipif(BASH is None, reason="no bash")
def test_serve_sh_parses_and_selects_each_engine(tmp_path):
    ckpt = _ckpt(tmp_path)
    s = serving(ckpt, ckpt, "tp2.dp4.ep8", get_scenario("long-1m"), 64)
    b = tmp_path / "bundle"
    b.mkdir()
    (b / "serve.sh").write_text(s.serve_sh())
    assert subprocess.run([BASH, "-n", str(b / "serve.sh")]).returncode == 0
    fake = tmp_path / "bin"  # stand-ins for the engines: print their arguments, one per line
    fake.mkdir()
    for name in ("vllm", "python", "trtllm-serve"):
        (fake / name).write_text(f'#!/bin/sh\necho {name}\nfor a in "$@"; do echo "$a"; done\n')
        (fake / name).chmod(stat.S_IRWXU)
    env = {**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}"}

    def run(*args):
        return subprocess.run([BASH, str(b / "serve.sh"), *args], capture_output=True, text=True, env=env)

    for args, engine in (((), "vllm"), (("vllm", "--port", "9"), "vllm"), (("sglang",), "sglang"),
                         (("tensorrt-llm",), "tensorrt-llm")):
        r = run(*args)
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines() == s.argv(engine) + list(args[1:]), engine
    bad = run("llama.cpp")
    assert bad.returncode == 2 and "unknown engine" in bad.stderr


@pytest.fixture(scope="module")
def served_bundle(tmp_path_factory):
    """The built-in model's h100 bundle with its checkpoint to serve (no engines built: only the files matter)."""
    from puzzlekit.backends.targets import TARGETS
    from puzzlekit.backends.tensorrt import write_bundle
    from puzzlekit.tools.default_model import DEFAULT_MODEL, load_default

    out = tmp_path_factory.mktemp("served") / "bundle"
    rep = write_bundle(load_default(), out, TARGETS["h100"], get_scenario("chat", input_len=64, output_len=64),
                       build="no", checkpoint=DEFAULT_MODEL)
    return out, rep, DEFAULT_MODEL


@pytest.mark.slow  # an ONNX export of the built-in model (a minute on 2 cores); the default_bundle fixture (tests/conftest.py) has the files
def test_write_bundle_carries_serve_sh_yaml_and_readme(served_bundle):
    out, rep, model = served_bundle
    spec = json.loads((out / "build.json").read_text())
    srv = spec["serving"]
    assert srv["model"] == str(model.resolve()) and srv == rep.build["serving"]
    assert srv["layout"] == "tp1" and srv["max_batch"] == spec["memory_plan"]["max_batch"]
    assert srv["context_len"] == 128 and srv["ssm_cache_dtype"] == "float32" and srv["kv_cache_dtype"] == "auto"
    assert srv["mtp_draft_tokens"] == 3  # the built-in model has an MTP head
    sh = out / "serve.sh"
    assert sh.stat().st_mode & stat.S_IXUSR
    assert BASH is None or subprocess.run([BASH, "-n", str(sh)]).returncode == 0
    assert f"--max-num-seqs {srv['max_batch']}" in sh.read_text()
    assert (out / TRTLLM_YAML).read_text().splitlines()[1:4] == ["kv_cache_config:", "  dtype: auto",
                                                                 "  mamba_ssm_cache_dtype: float32"]
    readme = (out / "README.md").read_text()
    section = readme.split("## Serve the checkpoint", 1)[1]
    assert "vllm serve " + str(model.resolve()) in section and "python -m sglang.launch_server" in section
    assert "trtllm-serve" in section and "--speculative-config" in section
    manifest = json.loads((out / "manifest.json").read_text())
    assert {"serve.sh", TRTLLM_YAML} <= set(manifest["files"])
