"""Distillation (losses, hooks, resume after a kill, data-parallel), MTP retention and Iterative Puzzle, on the
built-in model with small budgets."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from puzzlekit import ir
from puzzlekit.backends.torch import materialize
from puzzlekit.passes import AnalysisManager, PassError, PassManager, register
from puzzlekit.passes.core import Pass, Preserved
from puzzlekit.passes.distill import LOSSES, Batch, Distill, _capture, _outputs, distill, register_loss
from puzzlekit.tools.default_model import model_path

SMALL = "steps=6,batch=4,seq=32,eval_every=3,eval_windows=2,warmup=1,lr=1e-3"


@pytest.fixture(scope="module")
def parent():
    return ir.load(model_path(None))


def _pruned(parent):
    """The built-in model with every MoE routed to one expert and one Mamba layer dropped: a child to recover."""
    prog = parent.copy()
    PassManager("set-topk{k=1},drop-blocks{layers=[2]}").run(prog)
    return prog


def test_identical_student_and_teacher_give_zero_kl_cos_and_mtp_losses(parent):
    model = materialize(parent)
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    seen, undo = _capture(model)
    out = _outputs(model, seen, ids[:, :-1])
    undo()
    assert len(out.hidden) == len(parent.blocks())
    b = Batch(ids, out, out, temperature=2.0)
    for name in ("kl", "cos", "mtp"):
        assert abs(LOSSES[name](b).item()) < 1e-6, name
    assert LOSSES["lm"](b).item() > 0.5  # the text itself is not predicted perfectly


def test_distillation_lowers_the_childs_kl_to_its_teacher(parent):
    from puzzlekit.passes.puzzle.library import parent_hash

    teacher = parent.copy()
    for name in teacher.weights.names():  # in memory, as after an earlier pass: the child shares these tensors
        teacher.weights.set(name, teacher.weights.get(name).clone())
    child, before = _pruned(teacher), parent_hash(teacher)
    report = distill(child, teacher, Distill(steps=20, batch=4, seq=64, eval_every=10, eval_windows=16, lr=1e-3))
    assert parent_hash(teacher) == before  # the teacher is untouched
    assert report["steps"] == 20 and len(report["log"]) == 20
    assert report["after"]["kl"] < 0.8 * report["before"]["kl"], report
    assert set(report["log"][0]) >= {"kl", "cos", "mtp", "lr"}


def test_a_registered_loss_term_is_called_and_changes_the_update(parent):
    calls = []

    @register_loss("test-pull-embedding")
    def pull(b: Batch):  # grows with the logits' scale: a term the built-ins do not have
        calls.append(b.ids.shape)
        return b.student.logits.float().pow(2).mean()

    try:
        a, b = _pruned(parent), _pruned(parent)
        distill(a, parent, Distill(steps=2, batch=2, seq=16, eval_windows=1, keep_best=False))
        assert not calls
        distill(b, parent, Distill(steps=2, batch=2, seq=16, eval_windows=1, keep_best=False,
                                   loss=["test-pull-embedding:10"]))
        assert len(calls) == 2 and calls[0] == (2, 17)
        head = next(n for n in a.weights.names() if n.endswith("lm_head.weight"))
        assert not torch.allclose(a.weights.get(head), b.weights.get(head))
    finally:
        LOSSES.pop("test-pull-embedding")


def test_callbacks_see_every_step_and_evaluation_and_can_stop_the_run(parent, tmp_path):
    from puzzlekit.passes.distill import CALLBACKS, register_callback

    seen = []

    @register_callback("test-stop-at-4")
    class StopAt4:
        def __init__(self, settings):
            assert settings.eval_every == 2

        def on_step(self, step, losses):
            seen.append(("step", step, sorted(losses)))

        def on_eval(self, step, metrics):
            seen.append(("eval", step, sorted(metrics)))
            return step >= 4

    try:
        settings = Distill(steps=10, batch=2, seq=16, eval_every=2, eval_windows=1, callbacks=["test-stop-at-4"])
        report = distill(_pruned(parent), parent, settings, state_dir=tmp_path)
        assert report["steps"] == 4 and report["stopped"]
        assert [s[:2] for s in seen] == [("step", 1), ("step", 2), ("eval", 2), ("step", 3), ("step", 4), ("eval", 4)]
        assert seen[0][2] == ["cos", "kl", "mtp"] and "top1_agreement" in seen[2][2]
        again = distill(_pruned(parent), parent, settings, state_dir=tmp_path)  # a stopped run stays stopped
        assert again["steps"] == 4 and again["resumed_from"] == 4
    finally:
        CALLBACKS.pop("test-stop-at-4")


def test_unknown_hooks_are_refused_with_the_registered_names(parent):
    am = AnalysisManager(parent.copy())
    am.snapshots["teacher"] = parent
    for opts, match in (({"loss": ["nope"]}, "unknown loss term.*registered: cos, kl, lm, mtp"),
                        ({"source": "nope"}, "unknown data source 'nope'"),
                        ({"optimizer": "nope"}, "unknown optimizer 'nope'"),
                        ({"callbacks": ["nope"]}, "unknown callback 'nope'"),
                        ({"teacher": "missing"}, "neither a snapshot")):
        with pytest.raises(PassError, match=match):
            Distill(steps=1, batch=2, seq=16, eval_windows=1, **opts).run(am.prog, am)


def _run_cli(args, **kw):
    return subprocess.run([sys.executable, "-m", "puzzlekit.tools", *args], capture_output=True, text=True, **kw)


def _step(f: Path) -> int:
    try:
        return torch.load(f, weights_only=False)["step"]
    except Exception:  # not written yet, or being replaced
        return 0


PIPE = "snapshot{name=teacher},set-topk{k=1},distill{steps=12,batch=4,seq=32,eval_every=4,eval_windows=2," \
       "checkpoint_every=2,state=%s}"


@pytest.mark.slow  # two runs of the CLI; test_train's kill test covers the same loop in the default suite
def test_a_killed_distill_resumes_to_the_uninterrupted_result(tmp_path):
    whole = _run_cli(["run", "-p", PIPE % (tmp_path / "s1"), "-o", str(tmp_path / "whole"), "--json"])
    assert whole.returncode == 0, whole.stderr[-2000:]
    state = tmp_path / "s2"
    cmd = [sys.executable, "-m", "puzzlekit.tools", "run", "-p", PIPE % state, "-o", str(tmp_path / "killed")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 240
    while _step(state / "distill_state.pt") < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    saved = _step(state / "distill_state.pt")
    assert 2 <= saved < 12, f"the run was not interrupted mid-way (saved step {saved})"
    again = _run_cli(["run", "-p", PIPE % state, "-o", str(tmp_path / "killed")])
    assert again.returncode == 0, again.stderr[-2000:]
    a = load_file(str(tmp_path / "whole" / "model.safetensors"))
    b = load_file(str(tmp_path / "killed" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.slow  # heavy: runs with pytest -m slow
def test_two_processes_match_one_with_the_same_global_batch(tmp_path):
    """torchrun, 2 processes (gloo): each takes half of the same global batch; DDP averages the gradients."""
    pipe = "snapshot{name=teacher},set-topk{k=1},distill{steps=3,batch=4,seq=32,eval_windows=1,keep_best=false}"
    one = _run_cli(["run", "-p", pipe, "-o", str(tmp_path / "one")])
    assert one.returncode == 0, one.stderr[-2000:]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                          "29531", "-m", "puzzlekit.tools", "run", "-p", pipe, "-o", str(tmp_path / "two")],
                         capture_output=True, text=True, env=env)
    assert two.returncode == 0, two.stderr[-3000:]
    a = load_file(str(tmp_path / "one" / "model.safetensors"))
    b = load_file(str(tmp_path / "two" / "model.safetensors"))
    start = load_file(str(model_path(None) / "model.safetensors"))
    # AdamW steps each weight by its gradient's direction, not its size (m / sqrt(v): about +-lr a step). Where a
    # weight's gradient over the batch nearly cancels, float32 sums in another order (one process's 4 rows, or two
    # processes' 2 rows each, all-reduced) can turn that direction, and the weight then differs by up to what it
    # moved: a few weights of the model (5 of 1.8M measured, by 4e-5 where the largest move is 6e-4), never the
    # rest. So: every weight within the two runs' moves, and all but a few within float32 precision of the move.
    bound = max((a[k] - start[k]).abs().max().item() for k in a)  # the largest move: the sum of the step sizes
    moved = off = total = 0
    for k in a:
        scale = (a[k] - start[k]).abs().max().item()
        diff = (a[k] - b[k]).abs()
        assert diff.max().item() <= 2 * bound + 1e-7, k
        off += int((diff > 1e-4 * max(scale, a[k].abs().max().item()) + 1e-7).sum())
        total += diff.numel()
        moved += scale > 0
    assert moved > 10  # the runs trained (the comparison is not between two untouched models)
    assert off <= 1e-4 * total, f"{off} of {total} weights differ beyond float32 precision"  # a rank's half lost: most


def test_mtp_check_passes_the_parent_and_fails_a_scrambled_head(parent):
    ok = PassManager("snapshot{name=teacher},mtp-check{prompts=2,new_tokens=12}").run(parent.copy())
    rep = ok.reports["mtp-check"][0]
    assert rep["acceptance"] == rep["teacher_acceptance"] > 1.0

    @register("test-scramble-mtp")
    class Scramble(Pass):
        def run(self, prog, am):
            g = torch.Generator().manual_seed(0)
            for name in prog.weights.names():
                if name.startswith("mtp.") and name.endswith("proj.weight"):
                    t = prog.weights.get(name)
                    prog.weights.set(name, t[torch.randperm(t.shape[0], generator=g)])
            return Preserved.structure_only()

    with pytest.raises(PassError, match="acceptance length.*below the teacher"):
        PassManager("snapshot{name=teacher},test-scramble-mtp,mtp-check{prompts=2,new_tokens=12}").run(parent.copy())


def test_a_pass_that_drops_the_mtp_head_must_say_so(parent):
    @register("test-drop-mtp")
    class DropMTP(Pass):
        drop_mtp: bool = False

        def run(self, prog, am):
            prog.nodes = [n for n in prog.nodes if n.op.kind != "mtp"]
            prog.outputs = prog.outputs[:1]
            return Preserved.none()

    with pytest.raises(PassError, match="removed the MTP head.*drop_mtp=true"):
        PassManager("test-drop-mtp").run(parent.copy())
    prog = parent.copy()
    PassManager("test-drop-mtp{drop_mtp=true}").run(prog)
    assert not prog.find("mtp")


def test_head_only_recovery_trains_only_the_mtp_heads_own_weights(parent):
    child = _pruned(parent)
    before = {k: child.weights.get(k).clone() for k in child.weights.names()}
    distill(child, parent, Distill(steps=3, batch=2, seq=32, eval_windows=1, head_only=True, keep_best=False))
    changed = {k for k in before if not torch.equal(before[k], child.weights.get(k))}
    assert changed and all(k.startswith("mtp.") for k in changed), sorted(changed)[:5]


@pytest.fixture(scope="module")
def head_recovery(parent):
    """compress --quick's head-only stage (its own budget) on a child whose trunk was cut: the pruned program,
    the recovered one and the run's report."""
    from puzzlekit.tools.compress import QUICK

    prog = parent.copy()
    am = PassManager("snapshot{name=teacher},set-topk{k=1},drop-blocks{layers=[2]},snapshot{name=pruned},"
                     f"distill{{head_only=true,steps={QUICK['head_steps']},{QUICK['head']}}}").run(prog)
    return am.snapshots["pruned"], prog, am.reports["distill"][0]


