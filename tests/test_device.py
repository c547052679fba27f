"""Devices and precision: `--device/--dtype` on every command that computes, mixed precision (bf16 autocast,
float32 master weights, losses and SSM state) against float32 at bf16 tolerances, and distributed failures
that end every rank. On CPU, where bf16 autocast runs too; the bf16 tests run on CUDA as well where there is
a GPU (`benchmarks/gpu_check.py`), against float32 on the CPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from puzzlekit.backends.torch import materialize
from puzzlekit.backends.torch.device import CPU, DeviceError, resolve
from puzzlekit.tools.cli import main
from puzzlekit.tools.default_model import load_default

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
#: where the bf16 tests run: the CPU, and the GPU where there is one
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
on_devices = pytest.mark.parametrize("device", DEVICES)


@pytest.fixture(scope="module")
def parent():
    return load_default()


def test_auto_is_float32_on_cpu_and_bad_devices_are_refused():
    assert resolve() == CPU and resolve("cpu", "bfloat16").dtype == torch.bfloat16
    for device, dtype, match in [("tpu", "auto", "auto, cpu, cuda or cuda:N"), ("cpu", "float16", "CUDA only"),
                                 ("cpu", "int8", "--dtype 'int8'"), ("gpu0", "auto", "is not a device")]:
        with pytest.raises(DeviceError, match=match):
            resolve(device, dtype)


@no_cuda
@pytest.mark.parametrize("argv", [
    ["eval", "--device", "cuda"], ["generate", "--prompt", "x", "--device", "cuda"],
    ["train", "-o", "{tmp}/t", "--device", "cuda"], ["library", "-o", "{tmp}/l", "--device", "cuda"],
    ["compress", "-o", "{tmp}/c", "--max-params", "1e6", "--device", "cuda"],
    ["cost", "--target", "cpu", "--device", "cuda"], ["run", "-p", "verify", "-o", "{tmp}/r", "--device", "cuda"],
    ["build-engine", "--target", "h100", "-o", "{tmp}/b", "--device", "cuda:0"],
    ["run", "-p", "snapshot{name=teacher},distill{steps=1,device=cuda}", "-o", "{tmp}/p"],  # a pass's own option
], ids=lambda a: " ".join(a[:3]))
def test_cuda_on_a_machine_without_it_is_a_usage_error_naming_cuda(argv, tmp_path, capsys):
    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    assert "CUDA is not available here" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # refused before any work


def _close(got: torch.Tensor, want: torch.Tensor, rel: float = 0.02) -> None:
    """Within `rel` of the reference's norm: bf16 keeps about 3 significant digits per op, and a dozen
    blocks compound them (measured here: 0.4% for the trunk's logits, 1% for the MTP head's)."""
    err, scale = (got.float().cpu() - want.cpu()).norm().item(), want.norm().item()
    assert scale > 0.1 and err <= rel * scale, (err, scale)


@on_devices
def test_bf16_forward_matches_float32_at_bf16_tolerance_and_keeps_state_dtypes(parent, device):
    ids = torch.randint(0, 256, (2, 70), generator=torch.Generator().manual_seed(0))  # 70: several Mamba chunks
    ref, bf = materialize(parent), materialize(parent, compute=resolve(device, "bfloat16"))
    (l32, m32), s32 = ref.prefill(ids)
    (l16, m16), s16 = bf.prefill(ids)
    assert l16.dtype == torch.bfloat16 and next(bf.parameters()).dtype == torch.float32  # master weights stay
    _close(l16, l32)
    _close(m16, m32)
    for name, a, b in zip(bf.state_names, s32, s16):
        if name.endswith("ssm"):
            assert b.dtype == torch.float32, name  # the SSM state and its scan in float32
    (d32, _), _ = ref.decode(ids[:, -1], s32)
    (d16, _), _ = bf.decode(ids[:, -1], s16)
    _close(d16, d32)


@on_devices
def test_eval_in_bf16_gives_bits_per_byte_within_3_percent_of_float32(capsys, device):
    runs = {}
    for dev, dtype in (("cpu", "float32"), (device, "bfloat16")):
        assert main(["eval", "--windows", "8", "--prompts", "2", "--new-tokens", "8", "--device", dev,
                     "--dtype", dtype, "--json"]) == 0
        runs[dtype] = json.loads(capsys.readouterr().out)
    assert runs["bfloat16"]["compute"] == f"{resolve(device).device}/bfloat16"
    a, b = runs["float32"]["bits_per_byte"], runs["bfloat16"]["bits_per_byte"]
    assert abs(a - b) <= 0.03 * a


@on_devices
def test_a_bf16_bld_variant_lowers_its_loss_as_float32_does(parent, device):
    from puzzlekit.backends.torch.stream import StreamedProgram
    from puzzlekit.passes.puzzle.bld import block_module, distill_block, nmse
    from puzzlekit.passes.puzzle.grid import Variant
    from puzzlekit.passes.puzzle.importance import compute_importance
    from puzzlekit.passes.puzzle.library import slice_variant
    from puzzlekit.passes.puzzle.score import sweep_inputs

    ids = torch.randint(0, 256, (16, 64), generator=torch.Generator().manual_seed(1))
    inputs = sweep_inputs(StreamedProgram(parent), ids)
    x, d = inputs(0), inputs(1) - inputs(0)
    node = parent.blocks()[0]  # a Mamba layer, with half its heads
    ranks = compute_importance(parent, ids)["layers"][node.path]
    spec, w = slice_variant(node.op, {k: v.float() for k, v in parent.node_weights(node).items()},
                            Variant((("heads", node.op.heads // 2),)), ranks)
    final = {}
    for compute in (CPU, resolve(device, "bfloat16")):
        x, d = x.to(compute.device), d.to(compute.device)
        block = block_module(spec, w).to(compute.device)
        before = nmse(block, x, d, compute=compute)
        distill_block(block, x, d, tokens=8192, seed=0, lr=3e-3, compute=compute)
        final[compute.dtype] = nmse(block, x, d, compute=compute)
        assert final[compute.dtype] < 0.9 * before
        assert all(p.dtype == torch.float32 for p in block.parameters())
    assert final[torch.bfloat16] <= 1.5 * final[torch.float32] + 1e-3


@pytest.mark.slow  # heavy: runs with pytest -m slow
@on_devices
def test_bf16_distillation_lowers_the_kl_as_float32_does(parent, device):
    from puzzlekit.passes import PassManager
    from puzzlekit.passes.distill import Distill, distill

    child = parent.copy()
    PassManager("set-topk{k=1},drop-blocks{layers=[2]}").run(child)  # a child to recover
    after = {}
    for compute in (CPU, resolve(device, "bfloat16")):
        d = Distill(steps=20, batch=4, seq=64, eval_every=10, eval_windows=4, lr=1e-3)
        rep = distill(child.copy(), parent, d, compute=compute)
        assert rep["after"]["kl"] < 0.8 * rep["before"]["kl"], rep
        after[compute.dtype] = rep["after"]["kl"]
    assert after[torch.bfloat16] <= 1.5 * after[torch.float32]


PLUGIN = """
import os
import torch
from puzzlekit.passes.distill import register_loss

