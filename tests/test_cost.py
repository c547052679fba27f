"""The cost model: hand-computed work per op, memory, the roofline, properties, named scenarios."""
import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from puzzlekit import PuzzlekitError, ir
from puzzlekit.backends.cost import (AnalyticProvider, CostModel, Deployment, Efficiency, MeasuredProvider, Scenario, cost,
                                     get_scenario)
from puzzlekit.backends.layout import Layout, layouts
from puzzlekit.backends.targets import TARGETS, get_target, load_target_file
from puzzlekit.ir.ops import MLP, MTP, Attention, Embed, Linear, LMHead, Mamba2, MoE, Noop, Norm
from puzzlekit.tools.default_model import config_path

SUPER = config_path("nemotron-3-super-120b-a12b")
NANO = config_path("nemotron-3-nano-30b-a3b")
ARGS = dict(kv_bytes=2.0, ssm_bytes=4.0, act_bytes=2.0)
ONE = Deployment(Layout(), act_bytes=2.0, kv_bytes=2.0, ssm_bytes=4.0)  # one device, BF16 activations and KV


def _at(prov, op, precisions, batch, tokens, context, decode, deployment=ONE):
    return prov.seconds(op, precisions, None, batch, tokens, context, decode, deployment)


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
    assert _at(prov, op, precisions, 1, 1, 0, True) == pytest.approx(want, rel=1e-12)
    # a large prefill is compute bound and FP8 weights double the math rate on Hopper
    big = op.work(1, 8192, 0, False, **ARGS)
    t_bf16 = _at(prov, op, precisions, 1, 8192, 0, False)
    t_fp8 = _at(prov, op, {k: "fp8" for k in precisions}, 1, 8192, 0, False)
    assert t_bf16 == pytest.approx(big.flops / (989e12 * 0.5) + 3e-6, rel=1e-9)
    assert t_fp8 == pytest.approx(big.flops / (1979e12 * 0.5) + 3e-6, rel=1e-9)
    # NVFP4 on Hopper: weight-only (BF16 math), on Blackwell: FP4 math
    nv = {k: "nvfp4" for k in precisions}
    assert _at(prov, op, nv, 1, 8192, 0, False) == pytest.approx(t_bf16, rel=1e-9)
    b200 = AnalyticProvider(TARGETS["b200"], Efficiency(compute=0.5, memory=0.5, launch_seconds=1e-6))
    assert _at(b200, op, nv, 1, 8192, 0, False) == pytest.approx(big.flops / (9000e12 * 0.5) + 3e-6, rel=1e-9)


def test_super_state_matches_published_figures():
    prog = ir.load(SUPER)
    cm = CostModel(prog, "h100", get_scenario("chat", mtp_resident=True))
    mamba = sum(n.op.state_bytes(2.0, 4.0, 2.0, 0) for n in prog.blocks("mamba2"))
    assert mamba / 2**20 == pytest.approx(162.3, abs=0.05)  # REFERENCE: ~162 MiB, SSM state plus conv windows
    kv_bf16 = sum(n.op.state_bytes(2.0, 4.0, 2.0, 1) for n in prog.blocks("attention"))
    kv_fp8 = sum(n.op.state_bytes(1.0, 4.0, 2.0, 1) for n in prog.blocks("attention"))
    assert (kv_bf16, kv_fp8) == (8 * 1024, 4 * 1024)
    assert cm.state_bytes_per_request(0) > mamba  # + the MTP head's hidden


def test_both_configs_cost_on_every_gpu_target():
    for cfg in (SUPER, NANO):
        prog = ir.load(cfg)
        for name, target in TARGETS.items():
            if target.kind != "gpu":
                continue
            for sc in ("long-1m", "decode-heavy", "prefill-heavy"):
                r = cost(prog, name, sc, layout=f"tp{target.devices}")  # layouts: test_a_two_gpu_layout_by_hand
                assert r.weight_bytes > 0 and r.prefill_seconds > 0, (cfg.name, name, sc)


def test_named_scenarios_and_infeasibility():
    prog = ir.load(SUPER)
    r = cost(prog, "h100", "long-1m")
    assert r.max_concurrency == 0 and r.infeasible.startswith("memory: 241.5 GB of weights") and "h100" in r.infeasible
    node = cost(prog, "8xb200", "long-1m", recipe="nvfp4-hybrid", layout="tp8")
    assert node.max_concurrency > 8 and node.max_batch == node.max_concurrency  # no rate floor
    dec = cost(prog, "8xb200", "decode-heavy", layout="tp8")
    assert 0 < dec.max_batch <= dec.max_concurrency
    assert 1 / dec.serve_step_seconds >= 100 and dec.throughput_tokens_per_second == pytest.approx(
        dec.max_batch / dec.serve_step_seconds)
    assert dec.serve_step_seconds == pytest.approx(dec.decode_step_seconds + dec.max_batch / 65536 * dec.prefill_seconds)
    assert dec.binding == "rate floor" and dec.headroom["requests"] == dec.max_concurrency - dec.max_batch
    slow = cost(prog, "8xb200", "decode-heavy", rate_floor=1e6, layout="tp8")
    assert slow.max_batch == 0 and slow.infeasible.startswith("rate floor: 1e+06 tokens/s per user wanted")


