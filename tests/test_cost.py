"""The cost model: hand-computed work per op, memory, the roofline, properties, named scenarios."""
import json
import math
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from puzzlekit import PuzzlekitError, ir
from puzzlekit.backends.cost import (AnalyticProvider, CostModel, Efficiency, MeasuredProvider, Scenario, cost,
                                     get_scenario)
from puzzlekit.backends.targets import TARGETS, get_target, load_target_file
from puzzlekit.ir.ops import MLP, MTP, Attention, Embed, Linear, LMHead, Mamba2, MoE, Noop, Norm

CONFIGS = Path(__file__).resolve().parents[2] / "shared" / "configs"
SUPER = CONFIGS / "nemotron-3-super-120b-a12b.config.json"
NANO = CONFIGS / "nemotron-3-nano-30b-a3b.config.json"
needs_configs = pytest.mark.skipif(not SUPER.exists(), reason="shared configs not present")
ARGS = dict(kv_bytes=2.0, ssm_bytes=4.0, act_bytes=2.0)


def test_mamba2_work_by_hand():
    op = Mamba2(hidden=8, heads=2, head_dim=4, state=4, groups=1, conv=4, chunk=4)
    # inner 8, conv_dim 16, in_proj rows 26: per token 416 + 128 (conv) + 160 (SSM) + 128 (out) + 48 + 32
    w = op.work(3, 1, 100, True, **ARGS)
    assert w.flops == 3 * 912
    assert op.state_bytes(2.0, 4.0, 2.0, 100) == 16 * 3 * 2 + 2 * 4 * 4 * 4 == 224
    assert w.state_read == w.state_write == 3 * 224
    assert sum(w.weights.values()) == 26 * 8 + 16 * 4 + 16 + 3 * 2 + 8 + 8 * 8 + 8
    # prefill of 6 tokens, chunk 4: SSM per token 2*4*2*(4+4) + 6*32 = 320
    p = op.work(1, 6, 0, False, **ARGS)
    assert p.flops == 6 * (416 + 128 + 320 + 128 + 48 + 32)


def test_attention_work_by_hand():
    op = Attention(hidden=8, q_heads=2, kv_heads=1, head_dim=4)
    w = op.work(2, 1, 10, True, **ARGS)
    # projections 2*2*8*(16+8) = 768; pairs 2*(10 + 1) = 22 -> 4*22*8 = 704; norm 4*2*8 = 64
    assert w.flops == 768 + 704 + 64
    assert w.state_read == 2 * 10 * 16 and w.state_write == 2 * 16
    assert op.state_bytes(1.0, 4.0, 2.0, 1000) == 2 * 4 * 1000  # FP8 KV: 1 byte
    p = op.work(1, 5, 0, False, **ARGS)
    assert p.flops == 2 * 5 * 8 * 24 + 4 * 15 * 8 + 4 * 5 * 8 and p.state_read == 0 and p.state_write == 5 * 16


def test_moe_work_by_hand():
    op = MoE(hidden=8, experts=4, top_k=2, d_ff=6, shared_d_ff=5, latent=0, scaling=1.0)
    assert op.touched(1) == [0.5] * 4 and op.touched(2) == [0.75] * 4
    w = op.work(2, 1, 0, True, **ARGS)
    expert = 6 * 8  # up_proj elements
    assert w.weights["mixer.experts.0.up_proj.weight"] == pytest.approx(0.75 * expert)
    assert w.weights["mixer.gate.weight"] == 32 and w.weights["mixer.shared_experts.up_proj.weight"] == 40
    assert w.flops == 2 * (2 * 8 * 4 + 2 * 4 * 8 * 6 + 4 * 8 * 5 + 4 * 8)
    skewed = op.touched(3, routing=[1.0, 1.0, 0.0, 0.0])
    assert skewed == [1.0, 1.0, 0.0, 0.0]


