"""`puzzlekit compress --quick` end to end on the built-in model, its report, and resuming after a kill.

The end-to-end run (library, search, distillation, quantisation, bundle, report: about two minutes on 2 cores)
carries the `slow` mark with the tests that use it: `python -m pytest -q -m slow tests/test_compress.py`."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

from puzzlekit import ir
from puzzlekit.backends.layout import Layout

BOUND = 1.1e6


def _cmd(out: Path, grid: Path) -> list[str]:
    return [sys.executable, "-m", "puzzlekit.tools", "compress", "--quick", "--target", "h100", "--scenario",
            "decode-heavy", "--max-params", str(BOUND), "--grid", str(grid), "-o", str(out), "--json"]


@pytest.fixture(scope="module")
def run(tmp_path_factory, small_grid_file, local_tasks):
    out = tmp_path_factory.mktemp("compress") / "out"
    tasks = ["--tasks", "pk_mc", "--task-limit", "8", "--include-path", str(local_tasks)]
    p = subprocess.run(_cmd(out, small_grid_file) + tasks, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    return out, json.loads(p.stdout)


@pytest.mark.parametrize("extra", [[], ["--iterative", "3", "--speedup", "2", "--keep", "attention"]])
def test_the_compress_template_fills_in_to_a_pipeline_that_round_trips(extra, tmp_path):
    from puzzlekit.passes import parse_pipeline, print_pipeline
    from puzzlekit.passes.pipeline import PIPELINES_DIR
    from puzzlekit.tools.cli import parser
    from puzzlekit.tools.compress import pipeline_text

    args = parser().parse_args(["compress", "--max-params", "1e6", "-o", str(tmp_path), *extra])
    text = pipeline_text((PIPELINES_DIR / "compress.pipeline").read_text(), args, tmp_path, tmp_path / "lib")
    passes = parse_pipeline(text)
    assert parse_pipeline(print_pipeline(passes)) == passes
    assert [p.pass_name for p in passes][:3] == ["snapshot", "library", "repeat"] and passes[2].n == int(extra[1] if extra else 1)
    with pytest.raises(Exception, match="needs a deployment target"):
        pipeline_text("x", parser().parse_args(["compress", "-o", str(tmp_path)]), tmp_path, tmp_path)


def test_the_quick_head_only_stage_has_its_own_budget_and_its_figures_are_printed(tmp_path):
    """The trunk's lr=1e-3 for 10 steps moved the head away from its start and keep-best threw the run away."""
    from puzzlekit.passes import parse_pipeline
    from puzzlekit.passes.pipeline import PIPELINES_DIR
    from puzzlekit.tools.cli import parser
    from puzzlekit.tools.compress import _mtp_line, pipeline_text

    args = parser().parse_args(["compress", "--quick", "--target", "h100", "--speedup", "1.5", "-o", str(tmp_path)])
    passes = parse_pipeline(pipeline_text((PIPELINES_DIR / "compress.pipeline").read_text(), args, tmp_path,
                                          tmp_path / "lib"))
    (head,) = [p for p in passes if p.pass_name == "distill" and p.head_only]
    assert head.lr == 3e-4 and head.mtp_self == 1.0 and head.steps == 40 and head.eval_windows >= 8
    quality = {"prompts": [2, 64, 16], "parent": {"mtp_acceptance": 2.5}, "child": {"mtp_acceptance": 2.45}}
    assert _mtp_line(quality) == ("MTP acceptance on the report set: child 2.450 tokens/step, parent 2.500 (0.98x; "
                                  "2 prompts, 16 tokens each)")
    assert _mtp_line({**quality, "child": {"mtp_acceptance": None}}) == ""  # a model without a head


