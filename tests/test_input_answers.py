"""A user's inputs answered once, right, and before any work: which prices a target gets (one rule, said by `cost`
and `--explain`), `--prices` a target cannot take, an unwritable cache, `--hardware` given what `--target` takes,
head options for a model without a head, a config value every layer shares, and a checkpoint's own weight format.
Each case runs through the real CLI on shipped configs (no weights read)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path

import pytest

from puzzlekit import ir
from puzzlekit.tools.cli import main
from puzzlekit.tools.default_model import config_path, model_path

NANO, LIGHTNING = "nemotron-3-nano-30b-a3b", "nemotron-3.5-lightning-30b-a3b-nvfp4"


def run(capsys, *args) -> tuple[int, str, str]:
    """main(args) -> (exit code, stdout, stderr); argparse's exit counts as a return."""
    try:
        code = main([str(a) for a in args])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "unexpected" not in err, err
    return code, out, err


def cli(*args, env=None) -> tuple[int, str, str]:
    """The real process, for what a process does once (the tables' prices are kept when it exits)."""
    r = subprocess.run([sys.executable, "-m", "puzzlekit.tools", *map(str, args)], capture_output=True, text=True,
                       env={**os.environ, **(env or {})}, timeout=300)
    assert "Traceback" not in r.stderr and "unexpected" not in r.stderr, r.stderr
    return r.returncode, r.stdout, r.stderr


def target_file(tmp_path: Path, name: str, **more) -> Path:
    """A user's GPU named `name`, far slower than an H100: 1 TB/s, 300 TFLOP/s BF16."""
    fields = {"name": name, "memory_gb": 80, "bandwidth_tbs": 1.0, "peak_tflops": {"bf16": 300, "fp8": 600}, **more}
    f = tmp_path / f"{name}.json"
    f.write_text(json.dumps(fields))
    return f


def priced(capsys, *args) -> dict:
    code, out, _ = run(capsys, "cost", NANO, "--json", "--rate-floor", "0", *args)
    assert code == 0
    return json.loads(out)


# -- which prices a target gets --------------------------------------------------------------------------------
def test_a_target_file_named_h100_is_priced_by_its_own_figures_unless_tables_are_asked_for(capsys, tmp_path):
    pytest.importorskip("aiconfigurator_core")
    mine = target_file(tmp_path, "h100")
    auto = priced(capsys, "--target", mine, "--prices", "auto")
    analytic = priced(capsys, "--target", mine, "--prices", "analytic")
    assert auto["prices"]["provider"] == "analytic" and "its own figures" in auto["prices"]["note"]
    assert auto["throughput_tokens_per_second"] == analytic["throughput_tokens_per_second"]
    built_in = priced(capsys, "--target", "h100", "--prices", "auto")
    assert built_in["prices"]["provider"] == "tables" and "note" not in built_in["prices"]
    assert auto["throughput_tokens_per_second"] < 0.5 * built_in["throughput_tokens_per_second"]  # 1 TB/s, not 3.35
    code, out, _ = run(capsys, "cost", NANO, "--target", mine, "--prices", "tables", "--rate-floor", "0", "--explain")
    assert code == 0
    head, explained = out.splitlines()[0], next(ln for ln in out.splitlines() if ln.startswith("prices:"))
    for said in (head, explained):  # the header and --explain say the tables, not the file's figures, price it
        assert "tables" in said and "not by its bandwidth and peaks" in said, said


@pytest.mark.parametrize("prices", ["tables", "analytic"])
def test_prices_on_the_cpu_target_are_refused_before_any_work(capsys, tmp_path, prices):
    code, _, err = run(capsys, "cost", "--target", "cpu", "--prices", prices)
    assert code == 2 and f"--prices {prices}: the cpu target is timed" in err and "drop --prices" in err
    assert len(err.strip().splitlines()) == 1
    out = tmp_path / "run"
    t0 = time.perf_counter()
    code, _, err = run(capsys, "compress", "--target", "cpu", "--prices", prices, "--speedup", "1.5", "-o", out)
    assert code == 2 and "the cpu target is timed" in err and not out.exists()
    assert time.perf_counter() - t0 < 10