def test_small_ops_by_hand():
    assert MLP(hidden=4, d_ff=6).work(2, 3, 0, False, **ARGS).flops == 6 * (4 * 4 * 6 + 16)
    assert Linear(hidden=4).work(1, 1, 0, True, **ARGS).flops == 2 * 16 + 16
    assert Noop(hidden=4).work(9, 9, 9, True, **ARGS).flops == 0
    e = Embed(vocab=100, hidden=4).work(2, 3, 0, False, **ARGS)
    assert e.flops == 0 and e.weights == {"weight": 24.0}
    assert Norm(hidden=4).work(1, 2, 0, False, **ARGS).flops == 32
    h = LMHead(vocab=10, hidden=4, tied=True).work(3, 7, 0, False, **ARGS)
    assert h.flops == 2 * 3 * 4 * 10 and h.weights == {"weight": 40.0}  # last position only; tied reads the embedding
    m = MTP(4, (Attention(4, 2, 1, 2), MLP(4, 8)))
    assert m.state_bytes(2.0, 4.0, 2.0, 10) == 4 * 2 + 2 * 2 * 10 * 2


def test_roofline_by_hand():
    h100 = TARGETS["h100"]
    op = MLP(hidden=1024, d_ff=4096)
    w = op.work(1, 1, 0, True, **ARGS)
    prov = AnalyticProvider(h100, Efficiency(compute=0.5, memory=0.5, launch_seconds=1e-6))
    precisions = {k: "bf16" for k in op.params()}
    wbytes = (2 * 1024 * 4096 + 1024) * 2
    act = (2 * 1024 + 4096) * 2
    want = max(w.flops / (989e12 * 0.5), (wbytes + act) / (3.35e12 * 0.5)) + 3 * 1e-6
    assert prov.op_seconds(op, precisions, w, 1, 2.0, 1) == pytest.approx(want, rel=1e-12)
    # a large prefill is compute bound and FP8 weights double the math rate on Hopper
    big = op.work(1, 8192, 0, False, **ARGS)
    t_bf16 = prov.op_seconds(op, precisions, big, 1, 2.0, 8192)
    t_fp8 = prov.op_seconds(op, {k: "fp8" for k in precisions}, big, 1, 2.0, 8192)
    assert t_bf16 == pytest.approx(big.flops / (989e12 * 0.5) + 3e-6, rel=1e-9)
    assert t_fp8 == pytest.approx(big.flops / (1979e12 * 0.5) + 3e-6, rel=1e-9)
    # NVFP4 on Hopper: weight-only (BF16 math), on Blackwell: FP4 math
    nv = {k: "nvfp4" for k in precisions}
    assert prov.op_seconds(op, nv, big, 1, 2.0, 8192) == pytest.approx(t_bf16, rel=1e-9)
    b200 = AnalyticProvider(TARGETS["b200"], Efficiency(compute=0.5, memory=0.5, launch_seconds=1e-6))
    assert b200.op_seconds(op, nv, big, 1, 2.0, 8192) == pytest.approx(big.flops / (9000e12 * 0.5) + 3e-6, rel=1e-9)


@needs_configs
def test_super_state_matches_published_figures():
    prog = ir.load(SUPER)
    cm = CostModel(prog, "h100", get_scenario("chat", mtp_resident=True))
    mamba = sum(n.op.state_bytes(2.0, 4.0, 2.0, 0) for n in prog.blocks("mamba2"))
    assert mamba / 2**20 == pytest.approx(162.3, abs=0.05)  # REFERENCE: ~162 MiB, SSM state plus conv windows
    kv_bf16 = sum(n.op.state_bytes(2.0, 4.0, 2.0, 1) for n in prog.blocks("attention"))
    kv_fp8 = sum(n.op.state_bytes(1.0, 4.0, 2.0, 1) for n in prog.blocks("attention"))
    assert (kv_bf16, kv_fp8) == (8 * 1024, 4 * 1024)
    assert cm.state_bytes_per_request(0) > mamba  # + the MTP head's hidden


@needs_configs
def test_both_configs_cost_on_every_gpu_target_in_under_a_second():
    for cfg in (SUPER, NANO):
        prog = ir.load(cfg)
        for name, target in TARGETS.items():
            if target.kind != "gpu":
                continue
            for sc in ("long-1m", "decode-heavy", "prefill-heavy"):
                t0 = time.perf_counter()
                r = cost(prog, name, sc)
                assert time.perf_counter() - t0 < 1.0, (cfg.name, name, sc)
                assert r.weight_bytes > 0 and r.prefill_seconds > 0