def test_a_cost_table_is_refused_where_it_cannot_apply(tmp_path, capsys):
    from puzzlekit.tools.cli import main

    out, tables = tmp_path / "run", tmp_path / "tables"
    tables.mkdir()
    assert main(["compress", "--quick", "--target", "h100", "--cost-table", str(tables), "-o", str(out)]) == 2
    assert "priced analytically" in capsys.readouterr().err
    assert main(["compress", "--quick", "--target", "cpu", "--cost-table", str(tmp_path / "no.json"), "-o",
                 str(out)]) == 2
    assert "no such file" in capsys.readouterr().err and not out.exists()


def test_lifting_the_engine_rules_needs_the_extended_form_said_up_front(tmp_path, capsys):
    from puzzlekit.tools.cli import main

    out = tmp_path / "run"
    assert main(["compress", "--quick", "--target", "h100", "--max-params", "1e6", "--engine", "none", "-o",
                 str(out)]) == 2
    assert "add --extended" in capsys.readouterr().err and not out.exists()


def test_a_target_that_cannot_price_the_scenario_is_refused_before_any_work(tmp_path, capsys):
    from puzzlekit.tools.cli import main

    out = tmp_path / "run"
    argv = ["compress", "--quick", "--target", "cpu", "--scenario", "long-1m", "--concurrency", "2", "-o", str(out)]
    assert main(argv) == 1
    assert "1,048,576 tokens is above its bound" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.slow
def test_the_child_meets_its_constraint_keeps_its_mtp_head_and_loads(run):
    out, summary = run
    plan = json.loads((out / "plan.json").read_text())["plan"]
    assert plan["predicted"]["params"] <= plan["limits"]["params"] == BOUND
    child = ir.verify(ir.load(out / "model"))
    assert child.param_counts()["total"] == plan["params_total"] <= BOUND
    assert child.find("mtp")
    assert summary["resumed_at_pass"] == 0 and summary["passes"] == 9
    assert [c["acceptance"] > 1 for c in summary["reports"]["mtp-check"]] == [True, True]


@pytest.mark.slow
def test_the_child_is_published_and_every_layer_builds_as_the_engines_build_it(run, assert_served):
    out, summary = run
    cfg = json.loads((out / "model" / "config.json").read_text())
    assert cfg["model_type"] == "nemotron_h_puzzle" and summary["outputs"]["model"]["form"].startswith("published")
    assert_served(ir.load(out / "model"), cfg)
    assert summary["reports"]["puzzle"][-1]["engine"] == "all"
    from puzzlekit.backends.serving_check import check_serving

    verdicts = check_serving(out / "model", layout=Layout.parse("tp1"))
    assert summary["outputs"]["serving"] == {"layout": "tp1", "engines": {v.engine: {"loads": v.loads,
                                                                                     "problems": v.problems}
                                                                          for v in verdicts}}
    md = (out / "report" / "report.md").read_text()
    assert "### Which engines load the child" in md
    assert all(f"| {name} | {'yes' if v.loads else '**no**'} |" in md
               for name, v in zip(("vLLM", "SGLang", "TensorRT-LLM"), verdicts))


