"""The CUDA paths, checked on CPU where a CPU can show them: device placement and the torchrun device
rule (CUDA's presence monkeypatched), TF32 left alone except where a forward asks for it, float16's loss
scaler, the process group's timeout, FSDP2's mixed precision and the teacher held in the compute dtype,
pinned host copies of streamed activations. The tests marked `cuda` run the same paths on a GPU
(`benchmarks/gpu_check.py` runs this file there)."""
from __future__ import annotations

import datetime
import warnings

import pytest
import torch

from puzzlekit.backends.torch import ProgramModule, materialize
from puzzlekit.backends.torch import stream
from puzzlekit.backends.torch.device import Compute, DeviceError, resolve
from puzzlekit.errors import UsageError
from puzzlekit.tools.default_model import load_default
from puzzlekit.training import Schedule, fit

BF16 = Compute(torch.device("cpu"), torch.bfloat16)
CUDA0 = torch.device("cuda", 0)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def parent():
    return load_default()


@pytest.fixture
def tf32_flags():
    """The process-wide TF32 flags, restored after the test whatever it did to them."""
    flags = torch.backends.cuda.matmul, torch.backends.cudnn
    before = [f.allow_tf32 for f in flags]
    yield lambda: [f.allow_tf32 for f in flags]
    for f, b in zip(flags, before):
        f.allow_tf32 = b


@pytest.fixture
def gpus(monkeypatch):
    """A machine with `n` CUDA devices as resolve sees it, as the rank `local` of a torchrun of `world`."""
    def set_up(n: int = 2, local: int | None = None, world: int = 1):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        for key, value in (("LOCAL_RANK", local), ("WORLD_SIZE", world if local is not None else None)):
            if value is None:
                monkeypatch.delenv(key, raising=False)
            else:
                monkeypatch.setenv(key, str(value))
    return set_up


# -- BLD's linear replacement -----------------------------------------------------------------------------------------
def test_the_linear_fit_runs_beside_the_activations_on_any_device():
    """Activations on another device than the CPU (meta here, CUDA in a library build) are normalised there."""
    from puzzlekit.passes.puzzle.bld import linear_fit

    x, d = torch.randn(2, 8, 16, device="meta"), torch.randn(2, 8, 16, device="meta")
    w = linear_fit(torch.ones(16), 1e-5, x, d)
    assert w.device.type == "meta" and w.shape == (16, 16) and w.dtype == torch.float32


@cuda
def test_the_linear_fit_on_cuda_equals_the_cpus():
    from puzzlekit.passes.puzzle.bld import linear_fit

    g = torch.Generator().manual_seed(0)
    x, d, norm = torch.randn(4, 32, 16, generator=g), torch.randn(4, 32, 16, generator=g), torch.rand(16, generator=g)
    got = linear_fit(norm, 1e-5, x.cuda(), d.cuda())
    assert got.device.type == "cuda"
    torch.testing.assert_close(got.cpu(), linear_fit(norm, 1e-5, x, d), rtol=1e-4, atol=1e-5)


# -- TF32 --------------------------------------------------------------------------------------------------------------
def test_resolving_cuda_leaves_the_process_wide_tf32_flags_alone(gpus, tf32_flags):
    gpus(1)
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, False
    assert resolve("cuda") == Compute(CUDA0, torch.bfloat16)
    assert resolve("cuda:0", "float32").device == CUDA0 and resolve("cpu").device.type == "cpu"
    assert tf32_flags() == [False, False]


def test_tf32_is_set_inside_a_forward_that_asks_for_it_and_restored_after(tf32_flags):
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, True
    fast, exact = Compute(CUDA0, tf32=True), Compute(CUDA0)
    with fast.matmul_precision():
        assert tf32_flags() == [True, True]
        with exact.autocast():  # an exact forward inside (a teacher, a scorer): IEEE float32 there
            assert tf32_flags() == [False, False]
        assert tf32_flags() == [True, True]
    assert tf32_flags() == [False, True]
    with pytest.raises(RuntimeError):
        with fast.matmul_precision():
            raise RuntimeError("a failing forward")
    assert tf32_flags() == [False, True]
    torch.backends.cuda.matmul.allow_tf32 = True
    with Compute(tf32=False).autocast(), BF16.autocast():  # nothing changes on CPU
        assert tf32_flags() == [True, True] and torch.is_autocast_enabled("cpu")