@needs_configs
def test_named_scenarios_and_infeasibility():
    prog = ir.load(SUPER)
    r = cost(prog, "h100", "long-1m")
    assert r.max_concurrency == 0 and r.infeasible.startswith("memory: weights need 241.5 GB") and "1xh100" in r.infeasible
    node = cost(prog, "8xb200", "long-1m", recipe="nvfp4-hybrid")
    assert node.max_concurrency > 8 and node.max_batch == node.max_concurrency  # no rate floor
    dec = cost(prog, "8xb200", "decode-heavy")
    assert 0 < dec.max_batch <= dec.max_concurrency
    assert 1 / dec.serve_step_seconds >= 100 and dec.throughput_tokens_per_second == pytest.approx(
        dec.max_batch / dec.serve_step_seconds)
    assert dec.serve_step_seconds == pytest.approx(dec.decode_step_seconds + dec.max_batch / 65536 * dec.prefill_seconds)
    assert dec.binding == "rate floor" and dec.headroom["requests"] == dec.max_concurrency - dec.max_batch
    slow = cost(prog, "8xb200", "decode-heavy", rate_floor=1e6)
    assert slow.max_batch == 0 and slow.infeasible.startswith("rate floor: 1e+06 tokens/s per user wanted")


@needs_configs
def test_recipes_shrink_weights():
    prog = ir.load(SUPER)
    b = {r: cost(prog, "8xb200", "chat", recipe=r).weight_bytes for r in ("bf16", "fp8", "nvfp4-hybrid", "nvfp4")}
    assert b["bf16"] > b["fp8"] > b["nvfp4-hybrid"] > b["nvfp4"]
    assert b["bf16"] == pytest.approx(2 * 120.67e9, rel=0.01)  # the trunk, router in FP32; the MTP head not loaded
    with_mtp = cost(prog, "8xb200", "chat", recipe="bf16", mtp_resident=True).weight_bytes
    assert with_mtp == pytest.approx(b["bf16"] + 2 * 2.94e9, rel=0.01)


def test_a_quantized_program_costs_like_its_recipe():
    from puzzlekit.passes import PassManager
    from puzzlekit.tools.default_model import load_default
    prog = load_default()
    named = cost(prog, "b200", "chat", recipe="nvfp4-hybrid")
    PassManager("quantize{recipe=nvfp4-hybrid,samples=2,seq=32}").run(prog)
    own = cost(prog, "b200", "chat")
    assert own.weight_bytes == named.weight_bytes < cost(load_default(), "b200", "chat").weight_bytes
    assert own.decode_step_seconds == named.decode_step_seconds


def _program(top_k=2, state=16, hidden=64):
    blocks = [Mamba2(hidden, 4, 16, state, 2), MoE(hidden, 8, top_k, 128, 64), Attention(hidden, 4, 2, 16)]
    return ir.meta_weights(ir.assemble(Embed(256, hidden), blocks, Norm(hidden), LMHead(256, hidden),
                                       meta={"dtype": "bfloat16"}))


@settings(max_examples=40, deadline=None)
@given(k=st.integers(1, 7), batch=st.integers(1, 4096), context=st.integers(1, 10**6),
       target=st.sampled_from(["h100", "b200", "8xh200"]))
def test_larger_top_k_is_never_cheaper(k, batch, context, target):
    sc = Scenario(input_len=1024, output_len=1, context=context)
    lo, hi = CostModel(_program(k), target, sc), CostModel(_program(k + 1), target, sc)
    assert hi.decode_step_seconds(batch) >= lo.decode_step_seconds(batch)
    assert hi.prefill_seconds() >= lo.prefill_seconds()


@settings(max_examples=40, deadline=None)
@given(state=st.integers(1, 127), context=st.integers(1, 10**6))
def test_smaller_ssm_state_never_needs_more_memory(state, context):
    sc = Scenario(context=context)
    small, big = CostModel(_program(state=state), "h100", sc), CostModel(_program(state=state + 1), "h100", sc)
    assert small.state_bytes_per_request() <= big.state_bytes_per_request()
    assert small.weight_bytes() <= big.weight_bytes()


