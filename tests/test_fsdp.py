"""Scaling distillation up: FSDP2 sharding under torchrun (2 processes match 1), sharded checkpoints that
resume on another number of processes, gradient accumulation, activation checkpointing and stored top-k
teacher logits, on the built-in model with tiny budgets."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from puzzlekit import ir
from puzzlekit.backends.torch import materialize
from puzzlekit.passes import PassError, PassManager
from puzzlekit.passes import distill as distill_module
from puzzlekit.passes.distill import (CALLBACKS, LOSSES, OPTIMIZERS, Distill, TeacherStore, checkpoint_blocks,
                                      distill, register_callback, register_loss, register_optimizer, soft_kl,
                                      topk_kl)
from puzzlekit.tools.default_model import model_path
from puzzlekit.training import Schedule, ShardedCheckpoint, TrainingError, fit

CHILD = "drop-blocks{layers=[2]}"  # a child to recover
TINY = dict(steps=4, batch=4, seq=32, eval_every=2, eval_windows=2, warmup=1, lr=1e-3)

# A plugin for the CLI runs: reports what sharding did and the pass's report, and a callback that kills the
# process (no cleanup, like a crash) at the step CRASH_AT, after the checkpoint of the step before.
PLUGIN = '''
import json, os
from puzzlekit.passes import distill as d
from puzzlekit.passes.distill import sharding

_shard, _distill = sharding.shard_model, d.distill

def _probe(name):
    return os.path.join(os.environ["PROBE_DIR"], f"{name}-{os.environ.get('RANK', '0')}.json")

def shard_model(model, mesh):
    _shard(model, mesh)
    if any(p.requires_grad for p in model.parameters()):  # the student
        with open(_probe("probe"), "w") as f:
            json.dump({"local": sum(p.to_local().numel() for p in model.parameters()),
                       "total": sum(p.numel() for p in model.parameters()),
                       "types": sorted({type(p).__name__ for p in model.parameters()})}, f)

def distill(*args, **kw):
    report = _distill(*args, **kw)
    with open(_probe("report"), "w") as f:
        json.dump({k: report[k] for k in ("steps", "resumed_from", "evals", "best", "log", "after", "shard")}, f)
    return report

sharding.shard_model, d.distill = shard_model, distill

@d.register_callback("test-crash")
class Crash:
    def __init__(self, settings):
        pass

    def on_step(self, step, parts):
        if os.environ.get("CRASH_AT") == str(step):
            os._exit(17)
'''


def _options(**kw) -> str:
    return ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in kw.items())


@pytest.fixture(scope="module")
def parent():
    return ir.load(model_path(None))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread, like the torchrun processes (OMP_NUM_THREADS=1): on 2 shared cores two
    spinning thread pools slow each other down many times over."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _child(parent):
    prog = parent.copy()
    PassManager(CHILD).run(prog)
    return prog


def _weights(prog) -> dict:
    return {k: prog.weights.get(k).clone() for k in prog.weights.names()}


def _close(a: dict, b: dict, rel: float) -> None:
    """Every tensor of `b` within `rel` of `a`'s (relative Frobenius norm)."""
    assert a.keys() == b.keys()
    for k in a:
        err = (a[k].double() - b[k].double()).norm().item()
        assert err <= rel * a[k].double().norm().item() + 1e-12, (k, err / max(a[k].double().norm().item(), 1e-30))


def _moved(a: dict, start: dict) -> int:
    return sum(1 for k in a if a[k].shape == start[k].shape and not torch.equal(a[k], start[k]))


