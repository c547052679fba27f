"""State that fits one node: bfloat16 parameters with AdamW in bfloat16 moments (stochastic rounding) or
torchao's 8-bit moments, FSDP2's CPU offload, the kept best weights in host memory or on disk, the teacher in
FP8 and what each costs in bytes per parameter. Oracles: torch.optim.AdamW in float32, two processes against
one, a resumed run against an uninterrupted one."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from puzzlekit import ir
from puzzlekit.backends.torch.device import Compute
from puzzlekit.passes import PassError, PassManager
from puzzlekit.passes.distill import Distill, Evaluator, distill
from puzzlekit.passes.distill.sharding import _build
from puzzlekit.tools.default_model import model_path
from puzzlekit.training import FileCheckpoint, Schedule, ShardedCheckpoint, StochasticAdamW, fit, state_bytes
from puzzlekit.training.optimizers import round_bf16

TINY = dict(steps=4, batch=4, seq=32, eval_every=2, eval_windows=2, warmup=1, lr=1e-3)
BF16 = Compute(dtype=torch.bfloat16)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def parent():
    return ir.load(model_path(None))


def _child(parent):
    prog = parent.copy()
    PassManager("drop-blocks{layers=[2]}").run(prog)
    return prog


# -- the optimizer against torch.optim.AdamW ---------------------------------------------------------------------
def _pair(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(37, 11, generator=g), torch.randn(300, generator=g)]


def test_adamw_bf16_with_float32_moments_is_torch_adamw_step_for_step():
    ref, ours = _pair(), _pair()
    groups = lambda ps: [{"params": [ps[0]], "weight_decay": 0.1}, {"params": [ps[1]], "weight_decay": 0.0}]
    a = torch.optim.AdamW(groups(ref), lr=1e-2, betas=(0.9, 0.95))
    b = StochasticAdamW(groups(ours), lr=1e-2, betas=(0.9, 0.95), moments=torch.float32, chunk=50)  # in chunks
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        for p, q in zip(ref, ours):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        a.step(), b.step()
    for p, q in zip(ref, ours):
        assert torch.equal(p, q)
    assert not torch.equal(ref[0], _pair()[0])


def test_bfloat16_moments_and_parameters_follow_float32_adamw_where_rounding_to_nearest_stalls():
    """An update of a tenth of a bfloat16 step: rounding to nearest never moves the weight, stochastic rounding
    moves it by the float32 amount on average (each element to one of its two neighbours)."""
    n, lr = 1 << 16, 2e-4  # 1.0's bfloat16 step is 2^-7; 10 steps of ~lr each
    ref = torch.ones(n)
    sr = torch.ones(n, dtype=torch.bfloat16)
    nearest = torch.ones(n, dtype=torch.bfloat16)
    opts = [torch.optim.AdamW([ref], lr=lr, weight_decay=0.0), StochasticAdamW([sr], lr=lr, weight_decay=0.0),
            torch.optim.AdamW([nearest], lr=lr, weight_decay=0.0)]
    for _ in range(10):
        for p, opt in zip((ref, sr, nearest), opts):
            p.grad = torch.ones_like(p)
            opt.step()
    want = ref[0].item()
    assert want == pytest.approx(1 - 10 * lr, rel=1e-5) and torch.all(ref == want)
    assert torch.all(nearest == 1.0)  # every update lost
    got = sr.float()
    assert got.min() < 1.0 and got.max() <= 1.0
    spread = 10 ** 0.5 * 2 ** -9 / n ** 0.5  # the mean's standard deviation at most (10 roundings of 2^-8 steps)
    assert abs(got.mean().item() - want) < 5 * spread


def test_stochastic_rounding_is_unbiased_and_the_same_however_the_tensor_is_split():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * 3
    whole = round_bf16(x, key=7)
    halves = torch.cat([round_bf16(x[:1000], key=7, first=0), round_bf16(x[1000:], key=7, first=1000)])
    assert torch.equal(whole, halves)  # a shard rounds as its part of the whole tensor
    assert not torch.equal(whole, round_bf16(x, key=8))  # another step or parameter: other noise
    assert torch.all((whole.float() - x).abs() <= x.abs() * 2 ** -7)  # one of its two bfloat16 neighbours
    ups = round_bf16(torch.full((1 << 14,), 1.0 + 2 ** -10), key=3).float()
    assert set(ups.unique().tolist()) == {1.0, 1.0 + 2 ** -7}
    assert ups.mean().item() == pytest.approx(1.0 + 2 ** -10, abs=2e-4)  # up an eighth of the time


# -- bytes per parameter -------------------------------------------------------------------------------------------
def _nbytes(t) -> int:
    if hasattr(t, "to_local"):
        t = t.to_local()
    if hasattr(t, "__tensor_flatten__"):  # torchao's 8-bit state: codes, scales, its 256-entry code map
        names, _ = t.__tensor_flatten__()
        return sum(_nbytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


@pytest.mark.parametrize("params,optimizer", [("fp32", "adamw"), ("bf16", "adamw-bf16"), ("fp32", "adamw-bf16"),
                                              ("bf16", "adamw-8bit")])
def test_state_bytes_is_what_a_step_leaves_in_memory(params, optimizer):
    if optimizer == "adamw-8bit":
        pytest.importorskip("torchao")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[params]
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024, bias=False).to(dtype)  # large enough for 8-bit blocks
    opt = Schedule(steps=1, lr=1e-3, algorithm=optimizer).optimizer(model)
    model(torch.randn(4, 1024, dtype=dtype)).float().square().mean().backward()
    opt.step()
    weight = model.weight
    held = _nbytes(weight) + _nbytes(weight.grad)
    moments = sum(_nbytes(v) for st in opt.state.values() for k, v in st.items() if k != "step")
    measured = (held + moments) / weight.numel()
    want = state_bytes(params, optimizer)
    assert measured == pytest.approx(want["device"], rel=0.01), (measured, want)
    assert want["host"] == {"fp32": 4, "bf16": 2}[params]  # the kept best copy
    off = state_bytes(params, optimizer, offload=True, shards=8)
    assert off["device"] == 0 and off["host"] == pytest.approx((want["device"] + want["host"]) / 8)
    assert state_bytes(params, optimizer, best="disk")["host"] == 0


def test_state_bytes_of_the_configurations_a_node_chooses_between():
    assert state_bytes() == {"device": 16.0, "host": 4.0}  # float32 AdamW, best weights on the host
    assert state_bytes("bf16", "adamw-bf16") == {"device": 8.0, "host": 2.0}
    assert state_bytes("bf16", "adamw-8bit")["device"] == pytest.approx(6.03125)
    assert state_bytes("fp32", "adamw-cosine", shards=8) == {"device": 2.0, "host": 0.5}
    with pytest.raises(ValueError, match="params in"):
        state_bytes("fp16")


# -- two processes against one, resumed against uninterrupted (FSDP2, gloo) ---------------------------------------
CONFIGS = (("adamw", torch.float32), ("adamw-bf16", torch.bfloat16), ("adamw-8bit", torch.float32),
           ("adamw-8bit", torch.bfloat16))


class _Crash:
    def __init__(self, at):
        self.at = at

    def on_step(self, step, parts):
        if step == self.at:
            raise KeyboardInterrupt  # after step - 1's checkpoint


def _mlp(dtype, world, offload=False):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64))
    for p in m.parameters():
        p.data = p.data.to(dtype)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        mesh = init_device_mesh("cpu", (world,))
        kw = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if offload else {}
        for sub in (m[0], m[2], m):
            fully_shard(sub, mesh=mesh, **kw)
    return m


def _train(algorithm, dtype, world, rank, state=None, crash=None, offload=False, seed=5):
    """6 steps of a 2-layer MLP on a global batch of 8 rows (each process its rows); FSDP2 over `world`
    processes; checkpointed every step (sharded with FSDP) and killed after step `crash` - 1."""
    m = _mlp(dtype, world, offload)
    gen = torch.Generator().manual_seed(0)

    def step_loss(step):
        x, y = torch.randn(8, 64, generator=gen), torch.randn(8, 64, generator=gen)
        rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
        loss = (m(x[rows].to(dtype)).float() - y[rows]).square().mean()
        return loss, {"loss": loss.item()}

    ck = None if state is None else ShardedCheckpoint(state) if world > 1 else FileCheckpoint(state)
    try:
        fit(m, step_loss, Schedule(steps=6, lr=3e-3, warmup=2, algorithm=algorithm, seed=seed), rng=gen,
            checkpoint=ck, every=1, identity={"algorithm": algorithm}, callbacks=[_Crash(crash)] if crash else [])
    except KeyboardInterrupt:
        return None
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).float() for k, v in m.state_dict().items()}


def _direct(world):
    """StochasticAdamW's steps from given whole gradients (no backward): a sharded step must round every
    element as the whole tensor's does."""
    m = _mlp(torch.bfloat16, world)
    opt = StochasticAdamW(m.parameters(), lr=1e-3, weight_decay=0.1, seed=3)
    g = torch.Generator().manual_seed(11)
    for _ in range(5):
        for p in m.parameters():
            whole = torch.randn(p.shape, generator=g).to(torch.bfloat16)
            if world > 1:
                from torch.distributed.tensor import distribute_tensor

                whole = distribute_tensor(whole, p.device_mesh, p.placements)
            p.grad = whole
        opt.step()
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).float() for k, v in m.state_dict().items()}


