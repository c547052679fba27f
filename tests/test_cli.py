"""The `puzzlekit` command: inspect, passes, run, plugins, exit codes."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path


from puzzlekit import ir
from puzzlekit.tools.cli import main
from puzzlekit.tools.default_model import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parent.parent


def cli(*args, env=None):
    r = subprocess.run([sys.executable, "-m", "puzzlekit.tools", *args], capture_output=True, text=True,
                       env={**os.environ, **(env or {})}, timeout=300)
    return r.returncode, r.stdout, r.stderr


def test_inspect_default_model_json(capsys):
    assert main(["inspect", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    prog = ir.load(DEFAULT_MODEL)
    assert out["ir"] == ir.print_program(prog)
    assert out["params_total"] == prog.param_counts()["total"] and out["mtp_params_total"] > 0
    assert set(out["by_kind"]) >= {"mamba2", "moe", "attention", "mlp"}


def test_inspect_meta_config(capsys):
    assert main(["inspect", "nemotron-3-super-120b-a12b"]) == 0  # a shipped config, by name
    assert re.search(r"trunk\s+120\.6\dB\s+12\.7\dB", capsys.readouterr().out)


def test_run_drop_blocks_then_inspect(tmp_path, capsys):
    out = tmp_path / "pruned"
    # a noop layer is outside the published schema: refused, naming the layer and the way out, nothing written
    assert main(["run", "--pipeline", "drop-blocks{layers=[2]}", "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert "backbone.layers.2" in err and "'noop'" in err and "--extended" in err and not out.exists()
    assert main(["run", "--pipeline", "verify,drop-blocks{layers=[2]}", "-o", str(out), "--verify-each",
                 "--extended"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert "%x3 = noop(%x2) {hidden=128}  # backbone.layers.2" in info["ir"]
    cfg = json.loads((out / "config.json").read_text())
    prov = cfg["provenance"]
    assert prov["pipeline"] == "verify,drop-blocks{layers=[2]}"
    assert {"torch", "python", "puzzlekit"} <= set(prov["versions"])
    assert len(prov["input"]["sha256"]["model.safetensors"]) == 64


def test_output_rules(tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["run", "-p", "verify", "-o", str(out)]) == 0
    before = (out / "model.safetensors").read_bytes()
    assert main(["run", "-p", "set-topk{k=1}", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--overwrite" in err and "overwrite=True" not in err  # the CLI's spelling, not the Python API's
    assert (out / "model.safetensors").read_bytes() == before
    assert main(["run", str(out), "-p", "verify", "-o", str(out), "--overwrite"]) == 2
    assert "would replace the input" in capsys.readouterr().err
    assert main(["run", "-p", "set-topk{k=1}", "-o", str(out), "--overwrite"]) == 0
    assert ir.load(out).blocks("moe")[0].op.top_k == 1


def in_process(capsys, *args):
    """(exit code, stdout, stderr) of the command run in this process (argparse's exits included)."""
    try:
        code = main([str(a) for a in args])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_exit_codes_and_messages(tmp_path, capsys):
    code, _, err = cli("run", "-p", "verfy", "-o", str(tmp_path / "x"))  # the process's own exit code
    assert code == 2 and "did you mean verify" in err and "Traceback" not in err
    code, _, err = in_process(capsys, "run", "-p", "drop-blocks{layers=[40]}", "-o", tmp_path / "x")
    assert code == 1 and "out of range" in err and "Traceback" not in err
    code, _, err = in_process(capsys, "inspect", tmp_path / "missing")
    assert code == 1 and "does not exist" in err and "Traceback" not in err
    code, _, err = in_process(capsys, "run", "-p", "verify")
    assert code == 2 and "-o" in err
    code, _, err = in_process(capsys, "run", "-p", "verify", "-o", tmp_path / "y", "--plugin", "no_such_module_xyz")
    assert code == 2 and "cannot import plugin" in err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_passes_listing(capsys):
    assert main(["passes", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["passes"]}
    assert {"verify", "print-ir", "snapshot", "set-topk", "drop-blocks", "repeat"} <= set(rows)
    k = rows["set-topk"]["options"][0]
    assert k == {"name": "k", "type": "int", "required": True, "default": None}
    assert rows["snapshot"]["options"][0]["default"] == "teacher"


def test_docs_plugin_example_runs(tmp_path, capsys, monkeypatch):
    """The plugin example of docs/ir-and-passes.md is at most 20 lines and works through --plugin and the Python
    API. A real process loads it from PYTHONPATH; the other ways of naming it run in this process, each with the
    pass registry and modules put back as they were (a second import under another module name is refused)."""
    from puzzlekit.passes.core import PASSES

    text = (ROOT / "docs" / "ir-and-passes.md").read_text()
    code = re.search(r"<!-- plugin-example -->\n```python\n(.*?)```", text, re.S).group(1)
    assert len(code.strip().splitlines()) <= 20
    (tmp_path / "my_passes.py").write_text(code)
    out = tmp_path / "out"
    rc, stdout, err = cli("run", "--plugin", "my_passes", "--pipeline", "cap-topk{k=1}", "-o", str(out), "--json",
                          env={"PYTHONPATH": str(tmp_path)})
    assert rc == 0, err
    assert json.loads(stdout)["pipeline"] == "cap-topk{k=1}"
    assert all(n.op.top_k == 1 for n in ir.load(out).blocks("moe"))

    def unloaded():
        PASSES.pop("cap-topk", None)
        for name in ("my_passes", "puzzlekit_plugin_my_passes"):
            sys.modules.pop(name, None)

    assert "cap-topk" not in PASSES
    try:
        monkeypatch.syspath_prepend(str(tmp_path))
        rc, stdout, _ = in_process(capsys, "passes", "--plugin", "my_passes")
        assert rc == 0 and "cap-topk{k: int = 8}" in stdout
        # the Python API, with the same module
        import my_passes  # noqa: F401
        from puzzlekit.passes import PassManager
        from puzzlekit.tools.default_model import load_default
        prog = load_default()
        PassManager("cap-topk{k=1}").run(prog)
        assert all(n.op.top_k == 1 for n in prog.blocks("moe"))
        unloaded()
        rc, stdout, _ = in_process(capsys, "passes", "--plugin", tmp_path / "my_passes.py")  # a path works too
        assert rc == 0 and "cap-topk{k: int = 8}" in stdout
        rc, _, err = in_process(capsys, "passes", "--plugin", tmp_path / "missing.py")
        assert rc == 2 and "no such file" in err
    finally:
        unloaded()


def test_cost_json_has_the_documented_keys(capsys):
    assert main(["cost", "nemotron-3-nano-30b-a3b", "--target", "h100", "--scenario", "long-1m", "--recipe", "fp8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for k in ("params_total", "params_active", "weight_bytes", "state_bytes_per_request", "max_concurrency",
              "max_batch", "decode_step_seconds", "prefill_seconds", "throughput_tokens_per_second"):
        assert k in out
    assert out["scenario"]["kv_dtype"] == "fp8" and out["by_kind"]["moe"]["count"] == 23
    assert main(["cost", "--target", "h300"]) == 1
    assert "unknown target 'h300'" in capsys.readouterr().err


def test_cost_of_an_infeasible_target_prints_the_figures_and_exits_1(capsys):
    assert main(["cost", "nemotron-3-super-120b-a12b", "--target", "h100", "--scenario", "long-1m", "--json"]) == 1
    captured = capsys.readouterr()
    out = json.loads(captured.out)  # the figures are still there
    assert out["max_concurrency"] == 0 and out["infeasible"].startswith("memory")
    assert "infeasible: memory" in captured.err


def test_pricing_w4a4_nvfp4_on_hopper_warns(capsys):
    assert main(["cost", "nemotron-3-nano-30b-a3b", "--target", "h100", "--recipe", "nvfp4", "--json"]) == 0
    err = capsys.readouterr().err
    assert "no FP4 tensor cores" in err and "nvfp4-weight" in err
    assert main(["cost", "nemotron-3-nano-30b-a3b", "--target", "b200", "--recipe", "nvfp4", "--json"]) == 0
    assert "warning" not in capsys.readouterr().err
