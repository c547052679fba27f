"""`puzzlekit train`: a short run, killed and resumed, ends exactly where an uninterrupted run does."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from puzzlekit import ir
from puzzlekit.tools.train import TrainConfig, train

ARGS = dict(steps=30, batch=2, seq=32, checkpoint_every=5, eval_windows=2)


def _step(state_file):
    try:
        return torch.load(state_file, weights_only=False)["step"]
    except Exception:  # not written yet, or being replaced
        return 0


@pytest.mark.slow  # heavy: runs with pytest -m slow
def test_resume_after_kill_matches_uninterrupted(tmp_path):
    cfg = TrainConfig(**ARGS)
    whole = train(tmp_path / "whole", cfg, progress=False)
    assert whole["finished"] and whole["resumed_from"] == 0

    run = tmp_path / "killed"
    cmd = [sys.executable, "-m", "puzzlekit.tools", "train", "-o", str(run), "--steps", "30", "--batch", "2",
           "--seq", "32", "--checkpoint-every", "5", "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 240
    while _step(run / "train_state.pt") < 5 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    saved = _step(run / "train_state.pt")
    assert 5 <= saved < 30, f"the run was not interrupted mid-way (saved step {saved})"
    assert not (run / "model").exists()

    resumed = train(run, TrainConfig(**{**ARGS, "eval_windows": 2}), progress=False)
    assert resumed["resumed_from"] == saved and resumed["step"] == 30
    a = load_file(str(tmp_path / "whole" / "model" / "model.safetensors"))
    b = load_file(str(run / "model" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert resumed["valid_bits_per_byte"] == whole["valid_bits_per_byte"]
    ir.verify(ir.load(run / "model"))


def test_resume_refuses_other_settings(tmp_path):
    train(tmp_path, TrainConfig(steps=2, batch=2, seq=16, eval_windows=1), progress=False)
    import pytest

    from puzzlekit import PuzzlekitError
    with pytest.raises(PuzzlekitError, match="other settings"):
        train(tmp_path, TrainConfig(steps=3, batch=2, seq=16, eval_windows=1), progress=False)