def _has_torchao() -> bool:
    try:
        import torchao.optim  # noqa: F401
    except ImportError:
        return False
    return True


def _results(out: Path, world: int, rank: int) -> dict:
    res = {"direct": _direct(world)}
    for algorithm, dtype in CONFIGS:
        if algorithm == "adamw-8bit" and not _has_torchao():  # optional: its tests skip
            continue
        name = f"{algorithm}:{dtype}"
        state = out / f"state-{algorithm}-{str(dtype)[6:]}-{world}"
        res[name] = _train(algorithm, dtype, world, rank)
        assert _train(algorithm, dtype, world, rank, state, crash=4) is None
        res[name + ":resumed"] = _train(algorithm, dtype, world, rank, state)
        if world == 1 and dtype == torch.bfloat16:  # the rounding noise's own spread: another seed
            res[name + ":reseeded"] = _train(algorithm, dtype, world, rank, seed=6)
    if world > 1:
        res["offload"] = _train("adamw-bf16", torch.bfloat16, world, rank, offload=True)
    return res


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """The runs of `_results` on 2 processes (torchrun: this file as a script) and on 1 (here)."""
    out = tmp_path_factory.mktemp("low-memory")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                        "29661", __file__, str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return torch.load(out / "results-2.pt", weights_only=True), _results(out, 1, 0)