@needs_configs
@pytest.mark.parametrize("gpu", ["h100", "h200", "b200"])
def test_more_gpus_never_lower_the_memory_limit(gpu):
    prog = ir.load(NANO)
    concurrency = [cost(prog, f"8x{gpu}", "long-1m", gpus=g).max_concurrency for g in range(1, 9)]
    assert concurrency == sorted(concurrency) and concurrency[-1] > concurrency[0]


def test_target_files(tmp_path):
    f = tmp_path / "l40s.toml"
    f.write_text('name = "l40s"\nmemory_gb = 48\nbandwidth_tbs = 0.864\n[peak_tflops]\nbf16 = 362\nfp8 = 733\n')
    t = load_target_file(f)
    assert (t.memory_bytes, t.bandwidth, t.peak_flops["fp8"]) == (48e9, 0.864e12, 733e12)
    assert get_target(str(f)).name == "l40s"
    r = cost(_program(), str(f), "chat")
    assert r.max_batch > 0
    j = tmp_path / "x.json"
    j.write_text(json.dumps({"name": "x", "memory_gb": 1, "bandwidth_tbs": 1, "peak_tflops": {"bf16": 1},
                             "colour": "red"}))
    with pytest.raises(PuzzlekitError, match="unknown target field 'colour'"):
        load_target_file(j)
    with pytest.raises(PuzzlekitError, match="unknown target 'h300'"):
        get_target("h300")
    with pytest.raises(PuzzlekitError, match="unknown scenario"):
        get_scenario("long-2m")
    with pytest.raises(PuzzlekitError, match="kv_dtype"):
        get_scenario("chat", kv_dtype="int3")


class Clock:
    """A timer whose every reading is `dt` seconds after the last: each timed call lasts exactly `dt`."""

    def __init__(self, dt: float):
        self.t, self.dt = 0.0, dt

    def __call__(self) -> float:
        self.t += self.dt
        return self.t


CONDITIONS = {"cpu": "test cpu", "machine": "x86_64", "cores": 2, "threads": 2, "torch": "2.13.0", "dtype": "float32"}


def _provider(path, dt, conditions=CONDITIONS, **kw):
    return MeasuredProvider(cache=path, repeats=3, warmup=0, timer=Clock(dt), conditions_fn=lambda: dict(conditions),
                            **kw)


def test_measured_cpu_provider_times_and_caches(tmp_path):
    prog = _program(hidden=32)
    sc = Scenario(input_len=64, output_len=8)
    r = CostModel(prog, "cpu", sc, provider=_provider(tmp_path / "t.json", 1e-3)).report()
    assert r.max_batch == MeasuredProvider.max_batch and r.binding == "compute"  # no floor: the provider's cap
    ops = len({n.op for n in prog.nodes if n.op.kind != "mtp"})  # 6 distinct ops of 1 ms each
    assert r.decode_step_seconds == pytest.approx(len([n for n in prog.nodes if n.op.kind != "mtp"]) * 1e-3)
    cached = json.loads((tmp_path / "t.json").read_text())
    assert cached["conditions"] == CONDITIONS and len(cached["times"]) >= 2 * ops
    again = _provider(tmp_path / "t.json", 1.1e-3)  # within tolerance: the cache stands
    r2 = CostModel(prog, "cpu", sc, provider=again).report()
    assert r2.decode_step_seconds == r.decode_step_seconds and not again.invalidated
    assert again.timed == again.spot_checks  # only the spot checks were timed


def test_a_cache_off_by_more_than_the_tolerance_is_dropped(tmp_path):
    prog, sc = _program(hidden=32), Scenario(input_len=64, output_len=8)
    CostModel(prog, "cpu", sc, provider=_provider(tmp_path / "t.json", 1e-3)).decode_step_seconds(2)
    slow = _provider(tmp_path / "t.json", 2e-3)  # the machine is now twice as slow
    t = CostModel(prog, "cpu", sc, provider=slow).decode_step_seconds(2)
    assert "2.00x its cached value" in slow.invalidated
    assert t == pytest.approx(len([n for n in prog.nodes if n.op.kind != "mtp"]) * 2e-3)  # all re-timed