def _draft_agreement(prog, windows) -> float:
    """How often the MTP head's top token is its own trunk's (the first draft's acceptance, teacher-forced)."""
    model = materialize(prog)
    model.eval()
    with torch.no_grad():
        logits, mtp = model(windows)
    return (logits[:, 1:].argmax(-1) == mtp[:, 1:].argmax(-1)).float().mean().item()


def test_compress_quick_head_recovery_keeps_trained_weights_that_draft_better_for_the_trunk(head_recovery, parent):
    from puzzlekit.text.data import corpus_for, held_out_windows

    pruned, recovered, report = head_recovery
    assert report["kept"] > 0 and report["best"]["step"] == report["kept"], report["evals"]  # not its start
    moved = [k for k in pruned.weights.names() if not torch.equal(pruned.weights.get(k), recovered.weights.get(k))]
    assert moved and all(k.startswith("mtp.") for k in moved)
    assert report["after"]["mtp_loss"] < 0.95 * report["before"]["mtp_loss"]
    assert report["after"]["mtp_self_kl"] < report["before"]["mtp_self_kl"]
    windows = held_out_windows(corpus_for(parent, None), "selection", 65, limit=8)
    assert _draft_agreement(recovered, windows) > _draft_agreement(pruned, windows)


def test_a_head_only_run_selects_on_its_heads_loss_not_the_trunk_kl(head_recovery):
    _, _, report = head_recovery
    assert report["selected_on"] == "mtp_loss" and report["mtp_weights"] == {"mtp_kl": 1.0, "mtp_self_kl": 1.0}
    seen = [report["before"], *report["evals"]]
    assert len({m["kl"] for m in seen}) == 1  # the trunk KL cannot move: selecting on it keeps the start
    for m in seen:
        assert m["mtp_loss"] == pytest.approx(m["mtp_kl"] + m["mtp_self_kl"])
    assert report["best"]["mtp_loss"] == min(m["mtp_loss"] for m in seen)