def _rel(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).norm() / a[k].norm()).item() for k in a)


def test_a_sharded_stochastically_rounded_step_is_the_unsharded_step(sharded):
    two, one = sharded
    assert all(torch.equal(two["direct"][k], one["direct"][k]) for k in one["direct"])
    assert _rel(one["direct"], _mlp(torch.bfloat16, 1).state_dict()) > 1e-3  # it moved


@pytest.mark.parametrize("algorithm,dtype", CONFIGS)
def test_optimizer_state_resumes_exactly_sharded_and_unsharded(sharded, algorithm, dtype):
    if algorithm == "adamw-8bit":
        pytest.importorskip("torchao")
    for res in sharded:  # a FileCheckpoint on 1 process, a ShardedCheckpoint (DCP) on 2
        whole, resumed = res[f"{algorithm}:{dtype}"], res[f"{algorithm}:{dtype}:resumed"]
        assert all(torch.equal(whole[k], resumed[k]) for k in whole), algorithm


@pytest.mark.parametrize("algorithm,dtype", CONFIGS)
def test_two_processes_train_as_one_with_the_same_global_batch(sharded, algorithm, dtype):
    if algorithm == "adamw-8bit":
        pytest.importorskip("torchao")
    two, one = (r[f"{algorithm}:{dtype}"] for r in sharded)
    start = {k: v.float() for k, v in _mlp(dtype, 1).state_dict().items()}
    moved = {k: one[k] - start[k] for k in one}
    assert min(moved[k].norm() / start[k].norm() for k in one) > 0.05  # trained
    if dtype == torch.float32:  # float32 gradients, summed in another order
        assert _rel(one, two) < 1e-5
        return
    # bfloat16: half batches' gradients reduced in bfloat16 differ in their last bits, and the stochastic
    # rounding's noise is the yardstick: another seed moves the result this much
    spread = sharded[1][f"{algorithm}:{dtype}:reseeded"]
    for k in one:
        apart, noise = (one[k] - two[k]).norm(), (one[k] - spread[k]).norm()
        assert apart < 0.1 * moved[k].norm(), k
        # adamw-bf16's noise is the same however the tensor is sharded; torchao's is drawn per process
        assert apart < (0.5 if algorithm == "adamw-bf16" else 1.5) * noise, (k, apart / noise)


def test_cpu_offload_on_the_host_is_the_same_training(sharded):
    two, _ = sharded
    assert all(torch.equal(two["offload"][k], two["adamw-bf16:torch.bfloat16"][k]) for k in two["offload"])