def test_recipes_shrink_weights():
    prog = ir.load(SUPER)
    b = {r: cost(prog, "8xb200", "chat", recipe=r, layout="tp8").weight_bytes for r in ("bf16", "fp8", "nvfp4-hybrid", "nvfp4")}
    assert b["bf16"] > b["fp8"] > b["nvfp4-hybrid"] > b["nvfp4"]
    assert b["bf16"] == pytest.approx(2 * 120.67e9, rel=0.01)  # the trunk, router in FP32; the MTP head not loaded
    with_mtp = cost(prog, "8xb200", "chat", recipe="bf16", mtp_resident=True, layout="tp8").weight_bytes
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


def test_a_pinned_cost_table_is_used_as_it_is(tmp_path, monkeypatch):
    """What compress pins ($PUZZLEKIT_COST_TABLE): read whatever machine timed it, never spot-checked, so every
    round and every rerun of a run is priced alike."""
    prog, sc = _program(hidden=32), Scenario(input_len=64, output_len=8)
    first = CostModel(prog, "cpu", sc, provider=_provider(tmp_path / "t.json", 1e-3)).decode_step_seconds(2)
    monkeypatch.setenv("PUZZLEKIT_COST_TABLE", str(tmp_path / "t.json"))
    later = MeasuredProvider(repeats=3, warmup=0, timer=Clock(9e-3),
                             conditions_fn=lambda: CONDITIONS | {"cpu": "another machine"})
    cm = CostModel(prog, "cpu", sc, provider=later)
    assert later.pinned and cm.decode_step_seconds(2) == first
    assert later.timed == 0 and not later.invalidated
    ops = [n.op for n in prog.nodes if n.op.kind != "mtp"]
    cm.prepare(ops, 2)  # a search re-times the parent's ops with its variants'; a pinned table only adds its missing
    later.store([(ops[0], 2, 1, sc.decode_context, True)], [99.0])
    assert CostModel(prog, "cpu", sc, provider=later).decode_step_seconds(2) == first


def test_the_ops_of_a_step_are_timed_together(tmp_path, monkeypatch):
    prog = _program(hidden=32)
    prov = _provider(tmp_path / "t.json", 1e-3)
    groups = []
    real = MeasuredProvider._measure
    monkeypatch.setattr(MeasuredProvider, "_measure", lambda self, items, extra=(): groups.append(items) or real(self, items, extra))
    CostModel(prog, "cpu", Scenario(input_len=64, output_len=8), provider=prov).decode_step_seconds(3)
    distinct = {n.op for n in prog.nodes if n.op.kind != "mtp"}
    assert len(groups) == 1 and {it[0] for it in groups[0]} == distinct and all(it[1] == 3 for it in groups[0])


def test_a_search_times_its_variants_with_the_parents_ops(tmp_path, monkeypatch):
    prog = _program(hidden=32)
    cm = CostModel(prog, "cpu", Scenario(input_len=64, output_len=8), provider=_provider(tmp_path / "t.json", 1e-3))
    cm.decode_step_seconds(2)
    cm.prefill_seconds()  # the parent priced (as the search's baseline report does)
    groups = []
    real = MeasuredProvider._measure
    monkeypatch.setattr(MeasuredProvider, "_measure", lambda self, items, extra=(): groups.append(items) or real(self, items, extra))
    moe = next(n for n in prog.nodes if n.op.kind == "moe")
    variant = moe.op.resized("top_k", 1)
    cm.prepare([n.op for n in prog.nodes] + [variant], 2)
    ops = {n.op for n in prog.nodes if n.op.kind != "mtp"} | {variant}
    assert len(groups) == 1 and {it[0] for it in groups[0]} == ops and len(groups[0]) == 2 * len(ops)
    cm.prepare([n.op for n in prog.nodes] + [variant], 2)  # all timed now: nothing more
    assert len(groups) == 1
    assert cm.node_costs(moe.path, variant, 2)["decode_seconds"] == pytest.approx(1e-3)


def test_the_whole_model_check_times_ops_and_model_together(tmp_path, small_program, monkeypatch):
    prog = small_program
    prov = _provider(tmp_path / "t.json", 1e-3)
    cm = CostModel(prog, "cpu", Scenario(input_len=16, output_len=4), provider=prov)
    before = cm.decode_step_seconds(2)
    cm.prefill_seconds()
    groups = []
    real = MeasuredProvider.interleaved
    monkeypatch.setattr(MeasuredProvider, "interleaved", lambda self, runs: groups.append(len(runs)) or real(self, runs))
    got = cm.check_whole_model(batch=2)
    ops = len({n.op for n in prog.nodes if n.op.kind != "mtp"})
    assert groups == [2 * ops + 2]  # decode and prefill of every op and of the whole model, in one round-robin
    nodes = len([n for n in prog.nodes if n.op.kind != "mtp"])
    # every timed call lasts 1 ms: the ops sum to one per node, the whole model measures 1 ms
    assert got["decode"]["predicted"] == pytest.approx(before) == pytest.approx(nodes * 1e-3)
    assert got["decode"]["ratio"] == pytest.approx(nodes) and got["prefill"]["measured"] == pytest.approx(1e-3)
    assert not got["retimed"] and not prov.invalidated  # the times it was priced with agree with the fresh ones
    # the machine slows down: the check finds the cached times off, drops them and keeps its own
    prov.timer = Clock(3e-3)
    got = cm.check_whole_model(batch=2)
    assert got["retimed"] and "0.33x (decode)" in prov.invalidated
    assert cm.decode_step_seconds(2) == pytest.approx(nodes * 3e-3)
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