# -- multi-process: FSDP 2 ranks vs 1, a sharded checkpoint written by 2 resumed by 1 --------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Four CLI runs of the same distillation (shard=fsdp): 1 process from scratch; 2 processes (with
    activation checkpointing and 2 micro-batches, which must not change the result); 2 processes killed at
    step 3 (checkpoint of step 2 on disk); 1 process resuming that checkpoint. The one-process runs are this
    process's (one thread, as in the torchrun processes), with the plugin's patches undone after each."""
    root = tmp_path_factory.mktemp("fsdp")
    (root / "fsdp_probe.py").write_text(PLUGIN)
    opts = dict(shard="fsdp", **TINY, checkpoint_every=2, callbacks="[test-crash]")

    def cli(name, nproc, port=0, crash=None, **extra):
        probe = root / name
        probe.mkdir()
        pipe = f"snapshot{{name=teacher}},{CHILD},distill{{{_options(**opts, **extra)}}}"
        argv = ["run", "--plugin", str(root / "fsdp_probe.py"), "-p", pipe, "-o", str(probe / "out"),
                "--extended"]  # (a noop block: extended form)
        if nproc == 1:
            return _in_process(argv, probe), probe
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PROBE_DIR": str(probe)}
        env.pop("CRASH_AT", None)
        if crash:
            env["CRASH_AT"] = str(crash)
        launch = ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(port)]
        p = subprocess.run([sys.executable, *launch, "-m", "puzzlekit.tools", *argv],
                           capture_output=True, text=True, env=env, timeout=300)
        return p, probe

    out = {"root": root}
    for name, nproc, port, crash, extra in (
            ("one", 1, 0, None, {"state": root / "s-one"}),
            ("two", 2, 29641, None, {"checkpointing": True, "accumulate": 2}),
            ("killed", 2, 29642, 3, {"state": root / "s-resume"}),
            ("resumed", 1, 0, None, {"state": root / "s-resume"})):
        p, probe = cli(name, nproc, port, crash, **extra)
        if crash:
            assert p.returncode != 0, "the run was not killed"
            saved = root / "s-resume" / "distill_state.dcp"
            out["killed_checkpoint"] = (torch.load(saved / "puzzlekit_state.pt", weights_only=True)["step"],
                                        sorted(f.name for f in saved.iterdir()),
                                        sorted(f.name for f in saved.parent.iterdir()))
        else:
            assert p.returncode == 0, p.stderr[-3000:]
        out[name] = probe
    return out


def _in_process(argv: list[str], probe: Path) -> subprocess.CompletedProcess:
    """`puzzlekit <argv>` in this process: its exit code and stderr as a process's."""
    import contextlib
    import io

    from puzzlekit.passes.distill import sharding
    from puzzlekit.tools.cli import main

    err = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PROBE_DIR", str(probe))
        for var in ("CRASH_AT", "RANK"):
            mp.delenv(var, raising=False)
        mp.setattr(sharding, "shard_model", sharding.shard_model)  # restored when the plugin has patched them
        mp.setattr(distill_module, "distill", distill_module.distill)
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                code = main(argv)
        finally:
            CALLBACKS.pop("test-crash", None)
            sys.modules.pop("puzzlekit_plugin_fsdp_probe", None)
    return subprocess.CompletedProcess(argv, code, "", err.getvalue())


def _report(probe: Path) -> dict:
    return json.loads((probe / "report-0.json").read_text())


def test_fsdp_on_two_processes_matches_one_process(runs):
    probes = [json.loads((runs["two"] / f"probe-{r}.json").read_text()) for r in (0, 1)]
    for p in probes:  # each process holds half of the student (plus padding), as DTensor shards
        assert p["types"] == ["DTensor"] and p["local"] < 0.6 * p["total"], p
    assert not (runs["one"] / "probe-0.json").exists()  # one process: unsharded, through the same loop
    one, two = _report(runs["one"]), _report(runs["two"])
    assert one["shard"] == two["shard"] == "fsdp" and len(two["log"]) == 4  # (each rank logs its own half)
    for k in ("kl", "mtp_kl"):  # the held-out evaluation after step 2 and step 4
        assert [e[k] for e in two["evals"]] == pytest.approx([e[k] for e in one["evals"]], rel=1e-4)
    a = load_file(str(runs["one"] / "out" / "model.safetensors"))
    b = load_file(str(runs["two"] / "out" / "model.safetensors"))
    start = load_file(str(model_path(None) / "model.safetensors"))
    _close(a, b, 1e-4)
    assert _moved(a, start) > 10  # trained (not two untouched models compared)


