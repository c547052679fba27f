"""Serving settings in the scenario (issue 39): the Mamba SSM state dtype (priced state bytes and per-step traffic,
defaulted from the checkpoint, carried into the serving commands) and CUDA graphs (the launch floor)."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from puzzlekit import ir
from puzzlekit.backends.cost import CostModel, get_scenario
from puzzlekit.backends.cost.analytic import Efficiency
from puzzlekit.backends.cost.scenario import scenarios
from puzzlekit.backends.serving import serving
from puzzlekit.errors import PuzzlekitError
from puzzlekit.tools.common import add_workload_arguments, scenario_of
from puzzlekit.tools.default_model import DEFAULT_MODEL, config_path


@pytest.fixture(scope="module")
def parent():
    return ir.load(DEFAULT_MODEL / "config.json")


def _mamba(prog):
    return next(n for n in prog.nodes if n.op.kind == "mamba2")


def test_a_half_width_state_halves_the_ssm_bytes_and_its_traffic_in_the_priced_step(parent):
    n = _mamba(parent)
    op = n.op
    b = 64  # requests per step, one device (h100, tp1)
    priced = {}
    for dtype in ("fp32", "bf16"):
        cm = CostModel(parent, "h100", get_scenario("chat", ssm_dtype=dtype))
        priced[dtype] = cm.node_costs(n.path, op, b), cm
    ssm = op.heads * op.head_dim * op.state  # the SSM state's elements per request, by hand
    conv = op.conv_dim * (op.conv - 1) * 2  # the conv window, bf16 either way
    assert priced["fp32"][0]["state_bytes"] == conv + 4 * ssm
    assert priced["bf16"][0]["state_bytes"] == conv + 2 * ssm
    # the decode step's state kernel reads and writes every request's state once: at this batch it is bound by
    # that traffic, which halves for the SSM part: the step's difference is 2 x b x 2 bytes x ssm at the kernel's rate
    cm = priced["fp32"][1]
    e, t = Efficiency(), cm.target
    saved = 2 * b * (4 - 2) * ssm / (t.bandwidth * e.mamba_memory)
    got = priced["fp32"][0]["decode_seconds"] - priced["bf16"][0]["decode_seconds"]
    assert got == pytest.approx(saved, rel=1e-9)
    # and the memory a request holds follows: fewer bytes, more requests fit
    assert CostModel(parent, "h100", get_scenario("chat", ssm_dtype="bf16")).device_state_bytes() < \
        CostModel(parent, "h100", get_scenario("chat")).device_state_bytes()


def test_without_cuda_graphs_each_decode_kernel_pays_a_host_launch(parent):
    n = _mamba(parent)
    on = CostModel(parent, "h100", get_scenario("chat")).node_costs(n.path, n.op, 1)
    off = CostModel(parent, "h100", get_scenario("chat", cuda_graphs=False)).node_costs(n.path, n.op, 1)
    e = Efficiency()
    kernels = n.op.work(1, 1, 0, True, 2.0, 4.0, 2.0).kernels
    assert off["decode_seconds"] - on["decode_seconds"] == pytest.approx(
        kernels * (e.eager_launch_seconds - e.launch_seconds), rel=1e-9)
    assert off["prefill_seconds"] == on["prefill_seconds"]


def _args(*argv):
    p = argparse.ArgumentParser()
    p.add_argument("--scenario", default="decode-heavy")
    add_workload_arguments(p)
    return p.parse_args(list(argv))


def test_the_state_dtype_comes_from_the_flag_else_the_checkpoint(parent):
    super_ = ir.load(config_path("nemotron-3-super-120b-a12b"))
    assert super_.meta["config"]["mamba_ssm_cache_dtype"] == "float32"
    assert scenario_of(_args(), super_).ssm_dtype == "fp32"
    bf16 = dataclasses.replace(super_)
    bf16.meta = {**super_.meta, "config": {**super_.meta["config"], "mamba_ssm_cache_dtype": "bfloat16"}}
    assert scenario_of(_args(), bf16).ssm_dtype == "bf16"
    assert scenario_of(_args("--ssm-cache-dtype", "float16"), bf16).ssm_dtype == "fp16"
    assert scenario_of(_args("--no-cuda-graphs")).cuda_graphs is False
    assert scenario_of(_args()).cuda_graphs is True


def test_scenario_files_take_the_settings_and_refuse_a_state_dtype_no_engine_serves(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text('[mine]\nssm_dtype = "bf16"\ncuda_graphs = false\n')
    s = scenarios(f)["mine"]
    assert (s.ssm_dtype, s.cuda_graphs) == ("bf16", False)
    (tmp_path / "back.toml").write_text(s.to_toml())
    assert scenarios(tmp_path / "back.toml")["mine"] == s
    f.write_text('[mine]\nssm_dtype = "fp8"\n')
    with pytest.raises(PuzzlekitError, match="Mamba state"):
        scenarios(f)


def test_the_serving_commands_carry_the_priced_state_dtype(parent, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"model_type": "nemotron_h_puzzle"}')  # the serving commands read its context
    sc = get_scenario("decode-heavy", ssm_dtype="bf16")
    s = serving(parent, ckpt, "tp1", sc, 8)
    assert s.ssm_dtype == "bfloat16"
    argv = s.vllm()
    argv = argv if isinstance(argv, str) else " ".join(argv)
    assert "--mamba-ssm-cache-dtype bfloat16" in " ".join(argv.split())
    assert "mamba_ssm_cache_dtype: bfloat16" in s.trtllm_yaml()
    assert "bfloat16" in str(s.sglang())