def test_the_cost_analysis_prices_only_layouts_the_engines_split():
    """A pass asking `am.get("cost")` gets what `puzzlekit cost` prints: the built-in model's 2 Mamba groups do not
    split over tp4 or tp8, so those layouts carry no figures and the best is one the engines split."""
    from puzzlekit.backends.cost.layouts import unsplit
    from puzzlekit.backends.layout import Layout
    from puzzlekit.passes import AnalysisManager
    from puzzlekit.tools.default_model import load_default

    prog = load_default()
    got = AnalysisManager(prog).get("cost", target="8xh100", scenario="chat")
    rows = {r["layout"]: r for r in got["layouts"]}
    assert "2 Mamba groups over tp8" in rows["tp8"]["unservable"] and "throughput" not in rows["tp8"]
    assert not unsplit(prog, Layout.parse(got["layout"]))
    assert all(("unservable" in r) == bool(unsplit(prog, Layout.parse(k))) for k, r in rows.items())


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


# -- the calibrated terms, by hand ------------------------------------------------------------------------------------
def test_grouped_gemm_efficiency_by_tokens_per_expert():
    e = Efficiency()  # compute 0.6, half a 128-row tile = 64 tokens
    assert e.moe(0) == 0.0
    assert e.moe(1) == pytest.approx(0.6 / 65)
    assert e.moe(64) == pytest.approx(0.3)
    assert e.moe(192) == pytest.approx(0.45)
    assert Efficiency(compute=0.5, moe_half_tokens=16).moe(48) == pytest.approx(0.375)


def test_a_moe_prices_its_routed_experts_as_a_grouped_gemm():
    op = MoE(hidden=1024, experts=64, top_k=4, d_ff=512, shared_d_ff=0, latent=0)
    prov = AnalyticProvider(TARGETS["h100"], Efficiency(launch_seconds=0.0))
    n = 16384  # prefill tokens: 16384 * 4 / 64 = 1024 tokens per expert -> efficiency 0.6 * 1024 / 1088
    w = op.work(1, n, 0, False, **ARGS)
    prec = {k: "bf16" for k in op.params()} | {"mixer.gate.weight": "fp32", "mixer.gate.e_score_correction_bias": "fp32"}
    routed_flops = n * 4 * 4 * 1024 * 512
    routed = routed_flops / (989e12 * 0.6 * 1024 / 1088)  # compute bound: 134 MB of experts take 50 us
    rest_flops = n * (2 * 1024 * 64 + 4 * 1024)  # router and norm
    rest_bytes = 64 * 1024 * 4 + 64 * 4 + 1024 * 2 + w.act * 2
    rest = max(rest_flops / (989e12 * 0.6), rest_bytes / (3.35e12 * 0.8))
    assert _at(prov, op, prec, 1, n, 0, False) == pytest.approx(routed + rest, rel=1e-9)
    # at one decode token per sequence and batch 8, 0.5 tokens per expert: the experts' reads bind
    d = op.work(8, 1, 0, True, **ARGS)
    touched = 1 - (1 - 4 / 64) ** 8
    reads = 64 * touched * 2 * 512 * 1024 * 2 / (3.35e12 * 0.8)
    assert reads > 8 * 4 * 4 * 1024 * 512 / (989e12 * 0.6 * 0.5 / 64.5)
    d_rest = max(8 * (2 * 1024 * 64 + 4 * 1024) / (989e12 * 0.6),
                 (64 * 1024 * 4 + 64 * 4 + 1024 * 2 + d.act * 2) / (3.35e12 * 0.8))
    assert _at(prov, op, prec, 8, 1, 0, True) == pytest.approx(reads + d_rest, rel=1e-9)