# -- the distill pass: bfloat16 student, FP8 teacher, best weights -------------------------------------------------
def test_params_bf16_holds_the_blocks_in_bfloat16_and_distills_as_float32_does(parent):
    student = _build(_child(parent), BF16, None, train=True, checkpointing=False, params="bf16")
    dtypes = {name: p.dtype for name, p in student.named_parameters()}
    groups = [n.path + "." for n in student.program.blocks()] + ["mtp.layers.0.mixer.", "mtp.layers.1.mixer."]
    low = {k for k in dtypes if k.startswith(tuple(groups))}
    assert low and all(dtypes[k] == torch.bfloat16 for k in low)  # the blocks FSDP shards as groups
    assert {dtypes[k] for k in dtypes.keys() - low} == {torch.float32}  # embedding, heads, norms, MTP fusion
    assert "backbone.embeddings.weight" not in low and "mtp.layers.0.eh_proj.weight" not in low
    fp32 = distill(_child(parent), parent, Distill(**TINY, keep_best=False), compute=BF16)
    bf16 = distill(_child(parent), parent, Distill(**TINY, keep_best=False, params="bf16", optimizer="adamw-bf16"),
                   compute=BF16)
    assert bf16["after"]["kl"] < 0.85 * bf16["before"]["kl"]
    assert bf16["after"]["kl"] == pytest.approx(fp32["after"]["kl"], rel=0.05)


def test_the_fp8_teacher_is_the_dequantised_teacher_in_half_the_bytes(parent):
    from puzzlekit.ir.quant.formats import quantize_fp8

    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    full = _build(parent, BF16, None, train=False, checkpointing=False)
    fp8 = _build(parent, BF16, None, train=False, checkpointing=False, teacher_dtype="fp8")
    size = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())
    assert size(fp8) < 0.6 * size(full)
    # the oracle: the teacher whose weights are quantised and dequantised outside, in float32
    ref = _build(parent, Compute(), None, train=False, checkpointing=False)
    with torch.no_grad():
        got = _build(parent, Compute(), None, train=False, checkpointing=False, teacher_dtype="fp8")(ids)[0]
        for name, m in ref.named_modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Conv1d)):
                m.weight.copy_(quantize_fp8(m.weight).dequantize())
            if type(m).__name__ == "RoutedExperts":
                for side in ("up_proj", "down_proj"):
                    w = getattr(m, side)
                    w.copy_(quantize_fp8(w, axis=0).dequantize())
        want = ref(ids)[0]
        base = _build(parent, Compute(), None, train=False, checkpointing=False)(ids)[0]
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert (got - base).abs().max() > 1e-3  # FP8 is not the float32 teacher


# -- kept best weights --------------------------------------------------------------------------------------------
class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)


def _keeper(best, state_dir=None):
    torch.manual_seed(0)
    model = _Tiny()
    return model, Evaluator(model, None, torch.zeros(1, 2, dtype=torch.long), 1, "kl", [], best=best,
                            state_dir=state_dir)


@pytest.mark.parametrize("best", ["host", "disk"])
def test_the_best_weights_are_copies_off_the_device_that_come_back(best, tmp_path):
    model, ev = _keeper(best, tmp_path)
    first = {k: v.clone() for k, v in model.state_dict().items()}
    ev.keep({"step": 2, "kl": 1.0})
    with torch.no_grad():
        model.lin.weight.add_(1.0)  # training goes on
    ev.keep({"step": 4, "kl": 2.0})  # worse: not kept
    if best == "host":
        assert all(t.device.type == "cpu" for t in ev.best_weights.values())
        assert ev.best_weights["lin.weight"].data_ptr() != model.lin.weight.data_ptr()
    else:
        assert ev.best_weights is None and ev.best_file == "best-step2.dcp" and (tmp_path / ev.best_file).is_dir()
    ev.restore_best()
    assert all(torch.equal(first[k], v) for k, v in model.state_dict().items())