@pytest.mark.parametrize("extra", [[], ["--estimate"]])
def test_compress_refuses_tables_for_a_gpu_they_do_not_cover_before_any_work(capsys, tmp_path, extra):
    out = tmp_path / "run"
    t0 = time.perf_counter()
    code, _, err = run(capsys, "compress", "--quick", "--target", "rtx-sm89", "--prices", "tables", "--speedup", "1.5",
                       "-o", out, *extra)
    assert code == 2 and "--prices tables: the measured tables cover h100, h200, b200" in err
    assert "not rtx-sm89; use --prices analytic" in err and len(err.strip().splitlines()) == 1
    assert not out.exists() and time.perf_counter() - t0 < 10  # no snapshot, no library, no directory
    code, _, err = run(capsys, "cost", NANO, "--target", target_file(tmp_path, "mygpu"), "--prices", "tables")
    assert code == 2 and "not mygpu (a target file is matched to them by its name)" in err


def _unwritable(tmp_path: Path) -> Path:
    """A cache directory nothing may be written below: read-only for a user; for root, below /proc."""
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        return Path("/proc/self/puzzlekit-cache")
    d = tmp_path / "read-only"
    d.mkdir()
    d.chmod(0o555)
    return d / "cache"


def test_an_unwritable_cache_is_said_once_and_the_tables_price_on(tmp_path):
    pytest.importorskip("aiconfigurator_core")
    code, out, err = cli("cost", NANO, "--target", "h100", "--prices", "tables", "--rate-floor", "0",
                         env={"PUZZLEKIT_CACHE": str(_unwritable(tmp_path))})
    assert code == 0 and "throughput" in out
    assert err.count("expert shapes not kept for later runs") == 1 and err.count("prices not kept") == 1, err


def test_an_unwritable_cache_is_said_once_and_the_cpu_target_is_timed_on(capsys, tmp_path, monkeypatch):
    """In this process: the op timings' cache is where $PUZZLEKIT_CACHE says when a provider is made (no process
    state; the tables' prices above are kept at the process's exit, so they need a process of their own)."""
    monkeypatch.setenv("PUZZLEKIT_CACHE", str(_unwritable(tmp_path)))
    code, out, err = run(capsys, "cost", "--target", "cpu", "--input-len", "32", "--output-len", "32", "--rate-floor",
                         "0")
    assert code == 0 and "throughput" in out
    assert err.count("op timings not kept for later runs") == 1, err


# -- --hardware takes what --target takes -----------------------------------------------------------------------
@pytest.mark.parametrize("count,processes", [("", 8), (":2", 16)])
def test_hardware_reads_a_node_target_file_as_that_node(capsys, tmp_path, count, processes):
    node = target_file(tmp_path, "mynode", devices=8, interconnect_gbs=900)
    code, out, _ = run(capsys, "compress", NANO, "--target", "h100", "--speedup", "1.5", "--estimate", "--json",
                       "--hardware", f"{node}{count}", "-o", tmp_path / "run")
    assert code == 0
    hw = json.loads(out)["hardware"]
    assert (hw["processes"], hw["memory_bytes"], hw["bandwidth"]) == (processes, 80e9, 1e12)
    assert hw["name"] == f"{processes} x GPU of mynode"


# -- options for an MTP head on a model without one --------------------------------------------------------------
def test_head_options_for_a_model_without_a_head_are_said_to_do_nothing_once(capsys, tmp_path):
    code, _, err = run(capsys, "compress", NANO, "--target", "h100", "--speedup", "1.5", "--estimate",
                       "--hardware", "h100", "--head-steps", "5", "--mtp-tolerance", "0.2", "-o", tmp_path / "run")
    assert code == 0
    notes = [ln for ln in err.splitlines() if ln.startswith("note:")]
    assert notes == [f"note: --head-steps and --mtp-tolerance have no effect: {NANO} has no MTP head (no head work "
                     "is run)"]
    from puzzlekit.tools.common import note_head_options

    note_head_options(Namespace(head_steps=5, model=None), ir.load(model_path(None)), {"head_steps": "--head-steps"})
    assert capsys.readouterr().err == ""  # the built-in model has a head: the option means something


