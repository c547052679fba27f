"""The measured-tables provider against aiconfigurator-core's own NemotronH model (an independent composition of
the same tables), op by op; where each price comes from; the expert term off the tables; the monotone decode
curve; and how a provider is chosen. Skipped without the `tables` extra (CI installs it)."""
from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("aiconfigurator_core")

from puzzlekit import ir  # noqa: E402
from puzzlekit.backends.cost import AnalyticProvider, CostModel, get_scenario  # noqa: E402
from puzzlekit.backends.cost.explain import _parts  # noqa: E402
from puzzlekit.backends.cost.prices import provider_for  # noqa: E402
from puzzlekit.backends.cost.tables import DATABASES, OURS, TablesProvider  # noqa: E402
from puzzlekit.backends.targets import get_target  # noqa: E402
from puzzlekit.errors import PuzzlekitError, UsageError  # noqa: E402
from puzzlekit.tools.default_model import config_path  # noqa: E402

SUPER, NANO, DENSE = "nemotron-3-super-120b-a12b", "nemotron-3-nano-30b-a3b", "nemotron-h-56b-base-8k"
#: our part -> the library's op name (after its context_/generation_ prefix), per kind
SHARED = {("embed", "embedding"): "embedding", ("lm_head", "logits"): "logits_gemm",
          ("mamba2", "norm"): "mamba_norm", ("mamba2", "in_proj"): "mamba_in_proj_gemm",
          ("mamba2", "out_proj"): "mamba_out_proj_gemm", ("mamba2", "all_reduce"): "mamba_ar",
          ("attention", "norm"): "attn_norm", ("attention", "qkv"): "qkv_gemm", ("attention", "attention"): "attention",
          ("attention", "proj"): "proj_gemm", ("attention", "all_reduce"): "attn_ar", ("moe", "norm"): "moe_norm",
          ("moe", "shared_up"): "shared_up_gemm", ("moe", "shared_relu2"): "shared_relu2",
          ("moe", "shared_down"): "shared_down_gemm", ("moe", "router"): "router_gemm",
          ("moe", "fc1_latent"): "fc1_latent_proj_gemm", ("moe", "moe_pre_dispatch"): "moe_pre_dispatch",
          ("moe", "experts"): "moe", ("moe", "moe_post_dispatch"): "moe_post_dispatch",
          ("moe", "fc2_latent"): "fc2_latent_proj_gemm", ("moe", "all_reduce"): "moe_ar", ("mlp", "norm"): "mlp_norm",
          ("mlp", "up"): "mlp_up_gemm", ("mlp", "relu2"): "mlp_relu2", ("mlp", "down"): "mlp_down_gemm",
          ("mlp", "all_reduce"): "mlp_ar"}
#: what each side has that the other does not: the library's Mamba kernels are rooflines without the state's
#: traffic (ours: puzzlekit's term), it has no final norm, and no pipeline parallel here
THEIRS_ONLY, OURS_ONLY = {"mamba_conv1d", "mamba_ssm", "p2p"}, {("mamba2", "mamba_conv_ssm"), ("norm", "norm")}


def library_model(name, tmp_path, tp, dp, ep, quant):
    """aiconfigurator-core's own NemotronH model of a shipped config, compiled on its tables."""
    import aiconfigurator_core
    from aiconfigurator_core.sdk import perf_database
    from aiconfigurator_core.sdk.config_builders import build_model_config
    from aiconfigurator_core.sdk.engine import EngineHandle, build_engine_spec_json
    from aiconfigurator_core.sdk.models import get_model

    shutil.copy(config_path(name), tmp_path / "config.json")
    db = perf_database.get_database_view("b200_sxm", "trtllm", DATABASES["trtllm"], database_mode="HYBRID")
    cfg = build_model_config(tp_size=tp, pp_size=1, attention_dp_size=dp, moe_tp_size=tp * dp // ep, moe_ep_size=ep,
                             gemm_quant_mode=quant, moe_quant_mode=quant, kvcache_quant_mode="fp8",
                             fmha_quant_mode="fp8", comm_quant_mode="half")
    model = get_model(str(tmp_path), cfg, "trtllm")
    spec = build_engine_spec_json(model, model_path=str(tmp_path), system="b200_sxm", backend="trtllm",
                                  backend_version=db.version, kv_block_size=None, systems_path=db.systems_root,
                                  nextn=0, database=db)
    return model, EngineHandle(aiconfigurator_core.engine_spec_bincode_from_json(spec), systems_path=db.systems_root)