def test_attention_and_ssm_kernels_have_their_own_efficiency():
    h100 = TARGETS["h100"]
    prov = AnalyticProvider(h100, Efficiency(launch_seconds=0.0))
    att = Attention(hidden=1024, q_heads=8, kv_heads=2, head_dim=128)
    w = att.work(16, 1, 4096, True, **ARGS)
    gemm = 2 * 16 * (1024 * 1024 * 2 + 2 * 256 * 1024)
    kv = 16 * 4096 * 2 * 256 * 2 + 16 * 2 * 256 * 2
    core = max((w.flops - gemm) / (989e12 * 0.75), kv / (3.35e12 * 0.5))
    proj = max(gemm / (989e12 * 0.6), (sum(w.weights.values()) * 2 + w.act * 2) / (3.35e12 * 0.8))
    assert _at(prov, att, {k: "bf16" for k in att.params()}, 16, 1, 4096, True) == pytest.approx(core + proj, rel=1e-9)
    # the SSM state update streams fp32 state at mamba_memory (0.25): halving it doubles that part only
    m = Mamba2(hidden=1024, heads=32, head_dim=64, state=128, groups=8)
    wm = m.work(64, 1, 0, True, **ARGS)
    prec = {k: "fp32" if k in m.fp32_params() else "bf16" for k in m.params()}
    base = _at(prov, m, prec, 64, 1, 0, True)
    slow = _at(AnalyticProvider(h100, Efficiency(launch_seconds=0.0, mamba_memory=0.125)), m, prec, 64, 1, 0, True)
    state = (wm.state_read + wm.state_write) / 3.35e12
    assert slow - base == pytest.approx(state / 0.125 - state / 0.25, rel=1e-9)


def test_collectives_per_layout_by_hand():
    """Tensor parallel: a ring all-reduce of the block output; attention data parallel with expert-parallel
    experts: a MoE's two all-to-alls of its tokens' k copies at the latent width; replicas: none."""
    prov = AnalyticProvider(TARGETS["8xb200"])
    moe = MoE(hidden=4096, experts=64, top_k=8, d_ff=512, shared_d_ff=0, latent=1024)
    att = Attention(hidden=4096, q_heads=32, kv_heads=2, head_dim=128)
    link, lat = 1800e9 * 0.41, 6e-6
    at = lambda layout: Deployment(Layout.parse(layout), 2.0, 1.0, 4.0)  # noqa: E731
    allreduce = lambda g, n: 2 * (g - 1) / g * n * 4096 * 2 / link + lat  # noqa: E731
    assert prov.collective_seconds(att, 256, at("tp8")) == pytest.approx(allreduce(8, 256), rel=1e-12)
    assert prov.collective_seconds(moe, 256, at("tp8.ep8")) == pytest.approx(allreduce(8, 256), rel=1e-12)
    all_to_all = 2 * (7 / 8 * 32 * 8 * 1024 * 2 / link + lat)  # 32 tokens per device, 7/8 of their copies leave
    assert prov.collective_seconds(moe, 32, at("tp1.dp8.ep8")) == pytest.approx(all_to_all, rel=1e-12)
    assert prov.collective_seconds(att, 32, at("tp1.dp8.ep8")) == 0.0
    both = allreduce(2, 64) + 2 * (7 / 8 * 32 * 8 * 1024 * 2 / link + lat)  # tp2 groups of 64 tokens: 32 each
    assert prov.collective_seconds(moe, 64, at("tp2.dp4.ep8")) == pytest.approx(both, rel=1e-12)
    assert prov.collective_seconds(att, 64, at("tp1.r8")) == 0.0


def test_layouts_round_trip_and_are_checked():
    got = layouts(8, experts=True)
    assert len(got) == len(set(got)) == 13 and all(L.gpus == 8 for L in got)
    assert [str(L) for L in got] == ["tp8", "tp8.ep8", "tp4.dp2.ep8", "tp2.dp4.ep8", "tp1.dp8.ep8", "tp4.r2",
                                     "tp4.ep4.r2", "tp2.dp2.ep4.r2", "tp1.dp4.ep4.r2", "tp2.r4", "tp2.ep2.r4",
                                     "tp1.dp2.ep2.r4", "tp1.r8"]
    # without routed experts: no ep, no attention data parallel (tests/test_layouts.py)
    assert [str(L) for L in layouts(8, experts=False)] == ["tp8", "tp4.r2", "tp2.r4", "tp1.r8"]
    assert all(Layout.parse(str(L)) == L for L in got)
    for bad, why in (("tp0", ">= 1"), ("tp4.ep3", "must divide"), ("tp2.dp2", "ep4"), ("8", "tp<N>")):
        with pytest.raises(PuzzlekitError, match=why):
            Layout.parse(bad)