def test_distillation_trains_with_tf32_and_its_teacher_computes_exactly(parent, monkeypatch):
    from puzzlekit.passes import PassManager
    from puzzlekit.passes.distill import Distill, distill, run

    built, original = {}, run._build

    def build(prog, compute, mesh, train, checkpointing, **state):
        built["student" if train else "teacher"] = compute
        return original(prog, compute, mesh, train, checkpointing, **state)
    monkeypatch.setattr(run, "_build", build)
    child = parent.copy()
    PassManager("drop-blocks{layers=[2]}").run(child)
    distill(child, parent, Distill(steps=1, batch=2, seq=16, eval_every=1, eval_windows=1))
    assert built["student"].tf32 and not built["teacher"].tf32


# -- torchrun: one GPU per rank ----------------------------------------------------------------------------------------
def test_under_torchrun_each_rank_takes_its_own_gpu_and_another_is_refused(gpus):
    gpus(2, local=1, world=2)
    assert resolve("cuda").device == resolve("auto").device == resolve("cuda:1").device == torch.device("cuda", 1)
    with pytest.raises(DeviceError, match=r"cuda:0.*every rank would compute on GPU 0.*use --device cuda"):
        resolve("cuda:0")
    gpus(1, local=1, world=2)  # more ranks on the node than GPUs
    with pytest.raises(DeviceError, match="more processes on this node than it has GPUs"):
        resolve("cuda")
    gpus(2)  # one process: any GPU it names
    assert resolve("cuda:1").device == torch.device("cuda", 1) and resolve("cuda").device == CUDA0


# -- float16's loss scaler ---------------------------------------------------------------------------------------------
def test_float16_trains_with_a_loss_scaler_and_other_dtypes_without():
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    assert BF16.grad_scaler() is None and Compute().grad_scaler() is None
    assert Compute(CUDA0, torch.bfloat16).grad_scaler() is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no CUDA here: the scaler says so and disables itself
        scaler = Compute(CUDA0, torch.float16).grad_scaler()
        sharded = Compute(CUDA0, torch.float16).grad_scaler(sharded=True)
    assert isinstance(scaler, torch.amp.GradScaler) and not isinstance(scaler, ShardedGradScaler)
    assert isinstance(sharded, ShardedGradScaler)
    assert scaler.is_enabled() == sharded.is_enabled() == torch.cuda.is_available()