def test_best_on_disk_keeps_what_the_checkpoints_name_and_moves_between_modes(tmp_path):
    model, ev = _keeper("disk", tmp_path)
    ev.keep({"step": 2, "kl": 1.0})
    first = ev.state_dict()  # a checkpoint names best-step2
    with torch.no_grad():
        model.lin.weight.mul_(2)
    ev.keep({"step": 4, "kl": 0.5})
    ev.keep({"step": 6, "kl": 0.4})
    names = lambda: sorted(p.name for p in tmp_path.glob("best-step*.dcp"))
    assert names() == ["best-step2.dcp", "best-step4.dcp", "best-step6.dcp"]
    ev.state_dict()  # the next checkpoint names step 6; the one before it step 2: step 4 goes
    assert names() == ["best-step2.dcp", "best-step6.dcp"]
    # a run resumed from the first checkpoint gets step 2's weights, held the way it keeps them
    for mode in ("host", "disk"):
        other, back = _keeper(mode, tmp_path)
        with torch.no_grad():
            other.lin.weight.zero_()
        back.load_state_dict(first)
        back.restore_best()
        assert torch.equal(other.lin.weight, _keeper("host")[0].lin.weight)  # the start: step 2's
    _, host = _keeper("host")
    host.keep({"step": 2, "kl": 1.0})
    disk_model, disk = _keeper("disk", tmp_path / "fresh")
    disk.load_state_dict(host.state_dict())  # a best=host checkpoint resumed with best=disk: written out
    assert disk.best_weights is None and (tmp_path / "fresh" / "best-step2.dcp").is_dir()
    with torch.no_grad():
        disk_model.lin.weight.zero_()
    disk.restore_best()
    assert torch.equal(disk_model.lin.weight, host.best_weights["lin.weight"])


# -- the distill pass under torchrun (slow: five CLI runs) --------------------------------------------------------
PLUGIN = '''
import json, os
from puzzlekit.passes import distill as d

_distill = d.distill

def distill(*args, **kw):
    report = _distill(*args, **kw)
    with open(os.path.join(os.environ["PROBE_DIR"], f"report-{os.environ.get('RANK', '0')}.json"), "w") as f:
        json.dump({k: report[k] for k in ("steps", "resumed_from", "evals", "best", "kept", "before", "after")}, f)
    return report

d.distill = distill

@d.register_callback("test-crash")
class Crash:
    def __init__(self, settings):
        pass

    def on_step(self, step, parts):
        if os.environ.get("CRASH_AT") == str(step):
            os._exit(17)
'''


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """shard=fsdp distillations of a pruned child: bf16 parameters with adamw-bf16 on 2 processes (plain;
    with offload and best=disk killed at step 3 and resumed; on 1 process), and adamw-8bit with the FP8
    teacher on 2."""
    root = tmp_path_factory.mktemp("low-memory-cli")
    (root / "lm_probe.py").write_text(PLUGIN)
    base = dict(shard="fsdp", **TINY, checkpoint_every=2, callbacks="[test-crash]")

    def cli(name, nproc, port, crash=None, **extra):
        probe = root / name
        probe.mkdir()
        opts = ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in {**base, **extra}.items())
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root), "PROBE_DIR": str(probe)}
        env.pop("CRASH_AT", None)
        if crash:
            env["CRASH_AT"] = str(crash)
        launch = ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(port)] \
            if nproc > 1 else []
        p = subprocess.run([sys.executable, *launch, "-m", "puzzlekit.tools", "run", "--plugin", "lm_probe", "-p",
                            f"snapshot{{name=teacher}},drop-blocks{{layers=[2]}},distill{{{opts}}}", "-o",
                            str(probe / "out"), "--extended", "--dtype", "bfloat16"],
                           capture_output=True, text=True, env=env, timeout=300)
        assert (p.returncode != 0) == bool(crash), p.stderr[-3000:]
        return probe

    bf16 = dict(params="bf16", optimizer="adamw-bf16")
    state = root / "state"
    out = {"plain": cli("plain", 2, 29671, **bf16),
           "killed": cli("killed", 2, 29672, crash=3, **bf16, offload=True, best="disk", state=state)}
    out["killed_files"] = sorted(p.name for p in state.iterdir())
    out["resumed"] = cli("resumed", 2, 29673, **bf16, offload=True, best="disk", state=state)
    out["one"] = cli("one", 1, 0, **bf16)
    if _has_torchao():
        out["8bit"] = cli("8bit", 2, 29674, optimizer="adamw-8bit", teacher_dtype="fp8")
    return out


def _weights(probe: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(probe / "out" / "model.safetensors"))


def _report(probe: Path) -> dict:
    import json

    return json.loads((probe / "report-0.json").read_text())