def test_drafting_options_without_mtp_are_said_to_do_nothing(capsys):
    code, _, err = run(capsys, "cost", NANO, "--target", "b200", "--mtp-acceptance", "2.5", "--mtp-draft", "2")
    assert code == 0 and err.count("note: --mtp-draft and --mtp-acceptance have no effect without --mtp") == 1


def test_a_draft_count_other_than_the_measured_acceptances_is_refused(capsys, tmp_path):
    cfg = json.loads((model_path(None) / "config.json").read_text())
    cfg["provenance"] = {"mtp_acceptance": {"length": 2.25, "drafts": 2}}  # as `run` writes it after mtp-check
    f = tmp_path / "config.json"
    f.write_text(json.dumps(cfg))
    code, _, err = run(capsys, "cost", f, "--target", "h100", "--scenario", "chat", "--mtp", "--mtp-draft", "4")
    assert code == 2 and "--mtp-draft 4: the checkpoint's acceptance (2.25) was measured drafting 2" in err
    code, out, _ = run(capsys, "cost", f, "--target", "h100", "--scenario", "chat", "--mtp", "--mtp-draft", "2",
                       "--json")
    assert code == 0 and json.loads(out)["scenario"]["mtp_draft"] == 2


# -- a config value every layer shares: said once, by the config's own key ----------------------------------------
@pytest.mark.parametrize("change,words", [
    ({"time_step_limit": [0.0, math.nan]}, "config field 'time_step_limit' (its high end) must be finite, got nan, "
                                           "in all 23 mamba layers"),
    ({"mamba_num_heads": 0}, "config field 'mamba_num_heads' must be > 0, got 0, in all 23 mamba layers"),
    ({"num_key_value_heads": 3}, "config field 'num_key_value_heads': num_attention_heads=32 must be divisible by "
                                 "num_key_value_heads=3, in all 6 attention layers"),
])
def test_a_config_error_every_layer_shares_is_said_once_by_its_key(capsys, tmp_path, change, words):
    cfg = json.loads(config_path(NANO).read_text()) | change
    f = tmp_path / "config.json"
    f.write_text(json.dumps(cfg))  # json writes NaN, and reads it back, as transformers' configs can hold it
    code, _, err = run(capsys, "inspect", f)
    assert code == 1 and words in err and "fix it in the config" in err
    assert len(err.strip().splitlines()) == 1 and "dt_max" not in err and "q_heads" not in err, err


# -- a checkpoint's own weight format ----------------------------------------------------------------------------
def test_lightning_is_priced_in_the_nvfp4_its_config_declares_unless_recipe_says_otherwise(capsys):
    """The shipped Lightning config carries its checkpoint's quantization_config (NVIDIA's recipe: experts and the
    Mamba projections in NVFP4; attention, the Mamba layers feeding it, routers, the head and the MTP head BF16)."""
    def cost(model, *more):
        code, out, _ = run(capsys, "cost", model, "--target", "b200", "--rate-floor", "0", *more)
        assert code == 0
        return out.splitlines()[1], float(out.split("GB weights (of ")[1].split()[0])

    head, declared = cost(LIGHTNING)
    assert "weights nvfp4 as the checkpoint declares them" in head
    _, nvfp4 = cost(LIGHTNING, "--recipe", "nvfp4")
    head, bf16 = cost(LIGHTNING, "--recipe", "bf16")
    assert "weights bf16 (--recipe; the checkpoint stores nvfp4)" in head
    _, nano = cost(NANO)
    assert bf16 == pytest.approx(nano, rel=0.02)  # Nano's shape; the MTP head's few tensors apart
    assert nvfp4 <= declared < 0.4 * bf16
    prog = ir.load(config_path(LIGHTNING))
    quant = {n.path: dict(getattr(n.op, "quant", None) or ()) for n in prog.nodes}
    pattern = [n.op.kind for n in prog.blocks()]
    for i, kind in enumerate(pattern):
        fmts = set(quant[f"backbone.layers.{i}"].values())
        feeds_attention = kind == "mamba2" and pattern[i + 1] == "attention"
        assert fmts == (set() if kind == "attention" or feeds_attention else {"nvfp4"}), (i, kind, fmts)
        assert "mixer.gate.weight" not in quant[f"backbone.layers.{i}"]  # the routers stay as they are
    assert not quant["mtp"] and not quant["lm_head"]