def _tiny_fit(scaler=None, steps=3, target=1.0, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    g = torch.Generator().manual_seed(0)

    def step_loss(step):
        x = torch.randn(16, 8, generator=g)
        loss = (model(x) - target * x.sum(-1, keepdim=True)).pow(2).mean()
        return loss, {"loss": loss.item()}

    run = fit(model, step_loss, Schedule(steps=steps, lr=1e-2, clip=0.5), rng=g, scaler=scaler, **kw)
    return model, run


def test_a_loss_scaler_scales_the_backward_unscales_before_clipping_and_skips_overflows(tmp_path):
    plain, _ = _tiny_fit()
    scaled, _ = _tiny_fit(torch.amp.GradScaler("cpu", init_scale=2.0 ** 10))
    for a, b in zip(plain.parameters(), scaled.parameters()):  # a power of two: exact both ways
        assert torch.equal(a, b)
    huge = torch.amp.GradScaler("cpu", init_scale=2.0 ** 127)  # gradients overflow: the step is skipped
    start, _ = _tiny_fit(steps=0, target=100.0)
    skipped, run = _tiny_fit(huge, steps=1, target=100.0, state_file=tmp_path / "s.pt")
    assert run.step == 1 and huge.get_scale() == 2.0 ** 126
    for a, b in zip(start.parameters(), skipped.parameters()):
        assert torch.equal(a, b)
    assert torch.load(tmp_path / "s.pt", weights_only=True)["scaler"]["scale"] == 2.0 ** 126  # resumes with it
    again = torch.amp.GradScaler("cpu", init_scale=2.0 ** 127)
    _tiny_fit(again, steps=1, target=100.0, state_file=tmp_path / "s.pt")
    assert again.get_scale() == 2.0 ** 126


# -- the process group -------------------------------------------------------------------------------------------------
def test_the_process_group_waits_long_for_a_rank_working_alone(monkeypatch):
    import torch.distributed as dist

    from puzzlekit import training

    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv(training.DIST_TIMEOUT_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert training.distributed() == (1, 2)
    assert calls[-1] == ("gloo", {"timeout": datetime.timedelta(hours=4)})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(("set_device", i)))
    monkeypatch.setenv(training.DIST_TIMEOUT_ENV, "90")
    training.distributed()
    # (gloo beside NCCL: an offloaded run's gradient clipping reduces host tensors)
    assert calls[-2:] == [("set_device", 1), ("cpu:gloo,cuda:nccl", {"device_id": torch.device("cuda", 1),
                                                                     "timeout": datetime.timedelta(seconds=90)})]
    for bad in ("0", "-5", "soon", "inf"):
        monkeypatch.setenv(training.DIST_TIMEOUT_ENV, bad)
        with pytest.raises(UsageError, match=training.DIST_TIMEOUT_ENV):
            training.distributed()


# -- FSDP2 mixed precision, the teacher's dtype ------------------------------------------------------------------------
def _fake_fsdp(monkeypatch) -> list:
    """fully_shard replaced by a recorder: (module, its keywords) per call."""
    import torch.distributed.fsdp as fsdp

    calls = []

    def fully_shard(module, **kw):
        calls.append((module, kw))
        module.set_reduce_scatter_unused_params = lambda flag: None
        return module
    monkeypatch.setattr(fsdp, "fully_shard", fully_shard)
    monkeypatch.setattr(fsdp, "register_fsdp_forward_method", lambda module, name: None)
    return calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fsdp_gathers_the_students_blocks_in_the_compute_dtype_and_reduces_in_float32(parent, monkeypatch, dtype):
    from puzzlekit.passes.distill.sharding import shard_model

    calls = _fake_fsdp(monkeypatch)
    student = ProgramModule(parent, device="meta")
    student.compute = Compute(dtype=dtype)
    shard_model(student, mesh=None)
    *groups, (root, root_kw) = calls
    assert root is student and "mp_policy" not in root_kw  # the embedding and heads: float32
    assert len(groups) >= len(parent.blocks()) - len(parent.find("noop"))
    for _, kw in groups:
        if dtype == torch.float32:
            assert "mp_policy" not in kw
        else:
            p = kw["mp_policy"]
            assert (p.param_dtype, p.reduce_dtype, p.cast_forward_inputs) == (dtype, torch.float32, False)
    assert all(p.dtype == torch.float32 for p in student.parameters())  # the master shards


def _held_dtypes(model, prog) -> tuple[set, set]:
    """(names of parameters held below float32, names an op keeps in float32)."""
    from puzzlekit.passes.distill.sharding import fp32_names

    return {n for n, p in model.named_parameters() if p.dtype != torch.float32}, fp32_names(prog)


def _matmul_weights(model) -> set:
    """The weights of the model's GEMMs and convolutions: Linear and Conv1d weights, routed experts' stacks."""
    from puzzlekit.ir.ops.routed import RoutedExperts

    return ({f"{n}.weight" for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv1d))}
            | {f"{n}.{side}" for n, m in model.named_modules() if isinstance(m, RoutedExperts)
               for side in ("up_proj", "down_proj")})