def test_the_reports_distillation_table_names_what_each_run_selected_on(head_recovery):
    from puzzlekit.tools.report import distillation_table

    _, _, head = head_recovery
    trunk = {**head, "selected_on": "kl", "mtp_weights": {}, "kept": 0, "terms": {"kl": 1.0, "mtp": 1.0}}
    rows = distillation_table([trunk, head]).splitlines()
    assert "| selected on | before | after | kept |" in rows[0]
    assert rows[2].startswith(f"| 1 | {head['steps']} | KL | {head['before']['kl']:.4g} | {head['after']['kl']:.4g} "
                              "| its start |")
    assert rows[3].startswith(f"| 2 | {head['steps']} | MTP loss (KL to the teacher's head + KL to its own trunk) | "
                              f"{head['before']['mtp_loss']:.4g} | {head['after']['mtp_loss']:.4g} | "
                              f"step {head['kept']} |")


def test_the_docs_hooks_example_runs():
    """The hooks example of docs/distillation.md is at most 20 lines and runs."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "distillation.md").read_text()
    code = re.search(r"<!-- hooks-example -->\s*```python\n(.*?)```", text, re.S).group(1)
    assert len(code.strip().splitlines()) <= 20
    from puzzlekit.passes import distill as d
    before = (dict(d.LOSSES), dict(d.DATA), dict(d.OPTIMIZERS), dict(d.CALLBACKS))
    try:
        exec(compile(code, "docs/distillation.md", "exec"), {})
    finally:
        for table, old in zip((d.LOSSES, d.DATA, d.OPTIMIZERS, d.CALLBACKS), before):
            table.clear()
            table.update(old)


def test_iterative_puzzle_moves_the_bound_in_rounds_and_rescores_from_the_current_model(small_library, tmp_path):
    """repeat{n=2}: round 1 meets the geometric midpoint of the parameter bound, round 2 the bound itself,
    choosing only shrinks of round 1's blocks, scored on the distilled round-1 model."""
    prog = ir.load(model_path(None))
    total = prog.param_counts()["total"]
    bound = 0.8 * total
    pipe = (f"snapshot{{name=teacher}},repeat{{n=2}}(puzzle{{library={small_library.path},max_params={bound},"
            f"parent=teacher}},distill{{{SMALL},state={tmp_path / 'state'}}})")
    am = PassManager(pipe).run(prog)
    first, second = am.reports["puzzle"]
    assert first["round"] == [1, 2] and second["round"] == [2, 2]
    assert first["limits"]["params"] == pytest.approx((first["parent"]["params"] * bound) ** 0.5, rel=1e-9)
    assert second["limits"]["params"] == pytest.approx(bound, rel=1e-9)
    assert first["params"] <= first["limits"]["params"] and prog.param_counts()["total"] <= bound
    assert not first["rescored"] and second["rescored"]
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == ["round1", "round2"]
    assert len(am.reports["distill"]) == 2
    ir.verify(prog)
    assert prog.find("mtp")