def test_a_sharded_checkpoint_of_two_processes_resumes_on_one(runs, parent):
    step, files, beside = runs["killed_checkpoint"]  # what the killed 2-process run left
    assert step == 2 and beside == ["distill_state.dcp"]  # complete, no temporary or old copy left over
    assert "puzzlekit_state.pt" in files and sum(f.endswith(".distcp") for f in files) == 2  # both ranks' shards
    one, resumed = _report(runs["one"]), _report(runs["resumed"])
    assert resumed["resumed_from"] == 2 and resumed["steps"] == 4 and len(resumed["log"]) == 2
    assert [e["step"] for e in resumed["evals"]] == [2, 4]  # the 2-process evaluation came along
    assert [e["kl"] for e in resumed["evals"]] == pytest.approx([e["kl"] for e in one["evals"]], rel=1e-5)
    # the same best evaluation (step 2's is kept as sharded state by the 2 processes): its weights are the result
    assert one["best"]["step"] == resumed["best"]["step"] in (2, 4)
    a = load_file(str(runs["one"] / "out" / "model.safetensors"))
    b = load_file(str(runs["resumed"] / "out" / "model.safetensors"))
    _close(a, b, 1e-5)
    assert _moved(a, load_file(str(model_path(None) / "model.safetensors"))) > 10

    @register_callback("test-crash")
    class NoCrash:
        def __init__(self, settings):
            pass

    try:  # the same checkpoint with another learning rate is refused, not silently mixed
        state = runs["root"] / "s-resume"
        d = Distill(shard="fsdp", **{**TINY, "lr": 2e-3}, checkpoint_every=2, callbacks=["test-crash"],
                    state=str(state))
        with pytest.raises(TrainingError, match="written with other settings"):
            distill(_child(parent), parent, d, state_dir=state)
    finally:
        CALLBACKS.pop("test-crash")