def test_a_two_gpu_layout_by_hand():
    """Super-like blocks on 2 B200s in each layout: per-device weights, KV replication and step times."""
    mamba = Mamba2(hidden=4096, heads=128, head_dim=64, state=128, groups=8)
    att = Attention(hidden=4096, q_heads=32, kv_heads=1, head_dim=128)  # one KV head: replicated at tp2
    moe = MoE(hidden=4096, experts=8, top_k=2, d_ff=1024, shared_d_ff=0, latent=0)
    prog = ir.meta_weights(ir.assemble(Embed(1024, 4096), [mamba, att, moe], Norm(4096), LMHead(1024, 4096),
                                       meta={"dtype": "bfloat16"}))
    sc = Scenario(input_len=1000, output_len=100, kv_dtype="bf16")
    node = get_target("b200").node(2)
    tp, rep, dp, tep = (CostModel(prog, node, sc, layout=x) for x in ("tp2", "tp1.r2", "tp1.dp2.ep2", "tp2.ep2"))
    total = sum(math.prod(s) * 2 for n in prog.nodes for k, s in n.op.params().items()) \
        + sum(math.prod(s) * 2 for op in (mamba, moe) for k, s in op.params().items() if k in op.fp32_params())
    kv = sum(math.prod(att.params()[f"mixer.{k}_proj.weight"]) * 2 for k in "kv")
    experts = sum(math.prod(s) * 2 for k, s in moe.params().items() if k.startswith("mixer.experts."))
    assert tp.weight_bytes() == rep.weight_bytes() == dp.weight_bytes() == total
    assert tp.device_weight_bytes() == pytest.approx((total - kv) / 2 + kv)  # K/V projections on both devices
    assert rep.device_weight_bytes() == total
    assert tep.device_weight_bytes() == pytest.approx(tp.device_weight_bytes())  # experts split either way
    assert dp.device_weight_bytes() == pytest.approx(total - experts / 2)  # only the experts are spread
    ctx = sc.context_len
    m_state, a_state = mamba.state_bytes(2.0, 4.0, 2.0, ctx), att.state_bytes(2.0, 4.0, 2.0, ctx)
    assert tp.device_state_bytes() == pytest.approx(m_state / 2 + a_state)  # the one KV head is on both
    assert rep.device_state_bytes() == dp.device_state_bytes() == pytest.approx(m_state + a_state)
    # memory: a replica's requests fill its devices; tp2 and replicas hold one copy per device pair or device
    avail = 183359 * 2**20 - tp.reserve_bytes()
    assert tp.max_requests() == int((avail - tp.device_weight_bytes()) // tp.device_state_bytes())
    assert dp.max_requests() == 2 * int((avail - dp.device_weight_bytes()) // dp.device_state_bytes())
    assert rep.report().max_concurrency == 2 * rep.max_requests()
    # the attention decode reads its KV cache once per device at tp2 (not split: one KV head)
    prov = AnalyticProvider(node, Efficiency(launch_seconds=0.0))
    d = lambda layout: Deployment(Layout.parse(layout), 2.0, 2.0, 4.0)  # noqa: E731
    prec = {k: "bf16" for k in att.params()}
    w = att.work(8, 1, 1000, True, **ARGS)
    gemm = 2 * 8 * sum(math.prod(s) for s in att.params().values() if len(s) == 2)
    core = max((w.flops - gemm) / 2 / (2250e12 * 0.75), (w.state_read + w.state_write) / (7.7e12 * 0.5))
    wbytes = sum(v * 2 for k, v in w.weights.items())
    proj = max(gemm / 2 / (2250e12 * 0.6), ((wbytes - kv) / 2 + kv + w.act * 2 / 2) / (7.7e12 * 0.8))
    link = 1800e9 * 0.41
    allreduce = 2 * (1 / 2) * 8 * 4096 * 2 / link + 6e-6
    assert prov.seconds(att, prec, None, 8, 1, 1000, True, d("tp2")) == pytest.approx(core + proj + allreduce)
    # data parallel: each group decodes 4 of the 8 requests with all the weights, no collective
    w4 = att.work(4, 1, 1000, True, **ARGS)
    gemm4 = 2 * 4 * sum(math.prod(s) for s in att.params().values() if len(s) == 2)
    core4 = max((w4.flops - gemm4) / (2250e12 * 0.75), (w4.state_read + w4.state_write) / (7.7e12 * 0.5))
    proj4 = max(gemm4 / (2250e12 * 0.6), (wbytes + w4.act * 2) / (7.7e12 * 0.8))
    assert prov.seconds(att, prec, None, 8, 1, 1000, True, d("tp1.dp2.ep2")) == pytest.approx(core4 + proj4)
    # expert parallel over 2 devices at 8 tokens: each device reads its 4 experts as they are chosen, the
    # busiest by a normal bound on the count (mean + sd x sqrt(2 ln 2), at most all 4), and computes half the
    # tokens' experts
    p = 1 - (1 - 2 / 8) ** 8
    size = 2 * 1024 * 4096 * 2
    busiest = min(4 * p * size + math.sqrt(4 * p * (1 - p)) * size * math.sqrt(2 * math.log(2)), 4 * size)
    flops = 8 * 2 * 4 * 4096 * 1024 / 2
    eff = 0.6 * (8 * 2 / 8) / (8 * 2 / 8 + 64)
    routed = max(flops / (2250e12 * eff), busiest / (7.7e12 * 0.8))
    mprec = {k: "bf16" for k in moe.params()}
    assert prov._routed(moe, mprec, None, 8, d("tp1.dp2.ep2")) == pytest.approx(routed)
    assert prov._routed(moe, mprec, None, 8, d("tp2.ep2")) == pytest.approx(routed)  # whole experts, tokens on both
    even = max(flops / (2250e12 * eff), 8 * p * size / 2 / (7.7e12 * 0.8))  # ep1: a slice of every expert
    assert prov._routed(moe, mprec, None, 8, d("tp2")) == pytest.approx(even)


def _with_mtp(hidden=64):
    blocks = [Mamba2(hidden, 4, 16, 16, 2), MoE(hidden, 8, 2, 128, 64), Attention(hidden, 4, 2, 16)]
    mtp = MTP(hidden, (Attention(hidden, 4, 2, 16), MLP(hidden, 128)))
    return ir.meta_weights(ir.assemble(Embed(256, hidden), blocks, Norm(hidden), LMHead(256, hidden), mtp,
                                       meta={"dtype": "bfloat16"}))


def test_mtp_head_residency_on_and_off():
    prog = _with_mtp()
    off = CostModel(prog, "h100", Scenario(context=100))
    on = CostModel(prog, "h100", Scenario(context=100, mtp_resident=True))
    # eh_proj 2*64*64, three norms, attention (norm, q 64x64, k and v 32x64, o 64x64), MLP (norm, up and down 64x128)
    mtp_params = 8192 + 192 + (64 + 4096 + 2048 + 2048 + 4096) + (64 + 2 * 8192)
    assert on.weight_bytes() - off.weight_bytes() == 2 * mtp_params == 74368
    # the head's state: the last trunk hidden (bf16) and its attention's KV (2 x 32 channels x 100 tokens, bf16)
    assert on.state_bytes_per_request() - off.state_bytes_per_request() == 64 * 2 + 2 * 32 * 100 * 2 == 12928
    assert on.decode_step_seconds(4) == off.decode_step_seconds(4)  # plain decoding does not run it
    mtp_path = next(n.path for n in prog.nodes if n.op.kind == "mtp")
    head = next(n.op for n in prog.nodes if n.op.kind == "mtp")
    assert on.node_costs(mtp_path, head, 4)["weight_bytes"] == 74368
    assert off.node_costs(mtp_path, head, 4)["weight_bytes"] == 0.0


def test_a_speculative_decoding_step_by_hand():
    """d = 2 drafts: the head twice at batch B, the trunk verifying 3 tokens per request, the LM head at
    3B positions and at each draft; 2.5 tokens per step; the Mamba layer keeps 3 SSM states."""
    prog = _with_mtp()
    plain = CostModel(prog, "h100", Scenario(context=100))
    spec = CostModel(prog, "h100", Scenario(context=100, mtp_draft=2, mtp_acceptance=2.5))
    prov, d = spec.provider, spec.deployment
    assert d.ssm_copies == 3
    B = 8
    at = lambda op, b, t: prov.seconds(op, spec.precisions[n_path[op]], None, b, t, 100, True, d)  # noqa: E731
    n_path = {n.op: n.path for n in prog.nodes}
    head, lm = (next(n.op for n in prog.nodes if n.op.kind == k) for k in ("mtp", "lm_head"))
    trunk = [n.op for n in prog.nodes if n.op.kind not in ("mtp", "lm_head")]
    want = prov.step_overhead() + sum(at(op, B, 3) for op in trunk) + at(lm, 3 * B, 1) + 2 * at(lm, B, 1) \
        + 2 * at(head, B, 1)
    assert spec.decode_step_seconds(B) == pytest.approx(want, rel=1e-12)
    # users get 2.5 tokens per serving step; each finishes a request every output_len / 2.5 steps
    serve = spec.serve_seconds(B)
    assert spec.prefill_share(B) == pytest.approx(B * 2.5 / spec.scenario.output_len)
    assert spec.throughput(B, serve) == pytest.approx(B * 2.5 / serve)
    # verification writes the three SSM states (memory bound here): two more state writes than plain decoding
    mamba = trunk[1]
    assert mamba.kind == "mamba2"
    w = mamba.work(B, 3, 100, True, 2.0, 4.0, 2.0)
    one = type(d)(d.layout, d.act_bytes, d.kv_bytes, d.ssm_bytes, 1)
    extra = prov.seconds(mamba, spec.precisions[n_path[mamba]], None, B, 3, 100, True, d) \
        - prov.seconds(mamba, spec.precisions[n_path[mamba]], None, B, 3, 100, True, one)
    assert extra == pytest.approx(2 * w.state_write / (get_target("h100").bandwidth * prov.eff.mamba_memory), rel=1e-9)
    m_state = mamba.state_bytes(2.0, 4.0, 2.0, 100)
    assert spec.state_bytes_per_request() - plain.state_bytes_per_request() == pytest.approx(
        2 * m_state + head.state_bytes(2.0, 4.0, 2.0, 100))  # two more SSM copies, and the head's own state
    with pytest.raises(Exception, match=r"mtp_acceptance=3.5 .* \[1, 3\]"):
        Scenario(mtp_draft=2, mtp_acceptance=3.5).check()


def test_the_reserve_is_workspace_plus_the_activation_peak_in_bytes():
    prog = _program()  # hidden 64: Mamba2 (4 heads x 16, state 16, 2 groups), MoE (8 x 128, top-2), attention
    cm = CostModel(prog, "h100", Scenario(input_len=4096, prefill_chunk=1024))
    # the Mamba block holds the most per token: 2*64 in/out + in_proj 196 + 2 * conv 128 + 2 * inner 64 = 708
    assert cm.activation_bytes() == 1024 * 708 * 2 == 1449984
    assert cm.reserve_bytes() == 4 * 2**30 + 1449984
    node = CostModel(prog, "8xb200", Scenario(input_len=4096, prefill_chunk=1024, workspace_bytes=1e9))
    assert node.reserve_bytes() == 1e9 + 1449984  # per device
    assert node.usable_memory() == 183359 * 2**20 - node.reserve_bytes()
    short = CostModel(prog, "h100", Scenario(input_len=100, prefill_chunk=1024))  # a prompt shorter than a chunk
    assert short.activation_bytes() == 100 * 708 * 2
    with pytest.raises(PuzzlekitError, match="workspace_bytes"):
        Scenario(workspace_bytes=-1).check()


# -- properties -----------------------------------------------------------------------------------------------------
SHRINKS = [(1, "experts"), (1, "d_ff"), (1, "top_k"), (1, "shared_d_ff"), (1, "latent"), (0, "state"),
           (0, "head_dim"), (2, "q_heads")]


def _three(moe=None, mamba=None, att=None, hidden=64):
    blocks = [mamba or Mamba2(hidden, 4, 16, 16, 2), moe or MoE(hidden, 8, 4, 128, 64, latent=32),
              att or Attention(hidden, 4, 2, 16)]
    return ir.meta_weights(ir.assemble(Embed(256, hidden), blocks, Norm(hidden), LMHead(256, hidden),
                                       meta={"dtype": "bfloat16"}))


@settings(max_examples=30, deadline=None)
@given(which=st.sampled_from(SHRINKS), frac=st.floats(0.1, 0.95), batch=st.integers(1, 2048),
       target=st.sampled_from(["h100", "b200", "8xb200"]), recipe=st.sampled_from(["", "fp8", "nvfp4-hybrid"]),
       input_len=st.integers(1, 50000), output_len=st.integers(0, 70000))
def test_costs_never_increase_when_an_axis_shrinks(which, frac, batch, target, recipe, input_len, output_len):
    layer, axis = which
    parent = _three()
    op = parent.blocks()[layer].op
    full = getattr(op, axis)
    step = op.kv_heads if axis == "q_heads" else 1
    n = max(step, int(full * frac) // step * step)
    if axis == "experts":
        n = max(n, op.top_k)
    small = op.resized(axis, n)
    child = _three(**{("mamba", "moe", "att")[layer]: small})
    if recipe == "nvfp4-hybrid" and target == "h100":
        recipe = "fp8"
    sc = Scenario(input_len=input_len, output_len=output_len, recipe=recipe)
    a, b = CostModel(parent, target, sc), CostModel(child, target, sc)
    tol = 1e-12
    assert b.decode_step_seconds(batch) <= a.decode_step_seconds(batch) * (1 + tol)
    assert b.prefill_seconds() <= a.prefill_seconds() * (1 + tol)
    assert b.serve_seconds(batch) <= a.serve_seconds(batch) * (1 + tol)
    assert b.weight_bytes() <= a.weight_bytes() and b.state_bytes_per_request() <= a.state_bytes_per_request()
    assert b.reserve_bytes() <= a.reserve_bytes()


@settings(max_examples=30, deadline=None)
@given(context=st.integers(1, 10**6), more=st.integers(1, 10**6), target=st.sampled_from(["h100", "h200", "8xb200"]),
       workspace=st.floats(0, 8e9))
def test_concurrency_never_increases_when_context_grows(context, more, target, workspace):
    prog = _three()
    short = cost(prog, target, Scenario(context=context, workspace_bytes=workspace))
    long = cost(prog, target, Scenario(context=context + more, workspace_bytes=workspace))
    assert long.max_concurrency <= short.max_concurrency


def test_the_cost_command_names_the_binding_constraint_and_headroom(capsys):
    from puzzlekit.tools.cli import main
    assert main(["cost", "--target", "h100", "--scenario", "chat"]) == 0
    out = capsys.readouterr().out
    assert "binding: " in out and "headroom: " in out and "GB reserve" in out
    assert main(["cost", "--target", "h100", "--scenario", "chat", "--json"]) == 0
    j = json.loads(capsys.readouterr().out)
    assert j["binding"] in ("memory", "rate floor", "compute", "concurrency")
    assert set(j["headroom"]) == {"memory_bytes", "requests", "rate_tokens_per_second"}
    assert j["headroom"]["requests"] == j["max_concurrency"] - j["max_batch"]


def test_cost_refuses_a_pinned_layout_no_engine_splits_and_marks_such_rows(capsys):
    """(`cost --layout tp3` on Super priced 128 Mamba heads and 32 query heads over 3 devices, and printed a
    throughput for it.) The search's split rule applies: a pinned layout is refused naming what does not divide
    and the layouts that do; in the layout table such rows carry no figures, only why."""
    from puzzlekit.tools.cli import main

    assert main(["cost", str(SUPER), "--target", "8xh100", "--gpus", "3", "--layout", "tp3"]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in ("layout tp3", "128 Mamba heads over tp3", "32 query heads over tp3", "tp1.r3",
                                  "leave the layout out")), err
    assert main(["cost", str(SUPER), "--target", "8xh200", "--gpus", "3", "--recipe", "fp8", "--scenario", "chat"]) == 0
    out = capsys.readouterr().out
    assert "(best of 2; 2 no engine splits the model over)" in out
    marked = [ln.split()[0] for ln in out.splitlines() if "unservable: 128 Mamba heads over tp3" in ln]
    assert marked == ["tp3", "tp3.ep3"], out
    assert main(["cost", str(SUPER), "--target", "8xh200", "--gpus", "3", "--recipe", "fp8", "--scenario", "chat",
                 "--json"]) == 0
    j = json.loads(capsys.readouterr().out)
    rows = {r["layout"]: r for r in j["layouts"]}
    assert set(rows) == {"tp3", "tp3.ep3", "tp1.dp3.ep3", "tp1.r3"} and j["layout"] in ("tp1.dp3.ep3", "tp1.r3")
    assert "throughput" not in rows["tp3"] and "32 query heads over tp3 (9 layers)" in rows["tp3"]["unservable"]


def test_compress_reports_its_models_in_layouts_the_engines_split(tmp_path):
    """compress's deployment figures keep to the same rule: best layouts the engines split, and a pinned layout
    the parent does not split over (a child's pruned heads may) is reported as such, not priced."""
    from types import SimpleNamespace

    from puzzlekit.tools.compress_outputs import deployment
    from puzzlekit.tools.default_model import default_architecture

    h = 128
    parent = default_architecture()  # 2 Mamba groups: no split over tp4 under a quantized recipe
    child = ir.assemble(Embed(256, h), [Mamba2(h, 8, 32, 32, groups=4, chunk=32), Attention(h, 4, 2, 32)],
                        Norm(h), LMHead(256, h), None)
    args = SimpleNamespace(target="8xh100", scenario="chat", engine="all")
    dep = deployment(parent, child, args)
    assert dep["parent"]["predicted"]["layout"].startswith(("tp1", "tp2"))
    pinned = tmp_path / "pin.toml"
    pinned.write_text('[pin]\ninput_len = 2048\noutput_len = 512\ngpus = 4\nlayout = "tp4"\n')
    dep = deployment(parent, child, SimpleNamespace(target="8xh100", scenario=str(pinned), engine="all"))
    assert "2 Mamba groups over tp4" in dep["parent"]["predicted"]["unservable"]
    assert dep["child"]["predicted"]["layout"] == "tp4" and dep["child"]["predicted"]["tokens_per_second"] > 0
    dep = deployment(parent, child, SimpleNamespace(target="8xh100", scenario=str(pinned), engine="none"))
    assert dep["parent"]["predicted"]["layout"] == "tp4" and "unservable" not in dep["parent"]["predicted"]


def test_the_published_memory_figures():
    """Puzzle-75B: about 70 GB (GiB) of NVFP4 weights for Super and 44.5 for the child; on one H100 at 1M
    tokens, 1 request for Super and 8 for the child (goal 7-9)."""
    import sys
    sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
    import puzzle75b
    parent, child = ir.load(SUPER), puzzle75b.build()
    assert child.param_counts()["total"] == pytest.approx(75.3e9, rel=0.005)
    assert child.param_counts()["active"] == pytest.approx(9.3e9, rel=0.005)
    p, c = (cost(x, "h100", "long-1m", recipe="nvfp4-hybrid") for x in (parent, child))
    assert p.weight_bytes / 2**30 == pytest.approx(70, rel=0.10) and c.weight_bytes / 2**30 == pytest.approx(44.5, rel=0.10)
    assert p.max_concurrency == 1 and 7 <= c.max_concurrency <= 9
    assert p.binding == c.binding == "memory"


@pytest.mark.parametrize("body,words", [
    ("input_len = 'lots'", ["input_len = 'lots'", "not an integer", "takes an integer"]),
    ("rate_floor = 'fast'", ["rate_floor", "a number"]),
    ("input_len = 2.5", ["input_len = 2.5", "an integer"]),
    ("concurrency = true", ["concurrency = True", "an integer"]),
    ("mtp_resident = 1", ["mtp_resident = 1", "true or false"]),
    ("kv_dtype = 8", ["kv_dtype = 8", "a string"]),
    ("input_len = -3", ["input_len", ">= 1"]),
    ("kv_dtype = 'fp7'", ["kv_dtype='fp7'", "one of"]),
])
def test_a_scenario_file_with_a_wrong_value_names_the_file_the_key_and_what_it_takes(tmp_path, body, words):
    """(A string where a number belongs ended in "'<' not supported between instances of 'str' and 'int'".)"""
    from puzzlekit.backends.cost.scenario import get_scenario

    f = tmp_path / "mine.toml"
    f.write_text(f"[mine]\n{body}\n")
    with pytest.raises(PuzzlekitError) as e:
        get_scenario(str(f))
    assert str(f) in str(e.value) and all(w in str(e.value) for w in words), str(e.value)