def test_a_cache_from_other_conditions_is_not_read(tmp_path):
    prog, sc = _program(hidden=32), Scenario(input_len=64, output_len=8)
    CostModel(prog, "cpu", sc, provider=_provider(tmp_path / "t.json", 1e-3)).decode_step_seconds(2)
    for change in ({"threads": 1}, {"torch": "2.12.0"}, {"cpu": "other cpu"}, {"dtype": "bfloat16"}):
        other = _provider(tmp_path / "x.json", 5e-3, CONDITIONS | change)
        other.cache_file = tmp_path / "t.json"
        assert other._load() == {}, change
    same = _provider(tmp_path / "t.json", 5e-3)
    assert len(same._cache) >= 6


def test_the_ops_of_a_step_are_timed_together(tmp_path, monkeypatch):
    prog = _program(hidden=32)
    prov = _provider(tmp_path / "t.json", 1e-3)
    groups = []
    real = MeasuredProvider._round_robin
    monkeypatch.setattr(MeasuredProvider, "_round_robin", lambda self, items: groups.append(items) or real(self, items))
    CostModel(prog, "cpu", Scenario(input_len=64, output_len=8), provider=prov).decode_step_seconds(3)
    distinct = {n.op for n in prog.nodes if n.op.kind != "mtp"}
    assert len(groups) == 1 and {it[0] for it in groups[0]} == distinct and all(it[1] == 3 for it in groups[0])


def test_the_whole_model_check_retimes_when_the_sum_is_off(tmp_path, small_program):
    prog = small_program
    cm = CostModel(prog, "cpu", Scenario(input_len=16, output_len=4), provider=_provider(tmp_path / "t.json", 1e-3))
    # every timed call lasts 1 ms: the ops sum to one per node, the whole model measures 1 ms
    got = cm.check_whole_model(batch=2)
    nodes = len([n for n in prog.nodes if n.op.kind != "mtp"])
    assert got["retimed"] and "whole model" in cm.provider.invalidated
    assert got["decode"]["ratio"] == pytest.approx(nodes) and got["prefill"]["measured"] == pytest.approx(1e-3)
    with pytest.raises(PuzzlekitError, match="measures this machine"):
        CostModel(prog, "h100", Scenario()).check_whole_model()


def test_cost_analysis_in_the_pass_manager():
    from puzzlekit.passes import AnalysisManager, PassManager
    prog = _program()
    am = AnalysisManager(prog)
    first = am.get("cost", target="h100", scenario="chat")
    PassManager("verify").run(prog, am)
    assert am.get("cost", target="h100", scenario="chat") is first
    PassManager("drop-blocks{layers=[1]}").run(prog, am)
    assert am.get("cost", target="h100", scenario="chat")["weight_bytes"] < first["weight_bytes"]
    assert math.isfinite(first["decode_step_seconds"])


def test_measured_routing_statistics_feed_the_cost():
    from puzzlekit.passes import AnalysisManager
    from puzzlekit.tools.default_model import load_default
    prog = load_default()
    am = AnalysisManager(prog)
    routing = am.get("routing", samples=4, seq=64)
    moe_paths = [n.path for n in prog.blocks("moe")]
    assert set(moe_paths) <= set(routing)
    for p in moe_paths:
        assert sum(routing[p]) == pytest.approx(2.0) and len(routing[p]) == 8  # top-2 of 8
    assert am.get("cost", target="h100", scenario="chat", measured_routing=True)["max_batch"] > 0
    # skewed routing touches fewer distinct experts at small batches than uniform routing would
    sc = get_scenario("chat")
    uniform = CostModel(prog, "h100", sc, routing={})
    measured = CostModel(prog, "h100", sc, routing={p: routing[p] for p in moe_paths})
    assert max(routing[moe_paths[0]]) > min(routing[moe_paths[0]])
    bytes_read = [sum(sum(n.op.work(4, 1, 64, True, 2.0, 4.0, 2.0, r).weights.values()) for n in prog.blocks("moe"))
                  for r in (None, routing[moe_paths[0]])]
    assert bytes_read[1] < bytes_read[0]
    assert measured.decode_step_seconds(4) < uniform.decode_step_seconds(4)
