"""Bad input to the `puzzlekit` command: a clear message naming the problem, exit code 1 or 2, no traceback,
and input files left as they were. Most cases call `main()` in-process; the real process runs where the process
itself is what is checked: argparse's exit, a plugin exiting at import, a plugin from PYTHONPATH whose pass fails."""
import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from puzzlekit import ir
from puzzlekit.tools.cli import main
from puzzlekit.tools.default_model import model_path

TEXT = "".join(f"def function_{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(600))  # ~25 KB of text


def run(capsys, *args):
    """main(args) -> (exit code, stderr); argparse's exit counts as a return."""
    try:
        code = main([str(a) for a in args])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def cli(*args, env=None, cwd=None):
    r = subprocess.run([sys.executable, "-m", "puzzlekit.tools", *map(str, args)], capture_output=True, text=True,
                       env={**os.environ, **(env or {})}, cwd=cwd, timeout=300)
    assert "Traceback" not in r.stderr, r.stderr
    return r.returncode, r.stderr


def sha(path: Path) -> dict:
    files = sorted(path.rglob("*")) if path.is_dir() else [path]
    return {str(f): hashlib.sha256(f.read_bytes()).hexdigest() for f in files if f.is_file()}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    f = tmp_path_factory.mktemp("data") / "text.txt"
    f.write_text(TEXT)
    return f


@pytest.fixture(scope="module")
def nan_model(tmp_path_factory) -> Path:
    """The built-in model with one NaN in a Mamba A_log: every output is NaN."""
    prog = ir.load(model_path(None))
    name = "backbone.layers.0.mixer.A_log"
    t = prog.weights.get(name).clone()
    t.view(-1)[0] = float("nan")
    prog.weights.set(name, t)
    out = tmp_path_factory.mktemp("nan") / "model"
    ir.save(prog, out)
    return out


# -- 1. numbers on the command line: argparse refuses them (exit 2) ----------------------------------------
@pytest.mark.parametrize("args,words", [
    (["train", "-o", "{tmp}/t", "--seq", "0"], ["--seq", ">= 2"]),
    (["train", "-o", "{tmp}/t", "--batch", "0"], ["--batch", ">= 1"]),
    (["train", "-o", "{tmp}/t", "--steps", "-1"], ["--steps"]),
    (["train", "-o", "{tmp}/t", "--lr", "nan"], ["--lr", "finite"]),
    (["train", "-o", "{tmp}/t", "--lr", "inf"], ["--lr", "finite"]),
    (["train", "-o", "{tmp}/t", "--lr", "-0.1"], ["--lr", "> 0"]),
    (["train", "-o", "{tmp}/t", "--checkpoint-every", "0"], ["--checkpoint-every"]),
    (["train", "-o", "{tmp}/t", "--max-minutes", "-1"], ["--max-minutes", ">= 0"]),
    (["eval", "--windows", "0"], ["--windows"]),
    (["eval", "--windows", "-4"], ["--windows"]),
    (["eval", "--prompts", "0"], ["--prompts"]),
    (["eval", "--k", "0"], ["--k"]),
    (["eval", "--new-tokens", "-1"], ["--new-tokens"]),
    (["eval", "--new-tokens", "5000000"], ["--new-tokens", "1,000,000"]),
    (["eval", "--seq", "1"], ["--seq", ">= 2"]),
    (["generate", "--prompt", "x", "--max-new-tokens", "-5"], ["--max-new-tokens"]),
    (["generate", "--prompt", "x", "--max-new-tokens", str(10**12)], ["--max-new-tokens", "1,000,000"]),
    (["cost", "--concurrency", "0"], ["--concurrency"]),
    (["cost", "--gpus", "0"], ["--gpus"]),
    (["export-onnx", "-o", "{tmp}/x", "--opset", "7"], ["--opset", "18", "24"]),
    (["export-onnx", "-o", "{tmp}/x", "--opset", "99"], ["--opset"]),
])
def test_bad_numbers_are_usage_errors(capsys, tmp_path, args, words):
    code, err = run(capsys, *[a.format(tmp=tmp_path) for a in args])
    assert code == 2
    for w in words:
        assert w in err
    assert not list(tmp_path.iterdir())  # nothing was written


def test_bad_number_in_a_real_process(tmp_path):
    code, err = cli("train", "-o", tmp_path / "t", "--lr", "nan")
    assert code == 2 and "argument --lr" in err and not (tmp_path / "t").exists()


def test_eval_refuses_inconsistent_counts(capsys, data):
    code, err = run(capsys, "eval", "--data", data, "--k", "5", "--new-tokens", "2")
    assert code == 2 and "--k 5" in err and "--new-tokens 2" in err
    code, err = run(capsys, "eval", "--data", data, "--seq", "16", "--windows", "2", "--prompts", "3")
    assert code == 2 and "--prompts 3" in err


# -- 2. pass options and pipeline files ----------------------------------------------------------------------
@pytest.mark.parametrize("pipeline,words", [
    ("repeat{n=-5}(verify)", ["'repeat'", "n=-5", ">= 1"]),
    ("repeat{n=0}(verify)", ["'repeat'", "n=0"]),
    ("quantize{samples=0}", ["'quantize'", "samples=0"]),
    ("quantize{seq=-1}", ["'quantize'", "seq=-1"]),
    ("set-topk{k=0}", ["'set-topk'", "k=0"]),
])
def test_bad_pass_options(capsys, tmp_path, pipeline, words):
    code, err = run(capsys, "run", "-p", pipeline, "-o", tmp_path / "o")
    assert code == 2
    for w in words:
        assert w in err
    assert not (tmp_path / "o").exists()


def test_pass_options_checked_from_python_too():
    from puzzlekit.text.data import DataError, sequential_windows
    from puzzlekit.passes import AnalysisManager, PassError
    from puzzlekit.passes.quant import Quantize
    from puzzlekit.tools.default_model import load_default

    with pytest.raises(PassError, match="samples=0"):
        Quantize(samples=0)
    with pytest.raises(PassError, match="routing analysis: samples=0"):
        AnalysisManager(load_default()).get("routing", samples=0)
    with pytest.raises(DataError, match="limit 0"):  # 0 once meant "every window"
        sequential_windows(torch.zeros(100, dtype=torch.uint8).numpy(), 10, limit=0)


def test_nan_float_option_of_a_plugin_pass(capsys, tmp_path, monkeypatch):
    (tmp_path / "bad_input_floatpass.py").write_text(
        "from puzzlekit.passes import Preserved, register\n\n"
        "@register('bad-input-scale')\n"
        "def scale(prog, am, factor: float = 1.0):\n    return Preserved.all()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for value in ("nan", "inf", "-1e999"):
        code, err = run(capsys, "run", "--plugin", "bad_input_floatpass", "-p", f"bad-input-scale{{factor={value}}}",
                        "-o", tmp_path / "o")
        assert code == 2 and "option factor of pass 'bad-input-scale'" in err and "not a finite float" in err


def test_pipeline_file_not_utf8(capsys, tmp_path):
    f = tmp_path / "bad.pipeline"
    f.write_bytes(b"verify,\xff\xfeset-topk{k=1}\n")
    before = sha(f)
    code, err = run(capsys, "run", "-p", f, "-o", tmp_path / "o")
    assert code == 1 and "bad.pipeline" in err and "not UTF-8" in err
    assert sha(f) == before and not (tmp_path / "o").exists()


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root reads any file")
def test_pipeline_file_unreadable(capsys, tmp_path):
    f = tmp_path / "locked.pipeline"
    f.write_text("verify\n")
    f.chmod(0)
    try:
        code, err = run(capsys, "run", "-p", f, "-o", tmp_path / "o")
    finally:
        f.chmod(0o644)
    assert code == 1 and "cannot read the pipeline file" in err


# -- 3. plugins ----------------------------------------------------------------------------------------------
PLUGINS = {
    "bad_input_syntax": ("def broken(:\n    pass\n", ["bad_input_syntax", "syntax error", "line 1"]),
    "bad_input_raises": ("raise ValueError('no licence key')\n", ["bad_input_raises", "ValueError: no licence key"]),
    "bad_input_missing": ("import no_such_dependency_xyz\n", ["bad_input_missing", "no_such_dependency_xyz"]),
    "bad_input_dup": ("from puzzlekit.passes import Preserved, register\n\n@register('verify')\n"
                      "def verify(prog, am):\n    return Preserved.all()\n", ["bad_input_dup", "already registered"]),
}


@pytest.mark.parametrize("name", sorted(PLUGINS))
@pytest.mark.parametrize("command", ["run", "passes"])
def test_broken_plugins(capsys, tmp_path, monkeypatch, name, command):
    source, words = PLUGINS[name]
    f = tmp_path / f"{name}.py"
    f.write_text(source)
    before = sha(f)
    monkeypatch.syspath_prepend(str(tmp_path))
    extra = ["-p", "verify", "-o", tmp_path / "o"] if command == "run" else []
    code, err = run(capsys, command, "--plugin", name, *extra)
    assert code == 2 and "cannot import plugin" in err
    for w in words:
        assert w in err
    assert sha(f) == before and not (tmp_path / "o").exists()


EXIT_AT_IMPORT = "import sys\nsys.exit(0)\n"
PASSES_THAT_FAIL = """
import sys
from puzzlekit.passes import Preserved, register

@register("bad-input-divide")
def divide(prog, am):
    return 1 / 0

@register("bad-input-exit")
def leave(prog, am):
    sys.exit(0)
"""


def test_plugin_exiting_at_import_in_a_real_process(tmp_path):
    (tmp_path / "exits_early.py").write_text(EXIT_AT_IMPORT)
    code, err = cli("run", "--plugin", "exits_early", "-p", "verify", "-o", tmp_path / "o",
                    env={"PYTHONPATH": str(tmp_path)})
    assert code == 2 and "plugin 'exits_early'" in err and "sys.exit(0)" in err
    assert not (tmp_path / "o").exists()


def test_plugin_pass_raising_in_a_real_process(tmp_path):
    (tmp_path / "failing_passes.py").write_text(PASSES_THAT_FAIL)
    code, err = cli("run", "--plugin", "failing_passes", "-p", "verify,bad-input-divide", "-o", tmp_path / "o",
                    env={"PYTHONPATH": str(tmp_path)})
    assert code == 1 and "pass bad-input-divide failed: ZeroDivisionError: division by zero" in err
    assert "PUZZLEKIT_DEBUG=1" in err and not (tmp_path / "o").exists()


def test_plugin_pass_exiting_and_debug_mode(capsys, tmp_path, monkeypatch):
    (tmp_path / "failing_passes_inproc.py").write_text(PASSES_THAT_FAIL.replace("bad-input-", "bad-input-ip-"))
    monkeypatch.syspath_prepend(str(tmp_path))
    code, err = run(capsys, "run", "--plugin", "failing_passes_inproc", "-p", "bad-input-ip-exit", "-o", tmp_path / "o")
    assert code == 1 and "pass bad-input-ip-exit failed: called sys.exit(0)" in err
    assert not (tmp_path / "o").exists()
    from puzzlekit.passes import PassError
    monkeypatch.setenv("PUZZLEKIT_DEBUG", "1")  # for debugging: the error propagates with its traceback
    with pytest.raises(PassError, match="ZeroDivisionError") as e:
        main(["run", "--plugin", "failing_passes_inproc", "-p", "bad-input-ip-divide", "-o", str(tmp_path / "o")])
    assert isinstance(e.value.__cause__, ZeroDivisionError)


# -- 4. target files --------------------------------------------------------------------------------------------
GOOD = 'name = "t"\nmemory_gb = 48\nbandwidth_tbs = 0.9\n'
PEAKS = "[peak_tflops]\nbf16 = 362\n"


@pytest.mark.parametrize("suffix,text,words", [
    (".toml", 'name = "t"\nmemory_gb = "80"\nbandwidth_tbs = 1\n' + PEAKS, ["memory_gb", "'80'"]),
    (".toml", GOOD + "peak_tflops = [1, 2]\n", ["peak_tflops", "table"]),
    (".toml", GOOD + 'peak_tflops = "fast"\n', ["peak_tflops", "table"]),
    (".toml", GOOD + "peak_tflops = {}\n", ["peak_tflops", "empty"]),
    (".toml", GOOD + "[peak_tflops]\nint3 = 5\n", ["peak_tflops", "int3"]),
    (".toml", GOOD + "[peak_tflops]\nbf16 = nan\n", ["peak_tflops.bf16", "nan"]),
    (".toml", GOOD + "[peak_tflops]\nbf16 = -3\n", ["peak_tflops.bf16"]),
    (".toml", 'name = "t"\nmemory_gb = 48\nbandwidth_tbs = nan\n' + PEAKS, ["bandwidth_tbs", "finite"]),
    (".toml", 'name = "t"\nmemory_gb = inf\nbandwidth_tbs = 1\n' + PEAKS, ["memory_gb", "inf"]),
    (".toml", 'name = "t"\nmemory_gb = 0\nbandwidth_tbs = 1\n' + PEAKS, ["memory_gb", "> 0"]),
    (".toml", 'name = "t"\nmemory_gb = -8\nbandwidth_tbs = 1\n' + PEAKS, ["memory_gb"]),
    (".toml", 'name = "t"\ndevices = 0\nmemory_gb = 1\nbandwidth_tbs = 1\n' + PEAKS, ["devices", ">= 1"]),
    (".toml", 'name = "t"\ndevices = 2.5\nmemory_gb = 1\nbandwidth_tbs = 1\n' + PEAKS, ["devices", "integer"]),
    (".toml", 'name = "t"\ndevices = "two"\nmemory_gb = 1\nbandwidth_tbs = 1\n' + PEAKS, ["devices"]),
    (".toml", 'name = 5\nmemory_gb = 1\nbandwidth_tbs = 1\n' + PEAKS, ["name"]),
    (".toml", 'name = "t"\nmemory_gb = \n', ["not valid TOML"]),
    (".json", '{"name": "t", "memory_gb": 1, "bandwidth_tbs": NaN, "peak_tflops": {"bf16": 1}}', ["bandwidth_tbs"]),
    (".json", '{"name": "t", "memory_gb": 1, "bandwidth_tbs": 1, "peak_tflops": 7}', ["peak_tflops"]),
    (".json", '[1, 2]', ["one table"]),
])
def test_bad_target_files(capsys, tmp_path, suffix, text, words):
    f = tmp_path / f"target{suffix}"
    f.write_text(text)
    before = sha(f)
    code, err = run(capsys, "cost", "--target", f)
    assert code == 1
    for w in words:
        assert w in err
    assert sha(f) == before


def test_target_file_not_utf8(capsys, tmp_path):
    f = tmp_path / "latin1.toml"
    f.write_bytes(('name = "caf\xe9"\n' + GOOD.split("\n", 1)[1] + PEAKS).encode("latin-1"))
    before = sha(f)
    code, err = run(capsys, "cost", "--target", f)
    assert code == 1 and "not UTF-8" in err and "latin1.toml" in err
    assert sha(f) == before


# -- 5. the measured cpu provider on long contexts ------------------------------------------------------------
def test_cpu_cost_refuses_a_million_token_prefill(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PUZZLEKIT_CACHE", str(tmp_path))
    code, err = run(capsys, "cost", "--target", "cpu", "--scenario", "long-1m")
    assert code == 1 and "1,048,576 tokens" in err and "65,536" in err and "analytic target" in err


def test_cpu_cost_refuses_decode_state_over_its_budget(tmp_path):
    from puzzlekit.backends.cost import CostModel, MeasuredProvider, Scenario
    from puzzlekit.errors import PuzzlekitError
    from puzzlekit.tools.default_model import load_default

    prov = MeasuredProvider(cache=tmp_path / "t.json", repeats=1, warmup=0)
    with pytest.raises(PuzzlekitError, match=r"context 20,000,000 would allocate [\d.]+ GB .* budget"):
        CostModel(load_default(), "cpu", Scenario(input_len=8, output_len=8, context=20_000_000), provider=prov).report()
    prog = load_default()
    attention = prog.blocks("attention")[0].op
    assert prov.batch_limit([attention], 100_000) == MeasuredProvider.budget_bytes // prov.state_bytes(attention, 1, 100_000)


OP_KEY = json.dumps(["mlp", {"hidden": 8}, [], 1, 1, 16, True])


@pytest.mark.parametrize("content,words", [
    (b"\x00\x9f\x92garbage{", ["not JSON"]),
    (b'{"conditions": {"cpu": "x"}, "times": {"[\\"mlp\\"', ["not JSON"]),
    (json.dumps({"model_type": "nemotron_h", "hidden_size": 128}).encode(), ["not a cost table", "model_type"]),
    (json.dumps([1, 2, 3]).encode(), ["not a cost table", "list"]),
    (json.dumps({"conditions": {"device": "cuda:0", "gpu": "NVIDIA H200"}, "times": {}}).encode(),
     ["timed on cuda:0 (NVIDIA H200)", "CPU timings"]),
    (json.dumps({"conditions": {}, "times": {"hello": 1.0}}).encode(), ["'hello' is not an op timing"]),
    (json.dumps({"conditions": {}, "times": {OP_KEY: -1.0}}).encode(), ["-1.0, not seconds", "damaged"]),
    (json.dumps({"conditions": {}, "times": {OP_KEY: "fast"}}).encode(), ["'fast', not seconds"]),
])
def test_compress_refuses_a_bad_cost_table_before_any_work(capsys, tmp_path, monkeypatch, content, words):
    """(A corrupt or foreign --cost-table FILE was dropped without a word and every op timed anew: > 90 s.)"""
    import puzzlekit.tools.compress as compress

    monkeypatch.setattr(compress, "_text", lambda *a: pytest.fail("the run started its work"))
    table, out = tmp_path / "table.json", tmp_path / "run"
    table.write_bytes(content)
    code, err = run(capsys, "compress", "--quick", "--target", "cpu", "--cost-table", table, "-o", out)
    assert code == 2 and f"cost table {table}" in err and "drop --cost-table" in err, err
    assert all(w in err for w in words), err
    assert len(err.strip().splitlines()) == 1 and not out.exists() and table.read_bytes() == content


def test_a_pinned_cost_table_that_is_not_one_is_refused_not_timed_anew(capsys, tmp_path, monkeypatch):
    """A rerun's own table (OUT/cost-table.json) is checked as well; the provider never drops a pinned table."""
    import puzzlekit.tools.compress as compress
    from puzzlekit.backends.measured import CostTableError, MeasuredProvider

    monkeypatch.setattr(compress, "_text", lambda *a: pytest.fail("the run started its work"))
    out = tmp_path / "run"
    out.mkdir()
    (out / "cost-table.json").write_text("{truncated")
    code, err = run(capsys, "compress", "--quick", "--target", "cpu", "-o", out)
    assert code == 2 and "cost-table.json: not a cost table: not JSON" in err and "delete it" in err, err
    monkeypatch.setenv("PUZZLEKIT_COST_TABLE", str(out / "cost-table.json"))
    with pytest.raises(CostTableError, match="not JSON"):
        MeasuredProvider()
    (out / "cost-table.json").write_text(json.dumps({"conditions": {}, "times": {OP_KEY: 2e-5}}))
    assert MeasuredProvider()._cache == {OP_KEY: 2e-5}


# -- 6. non-finite results -----------------------------------------------------------------------------------------
def test_generate_with_nan_weights(capsys, nan_model):
    before = sha(nan_model)
    code, err = run(capsys, "generate", nan_model, "--prompt", "def ", "--max-new-tokens", "3")
    assert code == 1 and "NaN/inf logits at prefill" in err and "backbone.layers.0.mixer.A_log" in err
    assert "inspect --check-finite" in err and sha(nan_model) == before


def test_eval_with_nan_weights(capsys, nan_model, data):
    before = sha(nan_model)
    code, err = run(capsys, "eval", nan_model, "--data", data, "--windows", "2", "--seq", "16", "--prompts", "1",
                    "--k", "1", "--new-tokens", "2")
    assert code == 1 and "NaN/inf logits" in err and "A_log" in err
    assert "bits_per_byte" not in capsys.readouterr().out and sha(nan_model) == before


def test_quantize_with_nan_weights(capsys, nan_model, data, tmp_path):
    code, err = run(capsys, "run", nan_model, "-p", f"quantize{{samples=2,seq=16,data=[{data}]}}", "-o", tmp_path / "q")
    assert code == 1 and "pass quantize" in err and "NaN/inf" in err and "A_log" in err
    assert not (tmp_path / "q").exists()


def test_train_diverging_stops_before_writing_a_model(capsys, tmp_path, data):
    out = tmp_path / "run"
    code, err = run(capsys, "train", "-o", out, "--data", data, "--steps", "4", "--batch", "2", "--seq", "16",
                    "--checkpoint-every", "1", "--lr", "1e30", "--json")
    assert code == 1 and "training diverged at step" in err and "--lr" in err
    assert not (out / "model").exists() and not (out / "metrics.json").exists()
    if (out / "train_state.pt").exists():  # what was saved before the divergence is finite
        state = torch.load(out / "train_state.pt", weights_only=True)["model"]
        assert all(math.isfinite(float(t.abs().max())) for t in state.values() if t.is_floating_point())


def test_train_config_refuses_bad_settings():
    from puzzlekit.errors import PuzzlekitError
    from puzzlekit.tools.train import TrainConfig

    with pytest.raises(PuzzlekitError, match="lr=nan"):
        TrainConfig(lr=float("nan"))
    with pytest.raises(PuzzlekitError, match="seq=1"):
        TrainConfig(seq=1)


def test_cost_json_is_finite_on_a_good_target_file(capsys, tmp_path):
    """The other side of the target checks: a sound file still prices."""
    f = tmp_path / "ok.json"
    f.write_text(json.dumps({"name": "ok", "memory_gb": 48, "bandwidth_tbs": 0.9, "peak_tflops": {"bf16": 362}}))
    assert main(["cost", "--target", str(f), "--scenario", "chat", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert math.isfinite(out["throughput_tokens_per_second"]) and out["max_batch"] > 0