def test_every_option_of_a_later_round_is_sliced_from_the_current_block_to_its_spec(small_library, parent):
    """From a child that already took a shrink in every layer, each reachable variant's weights fit its spec
    (coupled axes included: dropping a KV group drops its query heads), and keeping the block keeps them."""
    from puzzlekit.passes.puzzle.bld import block_module
    from puzzlekit.passes.puzzle.importance import compute_importance
    from puzzlekit.passes.puzzle.rounds import candidate_weights, candidates
    from puzzlekit.passes.puzzle.search import realise

    lib = small_library
    first = {}
    for r in lib.rows:
        if r["steps"] and r["layer"] not in first:
            first[r["layer"]] = r
    child = realise(parent.copy(), lib, list(first.values()))
    ranks = compute_importance(child, torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0)))
    options = candidates(lib, child)
    assert {r["layer"] for r in options} == set(range(len(child.blocks())))
    for r in options:
        block_module(lib.spec(r), candidate_weights(lib, r, child, ranks["layers"]))  # strict load: shapes fit
        if r in first.values():
            node = child.blocks()[r["layer"]]
            kept = candidate_weights(lib, r, child, ranks["layers"])
            assert all(torch.equal(kept[k], v) for k, v in child.node_weights(node).items())
    assert not any(r["id"] == "parent" and r["layer"] in first for r in options)  # nothing grows back