@pytest.mark.parametrize("name,layout,recipe,quant", [(SUPER, "tp8.ep8", "nvfp4", "nvfp4"),
                                                      (NANO, "tp1", "bf16", "bfloat16"), (DENSE, "tp4", "fp8", "fp8")])
def test_per_layer_composition_equals_the_librarys_own_nemotron_h_op_by_op(tmp_path, name, layout, recipe, quant):
    degrees = dict(tp=1, dp=1, ep=1) | {p[:2]: int(p[2:]) for p in layout.split(".")}
    model, handle = library_model(name, tmp_path, degrees["tp"], degrees["dp"], degrees["ep"], quant)
    prog, t = ir.load(config_path(name)), get_target("8xb200")
    cm = CostModel(prog, t, get_scenario("decode-heavy", recipe=recipe, layout=layout, kv_dtype="fp8"),
                   TablesProvider(t))
    phases = {"generation": (handle.evaluate_generation_ops(list(range(len(model.generation_ops))), batch_size=64,
                                                            s=8704), (64, 1, 8703, True)),
              "context": (handle.evaluate_context_ops(list(range(len(model.context_ops))), batch_size=1, s=8192),
                          (1, 8192, 0, False))}
    for phase, (theirs, shape) in phases.items():
        theirs = {n.removeprefix(phase + "_"): ms for n, ms, *_ in theirs}
        ours: dict = {}
        for n in prog.nodes:
            for part, s, _ in _parts(cm, n, shape) if n.op.kind != "mtp" else []:
                ours[n.op.kind, part] = ours.get((n.op.kind, part), 0.0) + s * 1e3
        shared = {k: v for k, v in ours.items() if k in SHARED}
        assert set(ours) - set(shared) <= OURS_ONLY
        assert set(theirs) - {SHARED[k] for k in shared} <= THEIRS_ONLY
        for k, v in shared.items():
            assert v == pytest.approx(theirs[SHARED[k]], rel=1e-9, abs=1e-12), (phase, k)


def test_every_price_names_its_source_and_an_unmeasured_expert_shape_is_scaled_from_a_measured_one():
    prog, t = ir.load(config_path(SUPER)), get_target("8xb200")
    cm = CostModel(prog, t, get_scenario("decode-heavy", recipe="nvfp4-hybrid", layout="tp8.ep8"), TablesProvider(t))
    moe = next(n for n in prog.nodes if n.op.kind == "moe")
    known = {"measured", "borrowed from a nearby shape", "roofline", "empirical formula",
             "estimated from measured parts", OURS}
    for n in prog.nodes:
        for part, s, source in _parts(cm, n, (64, 1, 8192, True)):
            assert s >= 0 and (source in known or source.startswith("measured at")), (n.path, part, source)
    cut = moe.op.__class__(**{**moe.op.__dict__, "top_k": 11, "d_ff": 2000})
    parts = dict((p, src) for p, _, src in cm.provider.explain(cut, cm.precisions[moe.path], None, 64, 1, 8192, True,
                                                               cm.deployment))
    assert parts["experts"].startswith("measured at top-22 of 512 experts, width 1024, d_ff 2688")