class _Keeper:
    """A callback with tensors in its state (as the evaluator's best weights)."""

    def __init__(self, model, crash_at=None):
        self.model, self.kept, self.crash_at = model, None, crash_at

    def on_step(self, step, parts):
        if step == self.crash_at:
            raise KeyboardInterrupt  # after step - 1's checkpoint
        self.kept = {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def state_dict(self):
        return {"kept": self.kept, "note": "not a tensor"}

    def load_state_dict(self, st):
        assert st["note"] == "not a tensor"
        self.kept = st["kept"]


def _tiny_fit(ck: ShardedCheckpoint | None, micro: int = 1, crash_at=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    gen = torch.Generator().manual_seed(0)
    batch = {}

    def step_loss(step, k=0):
        if k == 0:
            batch["x"] = torch.randn(4, 4, generator=gen)
        x = batch["x"][k * 4 // micro:(k + 1) * 4 // micro]
        loss = model(x).square().mean() / micro
        return loss, {"loss": loss.item()}

    keeper = _Keeper(model, crash_at)
    run = fit(model, step_loss, Schedule(steps=5, lr=1e-2, warmup=1), rng=gen, checkpoint=ck, every=1,
              identity={"what": "tiny"}, callbacks=[keeper], micro=micro)
    return run, model, keeper


def test_a_sharded_checkpoint_survives_a_kill_between_its_renames(tmp_path):
    _, whole, _ = _tiny_fit(None)
    ck = ShardedCheckpoint(tmp_path / "state.dcp")
    with pytest.raises(KeyboardInterrupt):
        _tiny_fit(ck, crash_at=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.dcp"]
    # killed while replacing step 3's checkpoint: the complete one moved aside, a new one half-written
    os.replace(ck.path, ck.old)
    ck.tmp.mkdir()
    (ck.tmp / "__0_0.distcp").write_bytes(b"partial")
    run, model, keeper = _tiny_fit(ck)
    assert run.resumed_from == 3 and run.step == 5
    assert all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(), model.state_dict().values()))
    assert torch.equal(keeper.kept["2.weight"], model.state_dict()["2.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.dcp"]  # the temporary and old copies are gone
    _, two, _ = _tiny_fit(None, micro=2)  # fit's accumulation: two halves, each half the loss
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(whole.state_dict().values(),
                                                                          two.state_dict().values()))


# -- one process: accumulation, activation checkpointing --------------------------------------------------------------
class _SGD:
    """Plain SGD without clipping: the update is linear in the gradient, so a mis-scaled micro-batch shows."""

    def __init__(self, d):
        self.steps, self.clip, self.lr = d.steps, 0.0, d.lr

    def lr_at(self, step):
        return self.lr

    def optimizer(self, model):
        return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=self.lr)


def test_two_micro_batches_make_the_step_one_batch_makes(parent):
    register_optimizer("test-sgd")(_SGD)
    rows = []

    @register_loss("test-rows")
    def count_rows(b):
        rows.append(b.ids.shape[0])
        return b.student.logits.sum() * 0.0

    try:
        got = {}
        for n in (1, 2):
            child = _child(parent)
            d = Distill(**{**TINY, "lr": 0.5}, keep_best=False, optimizer="test-sgd", accumulate=n,
                        loss=["test-rows"])
            got[n] = (distill(child, parent, d)["log"], _weights(child))
        assert rows == [4] * 4 + [2] * 8  # each step: one batch of 4 rows, then two micro-batches of 2
        for a, b in zip(got[1][0], got[2][0]):  # the step's losses are the sum of the micro-batches' shares
            for k in ("kl", "cos", "mtp"):
                assert b[k] == pytest.approx(a[k], rel=1e-5)
        _close(got[1][1], got[2][1], 3e-5)  # float32 sums in another order: batched expert products follow the batch
        assert _moved(got[1][1], _weights(_child(parent))) > 10
    finally:
        OPTIMIZERS.pop("test-sgd"), LOSSES.pop("test-rows")


def test_activation_checkpointing_recomputes_blocks_and_changes_no_number(parent):
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    grads, calls = {}, {}
    for on in (False, True):
        m = materialize(parent, dtype=torch.float32)
        for p in m.parameters():
            p.data = p.data.clone()
        m.train()
        if on:
            checkpoint_blocks(m)
        count = [0]

        def called(*args, count=count):
            count[0] += 1

        m.get_submodule("backbone.layers.1.mixer").register_forward_pre_hook(called)
        logits, mtp = m(ids)
        (logits.float().square().mean() + mtp.float().square().mean()).backward()
        grads[on] = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        calls[on] = count[0]
    assert calls == {False: 1, True: 2}  # the block ran again in the backward
    assert grads[False].keys() == grads[True].keys()
    assert all(torch.equal(grads[False][k], grads[True][k]) for k in grads[False])
    # and a whole distillation run ends on the same weights
    final = {}
    for on in (False, True):
        child = _child(parent)
        distill(child, parent, Distill(**{**TINY, "steps": 3}, keep_best=False, checkpointing=on))
        final[on] = _weights(child)
    assert all(torch.equal(final[False][k], final[True][k]) for k in final[False])
    assert _moved(final[False], _weights(_child(parent))) > 10


# -- stored teacher logits ---------------------------------------------------------------------------------------------
def test_topk_kl_is_the_full_kl_at_k_equal_to_the_vocabulary():
    g = torch.Generator().manual_seed(0)
    t, s = torch.randn(3, 5, 256, generator=g) * 3, torch.randn(3, 5, 256, generator=g) * 3
    for temperature in (1.0, 2.0):
        values, indices = torch.log_softmax(t, -1).topk(256, dim=-1)
        full = soft_kl(t, s, temperature).item()
        assert topk_kl(values, indices, s, temperature).item() == pytest.approx(full, rel=1e-5)
        v8, i8 = torch.log_softmax(t, -1).topk(8, dim=-1)
        approx = topk_kl(v8, i8, s, temperature).item()
        assert approx >= 0 and approx != pytest.approx(full, rel=1e-3)  # a real approximation below k = vocab


def test_stored_teacher_logits_train_like_the_live_teacher_and_are_computed_once(parent, tmp_path, monkeypatch):
    kl_only = dict(**TINY, cos=0.0, mtp=0.0)
    live_child = _child(parent)
    live = distill(live_child, parent, Distill(**kl_only))
    store = tmp_path / "logits"
    # one step per file (as a long run has many): a file lost to a kill is written again, the others are kept
    monkeypatch.setattr(distill_module.teacher_store, "CHUNK_BYTES", TINY["batch"] * TINY["seq"] * 256 * 8)
    stored_child = _child(parent)
    stored = distill(stored_child, parent, Distill(**kl_only, teacher_logits=str(store), topk=256))
    files = sorted(p.name for p in store.iterdir())
    assert files == ["eval.safetensors", "meta.json"] + [TeacherStore.chunk_name(s, s + 1) for s in range(4)]
    assert json.loads((store / "meta.json").read_text())["topk"] == 256
    for a, b in zip(live["log"], stored["log"]):
        assert b["kl"] == pytest.approx(a["kl"], rel=1e-5)
    assert [e["kl"] for e in stored["evals"]] == pytest.approx([e["kl"] for e in live["evals"]], rel=1e-5)
    assert [e["top1_agreement"] for e in stored["evals"]] == [e["top1_agreement"] for e in live["evals"]]
    assert stored["teacher_bits_per_byte"] == pytest.approx(live["teacher_bits_per_byte"], rel=1e-5)
    a, b = _weights(live_child), _weights(stored_child)
    _close(a, b, 1e-5)
    assert _moved(a, _weights(_child(parent))) > 10

    stamps = {p.name: p.stat().st_mtime_ns for p in store.iterdir()}
    lost = TeacherStore.chunk_name(1, 2)
    (store / lost).unlink()
    again_child = _child(parent)
    distill(again_child, parent, Distill(**kl_only, teacher_logits=str(store), topk=256))
    now = {p.name: p.stat().st_mtime_ns for p in store.iterdir()}
    assert now.keys() == stamps.keys()
    assert {k for k in now if now[k] != stamps[k]} == {lost}  # reused, only the missing file written
    assert all(torch.equal(b[k], again_child.weights.get(k)) for k in b)

    with pytest.raises(PassError, match=r"teacher_logits=.*other settings \(seed 0 there, 1 here\)"):
        distill(_child(parent), parent, Distill(**{**kl_only, "seed": 1}, teacher_logits=str(store), topk=256))
    with pytest.raises(PassError, match=r"teacher_logits=.*of another teacher"):
        distill(_child(parent), _child(parent), Distill(**kl_only, teacher_logits=str(store), topk=256))
    assert {p.name: p.stat().st_mtime_ns for p in store.iterdir()} == now


def test_settings_that_cannot_work_are_refused_before_any_work(parent, tmp_path):
    with pytest.raises(PassError, match="shard='zero3' is not one of auto, ddp, fsdp"):
        PassManager("snapshot{name=teacher},distill{shard=zero3}").run(parent.copy())
    cases = ((dict(teacher_logits=str(tmp_path / "t")), r"cos term needs its hidden states; set cos=0"),
             (dict(teacher_logits=str(tmp_path / "t"), cos=0.0), r"mtp term needs its MTP-head logits; set mtp=0"),
             (dict(head_only=True, teacher_logits=str(tmp_path / "t")), r"set mtp=0"),
             (dict(accumulate=8), r"accumulate=8 micro-batches need a row each.*4 rows per process"))
    for extra, match in cases:
        with pytest.raises(PassError, match=match):
            distill(_child(parent), parent, Distill(**{**TINY, **extra}))
    assert not (tmp_path / "t").exists()
    state = tmp_path / "state"
    state.mkdir()
    (state / "distill_state.pt").write_bytes(b"")  # a DDP run's checkpoint is not resumed as a sharded one
    with pytest.raises(PassError, match="holds a ddp run's checkpoint.*shard=ddp"):
        distill(_child(parent), parent, Distill(**TINY, shard="fsdp"), state_dir=state)