def test_the_frozen_teacher_is_held_in_the_compute_dtype_and_computes_the_same_numbers(parent):
    from puzzlekit.passes.distill.sharding import _build

    teacher = _build(parent, BF16, None, train=False, checkpointing=False)
    low, fp32 = _held_dtypes(teacher, parent)
    assert fp32 and low and not low & fp32
    assert low == _matmul_weights(teacher) - fp32  # norms, biases, routers, SSM parameters, embedding: float32
    assert {p.dtype for n, p in teacher.named_parameters() if n in low} == {torch.bfloat16}
    student = _build(parent, BF16, None, train=True, checkpointing=False)
    assert all(p.dtype == torch.float32 for p in student.parameters())
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # autocast casts those weights anyway: the same logits as float32 weights give
        torch.testing.assert_close(teacher(ids)[0], materialize(parent, compute=BF16)(ids)[0], rtol=0, atol=0)
    assert all(p.dtype == torch.float32 for p in _build(parent, Compute(), None, False, False).parameters())


def test_the_sharded_teacher_is_read_in_the_compute_dtype_and_gathered_as_held(parent, monkeypatch):
    from puzzlekit.passes.distill.sharding import _build

    calls = _fake_fsdp(monkeypatch)
    teacher = _build(parent, BF16, mesh=object(), train=False, checkpointing=False)
    assert all("mp_policy" not in kw for _, kw in calls)
    low, fp32 = _held_dtypes(teacher, parent)
    assert low == _matmul_weights(teacher) - fp32 and low


# -- pinned host copies of streamed activations ------------------------------------------------------------------------
def test_a_tape_keeps_cpu_values_as_they_are_and_copies_cuda_ones_into_pinned_memory(monkeypatch):
    x = torch.randn(3, 4)
    host, pinned = stream.to_host(x)
    assert host.data_ptr() == x.data_ptr() and not pinned  # CPU: no copy, nothing pinned
    tape = stream.Tape([1 << 20])
    tape.append(x)
    assert torch.equal(tape[0], x) and tape[0].device.type == "cpu"

    asked, copies = [], []

    class Host:
        def copy_(self, src, non_blocking=False):
            copies.append((src, non_blocking))
            return self

    def empty(shape, dtype=None, pin_memory=False):
        asked.append((tuple(shape), dtype, pin_memory))
        return Host()

    class OnCuda:  # what a CUDA tensor shows the helper
        device, shape, dtype = CUDA0, (3, 4), torch.bfloat16

        def detach(self):
            return self
    monkeypatch.setattr(torch, "empty", empty)
    value = OnCuda()
    host, pinned = stream.to_host(value)
    assert pinned and isinstance(host, Host) and asked == [((3, 4), torch.bfloat16, True)]
    assert copies == [(value, True)]  # queued, not waited for


@cuda
def test_a_tape_on_cuda_round_trips_through_pinned_memory():
    room = [1 << 20]
    tape = stream.Tape(room)
    values = [torch.randn(4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    for v in values:
        tape.append(v * 1)  # the source is freed and its memory reused at once
    assert all(held.is_pinned() and pinned for held, pinned, _ in tape._items)
    for v, back in zip(values, (tape[b] for b in range(len(tape)))):
        assert back.device == v.device and torch.equal(back, v)
    spilled = stream.Tape([0])  # past the room: a scratch file
    spilled.append(values[0])
    assert torch.equal(spilled[0], values[0])


@cuda
def test_float16_training_on_cuda_scales_its_loss(parent):
    from puzzlekit.passes.puzzle.bld import distill_block

    compute = resolve("cuda", "float16")
    scaler = compute.grad_scaler()
    assert scaler is not None and scaler.is_enabled()
    block = torch.nn.Sequential(torch.nn.Linear(16, 16)).cuda()
    x = torch.randn(8, 4, 16, device="cuda")
    d = torch.randn(8, 4, 16, device="cuda") * 1e-3

    class Wrap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = block

        def forward(self, h):
            return h + self.inner(h), ()
    got = distill_block(Wrap(), x, d, tokens=256, seed=0, compute=compute)
    assert got["steps"] > 0 and all(torch.isfinite(p).all() for p in block.parameters())