def test_the_experts_price_falls_with_top_k_and_width_where_the_librarys_own_borrow_does_not():
    from aiconfigurator_core.sdk import common, operations
    from aiconfigurator_core.sdk.engine import build_ops_json

    prog, t = ir.load(config_path(SUPER)), get_target("8xb200")
    cm = CostModel(prog, t, get_scenario("decode-heavy", recipe="nvfp4-hybrid", layout="tp8.ep8"), TablesProvider(t))
    n = next(n for n in prog.nodes if n.op.kind == "moe")
    experts = lambda **kw: dict((p, s) for p, s, _ in cm.provider.explain(  # noqa: E731
        n.op.__class__(**{**n.op.__dict__, **kw}), cm.precisions[n.path], None, 64, 1, 8192, True,
        cm.deployment))["experts"]
    full, half_k, half_ff = experts(), experts(top_k=11), experts(d_ff=1344)
    assert half_ff == pytest.approx(full / 2, rel=0.05)  # memory bound at batch 64: half the bytes
    assert experts(top_k=4) < half_k < experts(top_k=18) < full  # fewer experts touched
    borrow = lambda k: cm.provider.handle.evaluate_ops_json(build_ops_json([operations.MoE(  # noqa: E731
        "m", 1, 1024, 2688, k, 512, 1, 8, common.MoEQuantMode.nvfp4, "power_law_1.01", 1, is_context=False,
        is_gated=False)]), is_context=False, batch_size=64, s=8192)[0][1]
    assert borrow(11) > 0.95 * borrow(22)  # why the library's own transfer is not used for the experts


@pytest.mark.parametrize("layout", ["tp4.r2", "tp8.ep8", "tp2.dp4.ep8"])
def test_a_cut_layers_experts_never_cost_more_than_a_wider_or_higher_top_k_one(layout):
    """Off the tables every cut of one layer is priced from one measured shape: fewer experts per token or a
    narrower d_ff never costs more (a cut once flipped to another model's measurement and cost 1.6x)."""
    prog, t = ir.load(config_path(SUPER)), get_target("8xb200")
    cm = CostModel(prog, t, get_scenario("decode-heavy", recipe="nvfp4-hybrid", layout=layout), TablesProvider(t))
    n = next(n for n in prog.nodes if n.op.kind == "moe")
    ks, widths = (4, 8, 11, 13, 16, 22), (1280, 1792, 2304, 2688)
    price, anchors = {}, set()
    for k in ks:
        for f in widths:
            cut = n.op.__class__(**{**n.op.__dict__, "top_k": k, "d_ff": f})
            (s, src), = [(s, src) for p, s, src in cm.provider.explain(cut, cm.precisions[n.path], None, 96, 1, 40960,
                                                                       True, cm.deployment) if p == "experts"]
            price[k, f] = s
            anchors.add(src.split(";")[0] if src.startswith("measured at") else "the shape itself")
    assert len(anchors) <= 2, anchors  # the layer's own measured shape, or one nearest to it
    for k, f in price:
        for k2, f2 in price:
            if k <= k2 and f <= f2:
                assert price[k, f] <= price[k2, f2] * (1 + 1e-9), (layout, (k, f), (k2, f2))


def test_a_decode_step_never_gets_cheaper_as_the_batch_grows():
    prog, t = ir.load(config_path(SUPER)), get_target("8xb200")
    for layout in ("tp8.ep8", "tp2.dp4.ep8"):
        cm = CostModel(prog, t, get_scenario("decode-heavy", recipe="fp8", layout=layout), TablesProvider(t))
        steps = [cm.serve_seconds(b) for b in range(1, 300)]
        assert all(b >= a for a, b in zip(steps, steps[1:])), layout


def test_auto_prices_the_gpus_the_tables_cover_with_them_and_refuses_tables_elsewhere():
    assert isinstance(provider_for(get_target("b200"), "auto"), TablesProvider)
    assert isinstance(provider_for(get_target("8xh100"), "auto"), TablesProvider)
    assert isinstance(provider_for(get_target("rtx-sm89"), "auto"), AnalyticProvider)
    assert isinstance(provider_for(get_target("b200"), "analytic"), AnalyticProvider)
    assert provider_for(get_target("cpu")) is None  # the measured provider of this machine
    with pytest.raises(UsageError, match="cpu target is timed.*drop --prices"):
        provider_for(get_target("cpu"), "tables")
    with pytest.raises(UsageError, match="not rtx-sm89.*--prices analytic"):
        provider_for(get_target("rtx-sm89"), "tables")
    with pytest.raises(PuzzlekitError, match="engine 'trt'"):
        TablesProvider(get_target("b200"), "trt")


def run_cli(capsys, *args) -> str:
    from puzzlekit.tools.cli import main

    assert main(list(args)) == 0
    return capsys.readouterr().out


