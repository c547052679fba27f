"""The shared output policy: outputs never eat inputs, are checked before the work, and replace an old
output in one step. Interruption is tested by SIGKILLing a real `puzzlekit run --overwrite` between the
steps of the replacement."""
from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from puzzlekit import ir, outputs
from puzzlekit.outputs import STAGING, OutputError, check_output, staged_dir
from puzzlekit.tools.cli import main


def tree(d: Path) -> dict[str, str]:
    """Every file below `d` by relative path -> sha256."""
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file()}


def umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def test_staged_dir_replaces_in_one_step_and_leaves_nothing_behind(tmp_path):
    out = tmp_path / "o"
    with staged_dir(out) as d:
        (d / "a").write_text("first")
    with pytest.raises(OutputError, match="--overwrite"):
        with staged_dir(out) as d:
            raise AssertionError("not reached: the check comes first")
    with staged_dir(out, overwrite=True) as d:
        (d / "b").write_text("second")
    assert sorted(p.name for p in out.iterdir()) == ["b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask()


def test_a_failure_while_staging_keeps_the_old_output(tmp_path):
    out = tmp_path / "o"
    with staged_dir(out) as d:
        (d / "a").write_text("old")
    with pytest.raises(RuntimeError, match="disk on fire"):
        with staged_dir(out, overwrite=True) as d:
            (d / "a").write_text("half")
            raise RuntimeError("disk on fire")
    assert (out / "a").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]


@pytest.mark.parametrize("where", ["input", "parent", "grandparent", "child"])
def test_outputs_never_replace_or_enter_an_input(tmp_path, where):
    src = tmp_path / "a" / "ckpt"
    src.mkdir(parents=True)
    (src / "config.json").write_text("{}")
    out = {"input": src, "parent": src.parent, "grandparent": tmp_path, "child": src / "sub"}[where]
    before = tree(tmp_path)
    with pytest.raises(OutputError, match="input"):
        check_output(out, [src], overwrite=True)
    assert tree(tmp_path) == before


def test_a_config_file_input_protects_its_directory(tmp_path):
    cfg = tmp_path / "m" / "config.json"
    cfg.parent.mkdir()
    cfg.write_text("{}")
    with pytest.raises(OutputError, match="would replace the input"):
        check_output(tmp_path / "m", [cfg], overwrite=True)


def test_output_below_a_regular_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputError, match="which is a file"):
        check_output(tmp_path / "f" / "sub" / "o")


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only directories")
def test_output_in_a_read_only_directory(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(OutputError, match="cannot write"):
            check_output(ro / "o")
    finally:
        ro.chmod(0o755)


def test_full_disk_is_refused_before_the_work(tmp_path, monkeypatch, capsys):
    """`run` checks room for an output the size of its input before loading anything."""
    real = outputs.shutil.disk_usage
    monkeypatch.setattr(outputs.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    with pytest.raises(OutputError, match="MB free"):
        ir.save(ir.load(_default()), tmp_path / "o")
    loads = []
    monkeypatch.setattr(ir, "load", lambda *a, **k: loads.append(a))
    assert main(["run", "-p", "verify", "-o", str(tmp_path / "o")]) == 2
    assert "MB free" in capsys.readouterr().err and loads == []
    assert list(tmp_path.iterdir()) == []


def test_export_onnx_onto_the_parent_of_its_input_is_refused(tmp_path, capsys):
    src = tmp_path / "models" / "m"
    ir.save(ir.load(_default()), src)
    (tmp_path / "models" / "sibling.txt").write_text("keep")
    before = tree(tmp_path)
    assert main(["export-onnx", str(src), "-o", str(tmp_path / "models"), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "would replace the input" in err and "Traceback" not in err
    assert tree(tmp_path) == before


def test_train_refuses_a_directory_that_is_not_a_run(tmp_path, capsys):
    d = tmp_path / "home"
    d.mkdir()
    (d / "model").mkdir()
    (d / "model" / "mine.txt").write_text("keep")
    before = tree(d)
    assert main(["train", "-o", str(d), "--steps", "1"]) == 2
    assert "holds no training run" in capsys.readouterr().err
    assert tree(d) == before


def _default() -> Path:
    from puzzlekit.tools.default_model import model_path

    return model_path(None)


# -- SIGKILL between the steps of a replacement -----------------------------------------------------------------
KILLER = textwrap.dedent("""
    import os, signal, sys
    from puzzlekit import outputs
    from puzzlekit.tools.cli import main

    step = sys.argv[1]
    real_exchange, real_replace = outputs._exchange, outputs.os.replace

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    def exchange(a, b):
        if step == "before-exchange":
            die()
        if step == "no-exchange":
            return False
        done = real_exchange(a, b)
        if step == "after-exchange":
            die()
        return done

    def replace(a, b):
        real_replace(a, b)
        if step == "no-exchange" and str(b).endswith("old"):
            die()  # between the two renames of the fallback

    outputs._exchange = exchange
    outputs.os.replace = replace
    sys.exit(main(sys.argv[2:]))
""")


@pytest.mark.parametrize("step", ["before-exchange", "after-exchange", "no-exchange"])
def test_a_kill_during_overwrite_never_loses_both_outputs(tmp_path, step):
    out = tmp_path / "o"
    assert main(["run", "-p", "verify", "-o", str(out)]) == 0
    old = tree(out)
    args = ["run", "-p", "set-topk{k=1}", "-o", str(out), "--overwrite"]
    p = subprocess.run([sys.executable, "-c", KILLER, step, *args], capture_output=True, text=True)
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert [s for s in tmp_path.iterdir() if STAGING in s.name], "the kill leaves a staging directory"
    if step == "no-exchange":  # without an atomic exchange the old output waits in staging for the next write
        assert not out.exists()
        kept = old
    else:
        kept = tree(out)
        assert (kept == old) == (step == "before-exchange")
        ir.load(out)  # old or new, it is complete
    # the next run to the same output first restores or discards what the kill left
    assert main(["run", "-p", "set-topk{k=1}", "-o", str(out)]) == 2  # an output is in place: --overwrite needed
    assert tree(out) == kept
    assert sorted(s.name for s in tmp_path.iterdir()) == ["o"]
    assert main(["run", "-p", "set-topk{k=1}", "-o", str(out), "--overwrite"]) == 0
    assert ir.load(out).blocks("moe")[0].op.top_k == 1