@register_loss("nan-on-rank-1")
def nan_on_rank_1(b):
    zero = b.student.logits.float().sum() * 0
    return zero + (float("nan") if os.environ.get("RANK") == "1" else 0.0)
"""


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                    reason="two ranks on a CUDA machine need two GPUs (NCCL, one per rank)")
def test_a_rank_whose_loss_diverges_ends_the_run_on_both(tmp_path):
    (tmp_path / "rank_plugin.py").write_text(PLUGIN)
    pipe = "snapshot{name=teacher},distill{steps=4,batch=4,seq=16,eval_windows=1,loss=[nan-on-rank-1]}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tmp_path)}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                        "29547", "-m", "puzzlekit.tools", "run", "--plugin", "rank_plugin", "-p", pipe,
                        "-o", str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode != 0
    assert p.stderr.count("training diverged at step 1") == 2, p.stderr[-3000:]  # each rank says so, and ends
    assert "not finite on another rank" in p.stderr
    assert not (tmp_path / "out").exists()


def test_threads_follow_the_model_size_and_the_cpus_this_process_may_use(monkeypatch):
    from puzzlekit.backends.torch import device

    monkeypatch.setattr(device, "cpus", lambda: 4)
    assert device.threads_for(1_000_000) == 1  # the built-in model: one thread
    assert device.threads_for(50_000_000) == 2 and device.threads_for(10**11) == 4  # never more than allowed
    assert device.threads_for(1_000_000, requested=3) == 3
    assert device.threads_for(50_000_000, requested=0) == 2  # 0: the size's choice
    with pytest.raises(device.DeviceError, match="--threads"):
        device.threads_for(1, requested=-1)
    with pytest.warns(UserWarning, match="--threads 100000: this process may use 4 CPUs; using 4"):
        assert device.threads_for(1, requested=100_000) == 4  # torch's pool crashes far past the CPUs


def test_far_too_many_threads_are_clamped_not_a_crash():
    """`eval --threads 100000` in a real process (it ended in a segmentation fault): clamped, said, evaluated."""
    p = subprocess.run([sys.executable, "-m", "puzzlekit.tools", "eval", "--threads", "100000", "--windows", "4",
                        "--prompts", "2", "--seq", "64", "--json"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "--threads 100000: this process may use" in p.stderr and "bits_per_byte" in p.stdout


def test_commands_set_the_threads_they_choose(monkeypatch, capsys):
    """The built-in model gets one thread; --threads overrides (the first call is the command's, the last puts
    this process's count back)."""
    real, calls = torch.set_num_threads, []
    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.append(n) or real(n))
    before = torch.get_num_threads()
    for argv, want in ((["inspect", "--json"], 1), (["cost", "--target", "h100", "--threads", "2", "--json"], 2)):
        calls.clear()
        assert main(argv) == 0, capsys.readouterr().err
        assert calls[0] == want and calls[-1] == before == torch.get_num_threads(), calls