@pytest.mark.slow
def test_transformers_loads_the_child_and_computes_its_logits(run):
    """The FP8 child through transformers' Auto classes and the code it carries, against puzzlekit's backend."""
    import torch
    from transformers import AutoModelForCausalLM

    from puzzlekit.backends.torch import materialize

    out, _ = run
    model = AutoModelForCausalLM.from_pretrained(out / "model", trust_remote_code=True, dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, want_mtp = materialize(ir.load(out / "model"))(ids)
        got, got_mtp = model.mtp_logits(ids)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max() and (got_mtp - want_mtp).abs().max() <= \
        1e-5 * want_mtp.abs().max()


@pytest.mark.slow
def test_the_bundle_holds_the_targets_build_files_and_graphs_onnxruntime_runs(run):
    import onnxruntime as ort

    out, _ = run
    for graph in ("prefill.onnx", "decode.onnx"):
        sess = ort.InferenceSession(str(out / "bundle" / graph))
        assert sess.get_outputs()
    files = {p.name for p in (out / "bundle").iterdir()}
    assert {"build.json", "build_engines.py", "trtexec.sh", "validate.py", "manifest.json"} <= files
    # the engines' commands serve the child in the layout the search chose (backends/serving.py)
    serving = json.loads((out / "bundle" / "build.json").read_text())["serving"]
    assert serving["model"] == str((out / "model").resolve()) and {"serve.sh", "trtllm-llm-api.yaml"} <= files
    assert serving["layout"] == json.loads((out / "plan.json").read_text())["plan"]["layout"]


@pytest.mark.slow
def test_the_report_is_complete_and_holds_the_runs_numbers(run):
    import matplotlib.image

    out, summary = run
    d = out / "report"
    for png in ("architecture.png", "frontier.png", "distillation.png", "mtp.png"):
        img = matplotlib.image.imread(d / png)
        assert img.shape[0] > 100 and img.shape[1] > 100 and np.asarray(img)[..., :3].std() > 0.05, png
    md = (d / "report.md").read_text()
    child = ir.load(out / "model")
    assert f"-> {child.param_counts()['total']:,}" in md
    assert all(f"({name}.png)" in md for name in ("architecture", "frontier", "distillation", "mtp"))
    check = summary["reports"]["mtp-check"][-1]
    assert f"| after head-only recovery | {check['acceptance']:.4g} |" in md
    assert f"| teacher | {check['teacher_acceptance']:.4g} |" in md
    rows = [ln for ln in md.splitlines() if re.match(r"\| (mip|uniform|greedy) \|", ln)]
    assert len(rows) == len(json.loads((out / "plan.json").read_text())["frontier"]) >= 5
    layers = [ln for ln in md.splitlines() if re.match(r"\| \d+ \| (mamba2|moe|attention|mlp) ", ln)]
    assert len(layers) == len(child.blocks())
    quality = json.loads((out / "work" / "quality.done").read_text())
    assert quality["set"] == "report" and 0 < quality["child"]["kl"] and quality["parent"]["kl"] == pytest.approx(0)
    assert f"| child | {quality['child']['kl']:.4g} | {quality['child']['top1_agreement']:.4g} |" in md
    assert "Profile all (loadable by vLLM, SGLang, TensorRT-LLM" in md and "without any engine's rules" in md
    tasks = json.loads((out / "work" / "tasks.done").read_text())
    (acc,) = [r for r in tasks["rows"] if (r["task"], r["metric"]) == ("pk_mc", "acc")]
    assert f"| pk_mc | acc | {acc['teacher']:.4g} | {acc['value']:.4g} |" in md and "(tasks.png)" in md
    assert (d / "tasks.png").stat().st_size > 1000


@pytest.mark.slow
def test_report_command_rewrites_the_report_and_refuses_a_directory_without_a_run(run, tmp_path):
    from puzzlekit.tools.cli import main

    out, _ = run
    (out / "report" / "report.md").unlink()
    assert main(["report", str(out)]) == 0 and (out / "report" / "report.md").exists()
    assert main(["report", str(tmp_path)]) == 1


@pytest.mark.slow
def test_a_killed_compress_resumes_without_redoing_finished_passes_and_gives_the_same_child(run, small_grid_file,
                                                                                               tmp_path):
    whole, _ = run
    out = tmp_path / "out"
    proc = subprocess.Popen(_cmd(out, small_grid_file), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    stages = out / "work" / "stages"
    deadline = time.monotonic() + 600
    def past_four() -> bool:  # a stage after the search's round (only the latest stage is kept)
        return stages.exists() and any(d.name.isdigit() and int(d.name) >= 4 and (d / "stage.json").exists()
                                       for d in stages.iterdir())

    while not past_four() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert past_four() and not (out / "model").exists()
    p = subprocess.run(_cmd(out, small_grid_file), capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout)["resumed_at_pass"] >= 4
    a, b = load_file(str(whole / "model" / "model.safetensors")), load_file(str(out / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
