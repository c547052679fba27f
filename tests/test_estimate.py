"""`--estimate` and the check before a run: the activation model against what autograd keeps, the training
state against the optimizer's own tensors, Super's stages on GPUs from its config alone, and refusals that name
the stage and the fixes before any work."""
import json

import pytest
import torch

from puzzlekit.estimate.activations import saved_floats
from puzzlekit.ir.ops import MLP, Attention, Mamba2, MoE
from puzzlekit.tools.cli import main
from puzzlekit.tools.estimate import Untimed

SUPER = "nemotron-3-super-120b-a12b"


def cli(capsys, *args):
    try:
        code = main([str(a) for a in args])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return code, out.out, out.err


def autograd_floats(op, rows: int, seq: int) -> float:
    """Floats per token the block's forward keeps for its backward (parameters apart), as autograd reports them."""
    torch.manual_seed(0)
    m = op.build()
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}
    kept = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            kept[s.data_ptr()] = s.nbytes()
        return t

    x = torch.randn(rows, seq, op.hidden, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(x)
    return sum(kept.values()) / 4 / (rows * seq)


# shapes unlike the ones the coefficients were fitted on (estimate/activations.py)
@pytest.mark.parametrize("op", [Mamba2(192, 24, 16, 32, 3, 4, 128), Mamba2(64, 48, 8, 16, 4, 4, 128),
                                MoE(160, 96, 7, 40, 80, 40, 1.0, True, 1e-5), MoE(96, 32, 4, 96, 0, 0, 1.0, True, 1e-5),
                                Attention(160, 10, 2, 16, 1e-5), MLP(160, 320)], ids=lambda op: op.kind)
def test_activation_model_matches_what_autograd_keeps(op):
    got, est = autograd_floats(op, 3, 96), saved_floats(op, 96, "cpu")
    assert est == pytest.approx(got, rel=0.10)


def test_training_state_is_what_adamw_holds():
    """The student's part: float32 weights, gradients and AdamW's two moments, 16 bytes a parameter."""
    from puzzlekit.estimate import estimate, parse_hardware
    from puzzlekit.passes.core import PASSES
    from puzzlekit.tools.default_model import model_path
    from puzzlekit import ir

    prog = ir.load(model_path(None))
    hw = parse_hardware("cpu")
    est = estimate([PASSES["distill"](teacher_logits="x", cos=0, mtp=0)], prog, hw, 2**32, rates=Untimed(hw))
    model = prog_module(prog)
    opt = torch.optim.AdamW(model.parameters())
    out = model(torch.zeros(1, 4, dtype=torch.long))
    sum(o.sum() for o in (out if isinstance(out, tuple) else (out,))).backward()  # the trunk and the MTP head
    opt.step()
    held = sum(p.nbytes + p.grad.nbytes for p in model.parameters())
    held += sum(t.nbytes for s in opt.state.values() for t in s.values() if t.dim())
    assert est.stages[0].memory["student (weights, gradients, optimizer)"] == pytest.approx(held, rel=1e-3)


def prog_module(prog):
    from puzzlekit.backends.torch import materialize

    return materialize(prog)


def test_super_on_eight_h100s_from_its_config(capsys, tmp_path):
    code, out, _ = cli(capsys, "compress", SUPER, "--estimate", "--hardware", "h100:8", "--target", "8xb200",
                       "--speedup", "2", "-o", tmp_path / "run", "--json")
    assert code == 0 and not (tmp_path / "run").exists()
    e = json.loads(out)
    names = [s["stage"] for s in e["stages"]]
    assert names == ["library", "puzzle", "distill", "mtp-check", "distill (MTP head)", "mtp-check", "quantize",
                     "write", "outputs"]
    assert e["hardware"]["processes"] == 8 and e["hardware"]["memory_bytes"] == 81559 * 2**20
    for s in e["stages"]:
        assert abs(s["peak_memory_bytes"] - sum(s["memory"].values())) <= len(s["memory"]) and s["seconds"] >= 0
        assert s["fits"] == (s["peak_memory_bytes"] <= 81559 * 2**20 and s["host_bytes"] <= 2e12 / 8)
        assert s["fits"] or s["fixes"]
    # after the search, the child a weightless search plans for the target; auto shards its distillation to fit
    child = e["planned_child_params"]
    assert 0.2 * 120668707840 < child < 120668707840
    distill = e["stages"][2]
    assert distill["fits"], distill
    assert e["auto"][0]["pass"] == "distill" and e["auto"][0]["options"]["shard"] == "fsdp"


def test_auto_fits_a_stage_without_changing_what_the_pipeline_set():
    """Super's distillation on 8 B200s: the options the pipeline's text sets stay as set (and the stage does not
    fit); left open, auto climbs until it fits; a stage that fits as it is gets nothing."""
    from puzzlekit import ir
    from puzzlekit.estimate import estimate, parse_hardware
    from puzzlekit.passes import parse_pipeline
    from puzzlekit.tools.default_model import model_path

    prog = ir.load(model_path(SUPER))
    hw = parse_hardware("b200:8")
    run = lambda text: estimate(parse_pipeline(text), prog, hw, 2**62, rates=Untimed(hw), auto=True)
    pinned = run("distill{shard=ddp,checkpointing=false}")
    assert not pinned.fits
    assert all("shard" not in o and "checkpointing" not in o for _, o in pinned.chosen)
    free = run("distill")
    assert free.fits and free.chosen[0][1]["shard"] == "fsdp"
    # a rung's options go together: bf16 parameters are not chosen beside an optimizer the text sets
    assert "params" not in run("distill{optimizer=adamw-cosine,teacher_dtype=auto}").chosen[0][1]
    small = ir.load(model_path(None))
    assert estimate(parse_pipeline("distill"), small, parse_hardware("b200:8"), 2**62, rates=Untimed(hw),
                    auto=True).chosen == []


def test_fsdp_divides_the_state_by_the_processes():
    from puzzlekit import ir
    from puzzlekit.estimate import estimate, parse_hardware
    from puzzlekit.passes.core import PASSES
    from puzzlekit.tools.default_model import model_path

    prog = ir.load(model_path(SUPER))
    hw = parse_hardware("b200:16")
    d = {shard: estimate([PASSES["distill"](shard=shard)], prog, hw, 2**62, rates=Untimed(hw)).stages[0].memory
         for shard in ("ddp", "fsdp")}
    largest = max(n.op.param_count() for n in prog.nodes if n.op.is_block or n.op.kind == "mtp")
    gathered = 2 * largest * 2  # one block gathered in bf16, the next prefetched
    for part in ("teacher", "student (weights, gradients, optimizer)"):
        assert d["fsdp"][part] == pytest.approx(d["ddp"][part] / 16 + gathered, rel=1e-12)


def test_one_h100_says_what_cannot_fit_and_the_run_is_refused(capsys, tmp_path, subword, monkeypatch):
    """(Super's config with a tokenizer whose ids fit its vocabulary: the run is refused for its memory alone.) The
    check before the run plans the child the --estimate before it planned: searched once."""
    from puzzlekit.estimate import child

    searched = []
    monkeypatch.setattr(child, "_PLANNED", {})
    monkeypatch.setattr(child, "meta_copy", lambda prog, real=child.meta_copy: searched.append(1) or real(prog))
    args = ["compress", SUPER, "--hardware", "h100:1", "--target", "8xb200", "--speedup", "2", "-o", tmp_path / "r",
            "--tokenizer", subword.tokenizer_dir]
    code, out, _ = cli(capsys, *args, "--estimate", "--json")
    assert code == 0
    stages = {s["stage"]: s for s in json.loads(out)["stages"]}
    assert not stages["distill"]["fits"]
    assert any("more GPUs under torchrun" in f for f in stages["distill"]["fixes"])
    code, _, err = cli(capsys, *args)
    assert code == 2 and "would not fit on 1 x h100" in err and "Ways to fit it" in err
    assert not (tmp_path / "r").exists() and len(searched) == 1


def test_a_model_without_a_head_has_no_head_stages(capsys, tmp_path):
    code, out, _ = cli(capsys, "compress", "nemotron-3-nano-30b-a3b", "--estimate", "--hardware", "b200:8",
                       "--target", "b200", "--speedup", "2", "-o", tmp_path / "r", "--json")
    assert code == 0
    assert [s["stage"] for s in json.loads(out)["stages"]] == ["library", "puzzle", "distill", "quantize", "write",
                                                               "outputs"]


def test_the_outputs_after_the_child_are_estimated_as_compress_runs_them(capsys, tmp_path):
    """The report's evaluations (more windows without --quick), the frontier's searches (longer than the one search
    they repeat) and the bundle (the child's weights 7.5 times on rank 0's host). Super's outputs are the last stage
    of `test_super_on_eight_h100s_from_its_config` too."""
    model = "nemotron-3-nano-30b-a3b"
    def outputs(*extra):
        code, out, _ = cli(capsys, "compress", model, "--estimate", "--hardware", "h100:8", "--target", "8xh100",
                           "--speedup", "2", "-o", tmp_path / "r", "--json", *extra)
        e = json.loads(out)
        assert code == 0 and e["stages"][-1]["stage"] == "outputs" and "lm-eval" in e["not_estimated"]
        return e, e["stages"][-1]

    full, stage = outputs()
    quick = outputs("--quick")[1]
    puzzle = next(s for s in full["stages"] if s["stage"] == "puzzle")
    report, frontier, bundle = (float(x.split()[-2]) for x in stage["notes"][0].split(", "))
    assert frontier > puzzle["seconds"] and bundle > 0 and stage["seconds"] > quick["seconds"] > frontier + bundle
    export = stage["host_memory"]["the bundle's export (module, graphs, golden check)"]
    assert export == pytest.approx(7.5 * 4 * full["planned_child_params"]) and stage["rank0_alone"]
    assert full["seconds"] == pytest.approx(3.0 + sum(s["seconds"] for s in full["stages"]))


def test_a_run_that_cannot_fit_this_machine_is_refused_before_work(capsys, tmp_path):
    code, _, err = cli(capsys, "run", "-p", "snapshot{name=teacher},distill{batch=4096,seq=65536,checkpointing=false,"
                       "accumulate=1}", "-o", tmp_path / "out")  # (set here: auto changes no option the text sets)
    assert code == 2 and "stage distill would not fit" in err and "checkpointing=true" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text, words", [("x100:8", "unknown GPU 'x100'"), ("h100:0", "NAME:COUNT")])
def test_bad_hardware(capsys, tmp_path, text, words):
    code, _, err = cli(capsys, "library", "-o", tmp_path / "lib", "--estimate", "--hardware", text)
    assert code == 2 and words in err


MEASURE = """
import resource, sys
from puzzlekit.tools.cli import main
code = main(sys.argv[1:])
print(code, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def test_a_distillations_measured_peak_is_within_a_quarter_of_its_estimate(tmp_path, capsys):
    """The property the refusal rests on, on a model whose training state outweighs the process (0.2 GB, float32):
    the estimate before the run against the peak resident memory the same run reaches in its own process."""
    import subprocess
    import sys
    from pathlib import Path

    from puzzlekit import ir
    from puzzlekit.ir.checkpoint import program_from_config

    cfg = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": 256,
           "hidden_size": 1024, "num_hidden_layers": 3, "hybrid_override_pattern": "ME*", "mamba_num_heads": 32,
           "mamba_head_dim": 64, "n_groups": 4, "ssm_state_size": 64, "conv_kernel": 4, "expand": 2,
           "chunk_size": 64, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64,
           "n_routed_experts": 16, "num_experts_per_tok": 2, "moe_intermediate_size": 1024,
           "moe_shared_expert_intermediate_size": 1024, "n_shared_experts": 1, "routed_scaling_factor": 1.0,
           "norm_topk_prob": True, "intermediate_size": 2048, "layer_norm_epsilon": 1e-5,
           "tie_word_embeddings": False, "torch_dtype": "float32", "num_nextn_predict_layers": 0,
           "use_conv_bias": True, "mamba_hidden_act": "silu", "mlp_hidden_act": "relu2"}
    prog = program_from_config(cfg, Path("config.json"))
    g = torch.Generator().manual_seed(0)
    for n in prog.nodes:
        for local, shape in n.op.params().items():
            t = torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=g) * 0.02
            prog.weights.set(f"{n.path}.{local}", t)
    ir.save(prog, tmp_path / "model")
    args = ["run", tmp_path / "model", "-p", "snapshot{name=teacher},distill{steps=2,batch=2,seq=64,eval_windows=2}",
            "-o", tmp_path / "out"]
    code, out, _ = cli(capsys, *args, "--estimate", "--json")
    estimate = max(s["peak_memory_bytes"] for s in json.loads(out)["stages"])
    ran = subprocess.run([sys.executable, "-c", MEASURE, *map(str, args)], capture_output=True, text=True)
    code, peak = map(int, ran.stdout.split()[-2:])
    assert code == 0, ran.stderr[-2000:]
    assert 1.2e9 < estimate and peak == pytest.approx(estimate, rel=0.25)


def test_auto_choices_are_set_on_the_passes_the_run_runs_and_named_by_occurrence():
    """The check before a run sets what auto chose on the very passes the run then runs (compress parses its
    pipeline once), a repeat's body included, and lists them by pass name and occurrence for the summary."""
    from argparse import Namespace

    from puzzlekit import ir
    from puzzlekit.passes import parse_pipeline, print_pipeline
    from puzzlekit.tools.default_model import model_path
    from puzzlekit.tools.estimate import check_before_run

    text = "snapshot{name=teacher},repeat{n=2}(set-topk{k=1},distill{steps=3}),distill{head_only=true}"
    passes = parse_pipeline(text)
    args = Namespace(hardware="b200:8", device="auto", max_memory=None, estimate=False, json=True, model=SUPER,
                     threads=0)
    chosen: list = []
    assert check_before_run(args, passes, ir.load(model_path(SUPER)), chosen=chosen) is False
    assert [(name, k) for name, k, _ in chosen] == [("distill", 0), ("distill", 1)]
    body, head = passes[1].body[1], passes[2]
    for p, (_, _, opts) in zip((body, head), chosen):
        assert opts and all(getattr(p, k) == v for k, v in opts.items())
    assert print_pipeline(passes) != print_pipeline(parse_pipeline(text))


def test_offload_moves_the_frozen_trunk_of_the_heads_stage_to_the_host():
    """FSDP2's CPUOffloadPolicy holds every shard of the student on the host: in the MTP head's stage the frozen
    trunk's too, not only the trained head's state."""
    from puzzlekit import ir
    from puzzlekit.estimate import estimate, parse_hardware
    from puzzlekit.passes.core import PASSES
    from puzzlekit.tools.default_model import model_path
    from puzzlekit.training.optimizers import PARAM_BYTES

    prog = ir.load(model_path(SUPER))
    hw = parse_hardware("h100:8")
    stage = {off: estimate([PASSES["distill"](shard="fsdp", head_only=True, offload=off)], prog, hw, 2**62,
                           rates=Untimed(hw)).stages[0] for off in (False, True)}
    head = next(n.op for n in prog.nodes if n.op.kind == "mtp").param_count()
    frozen = PARAM_BYTES["fp32"] * (prog.param_counts()["total"] - head) / 8
    part = "student (weights, gradients, optimizer)"
    assert stage[False].memory[part] - stage[True].memory[part] > frozen  # the trunk, and the head's own state
    assert stage[True].host["offloaded state"] - stage[False].host["offloaded state"] > frozen