def test_cost_explain_names_the_provider_and_each_parts_source(capsys):
    out = json.loads(run_cli(capsys, "cost", NANO, "--target", "b200", "--prices", "tables", "--explain", "--json"))
    assert out["prices"]["provider"] == "tables" and out["prices"]["library"] == "aiconfigurator-core 0.12.0"
    assert out["prices"]["database"] == f"trtllm {DATABASES['trtllm']}" and out["prices"]["mode"] == "HYBRID"
    rows = out["explain"]["decode"]
    assert {r["source"] for r in rows} >= {"measured", OURS} and all(r["source"] for r in rows)
    assert out["explain"]["decode_seconds"] == pytest.approx(out["decode_step_seconds"], rel=0.02)
    plain = json.loads(run_cli(capsys, "cost", NANO, "--target", "b200", "--prices", "analytic", "--explain", "--json"))
    assert plain["prices"]["provider"] == "analytic" and {r["source"] for r in plain["explain"]["decode"]} == {OURS}


def test_prices_are_kept_between_runs_and_never_read_across_a_changed_identity(tmp_path, monkeypatch):
    from puzzlekit.backends.cost import price_cache
    from puzzlekit.backends.cost.analytic import Efficiency

    monkeypatch.setenv("PUZZLEKIT_CACHE", str(tmp_path))
    monkeypatch.setattr(price_cache, "_OPEN", {})
    prog, t = ir.load(config_path(SUPER)), get_target("8xb200")
    shapes = [(b, 1, 40960, True) for b in (1, 7, 64, 300)] + [(1, 8192, 0, False)]

    def prices(eff=None):
        cm = CostModel(prog, t, get_scenario("decode-heavy", recipe="nvfp4-hybrid", layout="tp4.r2"),
                       TablesProvider(t, efficiency=eff))
        out = [cm.provider.seconds(n.op, cm.precisions[n.path], None, *sh, cm.deployment)
               for n in prog.nodes for sh in shapes]
        return out, cm.provider

    first, p1 = prices()
    assert p1._priced  # priced from the tables
    p1.kept.save()
    assert len(list((tmp_path / "prices").glob("*.json"))) == 1
    monkeypatch.setattr(price_cache, "_OPEN", {})  # a new process
    again, p2 = prices()
    assert again == first and not p2._priced  # read back, nothing priced again
    monkeypatch.setattr(price_cache, "_OPEN", {})
    _, p3 = prices(Efficiency(mamba_memory=0.5))  # another constant: another file, priced afresh
    assert p3._priced and p3.kept.path != p2.kept.path
    p2.kept.path.write_text("{not json")
    monkeypatch.setattr(price_cache, "_OPEN", {})
    broken, p4 = prices()
    assert broken == first and p4._priced  # an unreadable file is priced again


def test_layouts_alike_for_an_op_price_it_alike_and_once():
    """Replicas never change one device's time, and expert parallelism only a MoE's: a Mamba layer on tp4, tp4.r2
    and tp4.ep4.r2 is priced once, a MoE once for tp4.ep4 and tp4.ep4.r2 and apart for tp4."""
    from puzzlekit.backends.cost.provider import Deployment
    from puzzlekit.backends.layout import Layout

    prog, t = ir.load(config_path(SUPER)), get_target("8xb200")
    p = TablesProvider(t)
    kinds = {k: next(n for n in prog.nodes if n.op.kind == k) for k in ("mamba2", "moe")}
    cm = CostModel(prog, t, get_scenario("decode-heavy", recipe="nvfp4-hybrid", layout="tp4"), p)
    price = lambda k, layout: p.seconds(kinds[k].op, cm.precisions[kinds[k].path], None, 64, 1, 40960, True,  # noqa
                                        Deployment(layout=Layout.parse(layout)))
    mamba = {price("mamba2", L) for L in ("tp4", "tp4.r2", "tp4.ep4.r2")}
    assert len(mamba) == 1 and len(p._curves) == 1
    moe = [price("moe", L) for L in ("tp4.ep4", "tp4.ep4.r2", "tp4")]
    assert moe[0] == moe[1] != moe[2] and len(p._curves) == 3