@pytest.mark.slow
def test_a_killed_offloaded_bf16_distillation_resumes_to_the_plain_runs_weights(cli_runs):
    files = cli_runs["killed_files"]  # the checkpoint of step 2 and the best weights it names, on disk
    assert "distill_state.dcp" in files and len([f for f in files if f.startswith("best-step")]) == 1, files
    plain, resumed = _report(cli_runs["plain"]), _report(cli_runs["resumed"])
    assert resumed["resumed_from"] == 2 and resumed["steps"] == 4
    assert [e["kl"] for e in resumed["evals"]] == [e["kl"] for e in plain["evals"]]
    assert resumed["kept"] == plain["kept"] and resumed["after"]["kl"] == plain["after"]["kl"]
    a, b = _weights(cli_runs["plain"]), _weights(cli_runs["resumed"])
    assert all(torch.equal(a[k], b[k]) for k in a)  # offload and best=disk change no number; resume is exact
    start = _weights_of_child()
    assert sum(not torch.equal(a[k], start[k]) for k in a) > 10


def _weights_of_child() -> dict:
    prog = ir.load(model_path(None))
    PassManager("drop-blocks{layers=[2]}").run(prog)
    return {k: prog.weights.get(k) for k in prog.weights.names()}


@pytest.mark.slow
def test_bf16_distillation_on_two_processes_is_one_process_within_bfloat16_rounding(cli_runs):
    one, two = _report(cli_runs["one"]), _report(cli_runs["plain"])
    assert [e["kl"] for e in two["evals"]] == pytest.approx([e["kl"] for e in one["evals"]], rel=0.02)
    assert two["after"]["kl"] == pytest.approx(one["after"]["kl"], rel=0.01)
    # half batches' bfloat16 gradients differ in their last bits, and a stochastically rounded weight near a
    # rounding threshold goes the other way: the weights agree to a small part of what training moved them
    a, b, start = _weights(cli_runs["one"]), _weights(cli_runs["plain"]), _weights_of_child()
    apart = sum((a[k].double() - b[k].double()).square().sum() for k in a).sqrt()
    moved = sum((a[k].double() - start[k].double()).square().sum() for k in a).sqrt()
    assert apart < 0.1 * moved, (apart, moved)


@pytest.mark.slow
def test_adamw_8bit_with_the_fp8_teacher_distills_on_two_processes(cli_runs):
    pytest.importorskip("torchao")
    report = _report(cli_runs["8bit"])  # (its KL is to the FP8 teacher it learns from)
    assert report["steps"] == 4 and report["after"]["kl"] < 0.85 * report["before"]["kl"]


# -- settings that cannot work --------------------------------------------------------------------------------------
def test_state_settings_that_cannot_work_are_refused_with_the_fix(parent, monkeypatch):
    cases = ((dict(params="fp16"), r"params='fp16' is not one of fp32, bf16"),
             (dict(params="bf16"), r"params=bf16 with optimizer=adamw-cosine.*adamw-bf16 or adamw-8bit"),
             (dict(params="bf16", optimizer="adamw-bf16", dtype="float16"), r"float16 forward.*dtype=bfloat16"),
             (dict(offload=True), r"offload=true.*set shard=fsdp"),
             (dict(best="gpu"), r"best='gpu' is not one of host, disk"),
             (dict(teacher_dtype="int4"), r"teacher_dtype='int4' is not one of auto, fp8"),
             (dict(teacher_dtype="fp8", teacher_logits="x"), r"teacher_dtype=fp8.*teacher_logits"))
    for extra, match in cases:
        with pytest.raises(PassError, match=match):
            Distill(**TINY, **extra)
    with pytest.raises(PassError, match=r"params=bf16 holds the blocks' weights in bfloat16, which a float32 "
                                        r"forward cannot use; run with --dtype bfloat16"):
        distill(_child(parent), parent, Distill(**TINY, params="bf16", optimizer="adamw-bf16"))
    with pytest.raises(PassError, match=r"best=disk keeps the best weights in the run's state directory; set state"):
        distill(_child(parent), parent, Distill(**TINY, best="disk"))
    monkeypatch.setitem(sys.modules, "torchao", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "torchao.optim", None)
    with pytest.raises(PassError, match=r"optimizer=adamw-8bit is torchao's AdamW8bit.*pip install torchao"):
        distill(_child(parent), parent, Distill(**TINY, optimizer="adamw-8bit"))


if __name__ == "__main__":  # one torchrun process of the `sharded` fixture
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results = _results(Path(sys.argv[1]), dist.get_world_size(), dist.get_rank())
    if dist.get_rank() == 0:
        torch.save(results, Path(sys.argv[1]) / f"results-{dist.get_world_size()}.pt")
    dist.destroy_process_group()
